"""Images end to end on the reference backend: the engine client carries image spans, the scheduler never ends a
prefill chunk inside one, prefix-cache keys tell different images apart (and the same image hits), the encoder
cache keys by content, and preemption by recompute keeps the images."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.conventions import KV_PAGE
from thorgen.runtime.backend import BackendError, SamplingParams
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.media.images import load_image
from thorgen.runtime.media.prompts import expand_image_tokens
from thorgen.runtime.reference.backend import ReferenceBackend


def image(seed: int, size=(60, 90)):
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    return ReferenceBackend(tiny_ckpt, max_context=512)


def prompt(tiny_ckpt, *seeds, text=(30, 31, 32), tail=()):
    vision = tiny_ckpt.spec.vision
    imgs = [load_image(image(s), vision, 70) for s in seeds]
    ids = [2, 105, *text]
    for _ in imgs:
        ids += [vision.image_token_id, 45]
    return expand_image_tokens(ids + [*tail, 106, 105], imgs, vision)


def run(core: EngineCore, requests: dict, max_tokens: int = 6) -> dict:
    for rid, (ids, spans) in requests.items():
        core.add(rid, ids, max_tokens, SamplingParams(), images=tuple(spans))
    out = {rid: [] for rid in requests}
    results = {}
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                results[o.request_id] = o.result
    return out, results


def test_no_chunk_splits_an_image_span(tiny_ckpt, backend) -> None:
    ids, spans = prompt(tiny_ckpt, 1, 2)
    runner = backend.runner(1)
    runner.prefill_chunk = 16  # far shorter than an image (~21 soft tokens at this size)
    chunks = []
    original = runner.prefill

    def spy(seq, start, end, sample, launched=None, beside=False):
        chunks.append((start, end))
        return original(seq, start, end, sample, launched, beside)

    runner.prefill = spy
    core = EngineCore(runner, max_step_tokens=16)
    tokens, _ = run(core, {"a": (ids, spans)})
    assert all(s.image.soft_tokens > 16 for s in spans)
    for start, end in chunks:
        for s in spans:
            assert not (s.offset < start < s.end) and not (s.offset < end < s.end), (start, end, s.offset, s.end)
    whole = ReferenceBackend(tiny_ckpt, max_context=512).generate(ids, 6, SamplingParams(), images=spans)
    assert tokens["a"] == whole.token_ids  # chunked == one prefill


def one(core: EngineCore, rid: str, ids, spans, max_tokens: int = 6):
    """One request through a long-lived engine core (a server's): its result."""
    return run(core, {rid: (ids, spans)}, max_tokens)[1][rid]


def test_prefix_cache_keys_images_by_content(tiny_ckpt) -> None:
    backend = ReferenceBackend(tiny_ckpt, max_context=512)
    core = EngineCore(backend.runner(2))
    tail = tuple(range(200, 220))  # (text after the image: whole pages past its span)
    ids_a, spans_a = prompt(tiny_ckpt, 1, tail=tail)
    ids_b, spans_b = prompt(tiny_ckpt, 2, tail=tail)
    assert ids_a == ids_b and spans_a[0].image.hash != spans_b[0].image.hash  # same size, same placeholders
    first = one(core, "first", ids_a, spans_a)
    other = one(core, "other", ids_b, spans_b)
    # the other image reuses only the text before its span, never the first image's K/V
    assert other.cached_prompt_tokens <= spans_b[0].offset
    fresh = ReferenceBackend(tiny_ckpt, max_context=512).generate(ids_b, 6, SamplingParams(), images=spans_b)
    assert other.token_ids == fresh.token_ids
    again = one(core, "again", ids_a, spans_a)
    assert again.cached_prompt_tokens > spans_a[0].end and again.token_ids == first.token_ids
    assert backend.encoder_cache.encoded == 2  # each image through the tower once


def test_a_cache_hit_never_ends_inside_a_span(tiny_ckpt) -> None:
    """The same image again where the last whole page before the prompt's last token ends inside the image: the
    hit stops at the page boundary before the image (its span runs whole), and the tokens are a full prefill's."""
    for n in range(14, 80):
        ids, spans = prompt(tiny_ckpt, 3, text=tuple(range(200, 200 + n)))
        last_page = (len(ids) - 1) // KV_PAGE * KV_PAGE
        if spans[0].offset >= KV_PAGE and spans[0].offset < last_page < spans[0].end:
            break
    else:
        raise AssertionError("no prompt puts a page boundary inside the image")
    core = EngineCore(ReferenceBackend(tiny_ckpt, max_context=512).runner(2))
    first = one(core, "first", ids, spans, 4)
    result = one(core, "again", ids, spans, 4)
    assert result.cached_prompt_tokens == spans[0].offset // KV_PAGE * KV_PAGE > 0
    assert result.token_ids == first.token_ids


def test_preemption_with_images_gives_the_same_tokens(tiny_ckpt) -> None:
    reqs = {f"r{k}": prompt(tiny_ckpt, 10 + k, text=(30 + k, 31)) for k in range(3)}
    alone = {
        rid: ReferenceBackend(tiny_ckpt, max_context=512).generate(ids, 24, SamplingParams(), images=sp).token_ids
        for rid, (ids, sp) in reqs.items()
    }
    backend = ReferenceBackend(tiny_ckpt, max_context=512, prefix_cache=False)
    longest = max(len(ids) for ids, _ in reqs.values())
    blocks = 2 * -(-(longest + 1) // 16) + 1  # two prompts and a block: growing to 24 tokens each preempts
    runner = backend.runner(3, kv_tokens=16 * blocks)
    preempted = []
    release = runner.release

    def spy(seq, finished):
        if not finished:
            preempted.append(seq.request_id)
        release(seq, finished)

    runner.release = spy
    tokens, _ = run(EngineCore(runner, max_step_tokens=64), reqs, 24)
    assert preempted  # the KV budget forced a recompute
    assert tokens == alone


def test_bad_image_requests_are_refused(tiny_ckpt, backend) -> None:
    ids, spans = prompt(tiny_ckpt, 1)
    with pytest.raises(BackendError, match="placeholder"):
        backend.generate(ids + [tiny_ckpt.spec.vision.image_token_id], 2, SamplingParams(), images=spans)
    with pytest.raises(BackendError, match="placeholder"):
        backend.generate(ids, 2, SamplingParams())  # placeholders without their image


def test_engine_client_submit_carries_images(tiny_ckpt) -> None:
    from thorgen.runtime.client import EngineClient

    ids, spans = prompt(tiny_ckpt, 4)
    want = ReferenceBackend(tiny_ckpt, max_context=512).generate(ids, 5, SamplingParams(), images=spans).token_ids

    async def go():
        client = EngineClient(lambda: ReferenceBackend(tiny_ckpt, max_context=512))
        try:
            client.wait_ready()
            got = []
            async for out in client.submit(ids, 5, SamplingParams(), images=spans):
                got += out.token_ids
            return got
        finally:
            client.close()

    assert asyncio.run(go()) == want
