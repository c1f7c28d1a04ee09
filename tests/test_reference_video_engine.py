"""Video on the reference backend's engine: a clip's frames are image spans; no prefill chunk ends inside a
frame, a re-sent clip hits the encoder and prefix caches, and preemption by recompute keeps the frames."""

from __future__ import annotations

import pytest

pytest.importorskip("av")

from test_reference_images_engine import run  # noqa: E402
from video_clips import mp4, video_prompt  # noqa: E402

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.media.video import load_video  # noqa: E402
from thorgen.runtime.reference.backend import ReferenceBackend  # noqa: E402


def clip_prompt(tiny_checkpoint, tiny_ckpt, frames=6, num_frames=3, before="Watch:"):
    video = load_video(mp4(frames=frames), tiny_ckpt.spec.vision, num_frames=num_frames)
    return video_prompt(tiny_checkpoint, tiny_ckpt.spec.vision, [video], before=before)


def test_no_chunk_splits_a_frame(tiny_checkpoint, tiny_ckpt) -> None:
    ids, spans = clip_prompt(tiny_checkpoint, tiny_ckpt)
    runner = ReferenceBackend(tiny_ckpt, max_context=512).runner(1)
    runner.prefill_chunk = 16  # shorter than a frame (63 soft tokens)
    chunks = []
    original = runner.prefill

    def spy(seq, start, end, sample, launched=None, beside=False):
        chunks.append((start, end))
        return original(seq, start, end, sample, launched, beside)

    runner.prefill = spy
    tokens, _ = run(EngineCore(runner, max_step_tokens=16), {"a": (ids, spans)})
    assert all(s.image.soft_tokens > 16 for s in spans) and len(chunks) > len(spans)
    for start, end in chunks:
        for s in spans:
            assert not (s.offset < start < s.end) and not (s.offset < end < s.end), (start, end, s.offset, s.end)
    whole = ReferenceBackend(tiny_ckpt, max_context=512).generate(ids, 6, SamplingParams(), images=spans)
    assert tokens["a"] == whole.token_ids


def test_a_resent_clip_hits_the_caches(tiny_checkpoint, tiny_ckpt) -> None:
    backend = ReferenceBackend(tiny_ckpt, max_context=512)
    core = EngineCore(backend.runner(2))
    ids, spans = clip_prompt(tiny_checkpoint, tiny_ckpt)
    first = run(core, {"first": (ids, spans)})[1]["first"]
    assert backend.encoder_cache.encoded == 3  # one encode per frame
    again_ids, again_spans = clip_prompt(tiny_checkpoint, tiny_ckpt)  # decoded again: same content hashes
    again = run(core, {"again": (again_ids, again_spans)})[1]["again"]
    assert backend.encoder_cache.encoded == 3
    assert again.cached_prompt_tokens >= spans[-1].offset and again.token_ids == first.token_ids


def test_preemption_with_a_video_gives_the_same_tokens(tiny_checkpoint, tiny_ckpt) -> None:
    reqs = {
        f"r{k}": clip_prompt(tiny_checkpoint, tiny_ckpt, frames=4 + k, num_frames=2, before=f"Clip {k}:")
        for k in range(3)
    }
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
    assert preempted
    assert tokens == alone
