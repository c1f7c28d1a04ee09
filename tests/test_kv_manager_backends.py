"""Both backends under the one KV manager: a scripted multi-turn chat with images between two users, and a third
request that preempts them, run through an engine core on the cuda backend (CPU emulator) and on the reference
backend's engine-precision mode (fed the engine's image rows, as tests/test_engine_images_emulated.py does). The
two give every request the same cached prompt tokens and the same greedy tokens. The cuda runner launches no step
ahead here, so the two schedules grant the same positions step for step (a step launched ahead is granted its
positions too, which the reference never writes)."""

from __future__ import annotations

import dataclasses

import pytest

import engine_emulator as EE
from test_engine_images_emulated import EngineRows, image_bytes

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
pytest.importorskip("PIL.Image")

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.media.images import load_image  # noqa: E402
from thorgen.runtime.media.prompts import expand_image_tokens  # noqa: E402

PAGES = 10  # KV pages of 16 positions the two runners share out: the third request preempts as they grow


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.backend import ReferenceBackend

    ck = Checkpoint.open(tiny_checkpoint)
    root = tmp_path_factory.mktemp("kv_backends")
    weights = repack(tiny_checkpoint, root / "weights")
    kernels = EE.write_fake_manifest(ck.spec, root / "kernels")
    drv = EE.install(kernels)
    cuda = open_backend(tiny_checkpoint, ctx=1024, weights_dir=weights, kernels_dir=kernels, max_num_seqs=2)
    ref = ReferenceBackend(ck, max_context=1024, numerics="w4a16", kernels=kernels)
    ref.encoder_cache.model = EngineRows(cuda.engine)
    yield cuda, ref, ck
    dev.set_driver(drv)
    cuda.close()
    dev.set_driver(None)


def _turn(spec, history: list[int], text: list[int], seed: int | None) -> tuple[list[int], list]:
    """A user turn after `history` (the earlier turns' ids, images already expanded): text, then one image unless
    `seed` is None; the ids and the new image's span."""
    vision = spec.vision
    ids = history + [105] + text
    if seed is None:
        return ids + [106, 105], []
    image = load_image(image_bytes(seed, (60, 90)), vision, 70)
    return expand_image_tokens(ids + [vision.image_token_id, 45, 106, 105], [image], vision)


def _waves(spec, out: dict) -> list[list[tuple[str, list[int], list, int]]]:
    """Waves of (request id, ids, image spans, max tokens), each submitted once the one before finished (`out`:
    what earlier waves produced): two conversations with an image each; the first one's prompt again; the
    second's next turn beside a third request, which grow until one preempts the other."""
    a1, sa = _turn(spec, [2], list(range(200, 240)), 1)
    b1, sb = _turn(spec, [2], list(range(200, 224)), 2)
    waves = [[("a1", a1, sa, 8), ("b1", b1, sb, 8)], [("a2", a1, sa, 6)]]
    if "b1" in out:
        b2, _ = _turn(spec, b1 + out["b1"][0] + [106], list(range(250, 256)), None)
        waves.append([("b2", b2, sb, 12), ("c", [2] + list(range(300, 340)), [], 60)])
    return waves


def _run(runner, spec) -> dict:
    core = EngineCore(runner)
    out: dict = {}
    for n in range(3):
        for rid, ids, spans, most in _waves(spec, out)[n]:
            core.add(rid, ids, most, SamplingParams(), images=tuple(spans))
        tokens: dict = {}
        while core.unfinished:
            for o in core.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
                if o.finished:
                    out[o.request_id] = (
                        tokens.get(o.request_id, []),
                        o.result.cached_prompt_tokens,
                        o.result.finish_reason,
                    )
    return out


def test_same_cached_tokens_and_tokens_on_both_backends(pair):
    cuda, ref, ck = pair
    cuda_runner = cuda.runner(2, kv_tokens=PAGES * 16)
    cuda_runner.launch_ahead, cuda_runner.lookahead = False, 0
    ref_runner = ref.runner(2, kv_tokens=PAGES * 16)
    ref_runner.prefill_chunk = cuda_runner.prefill_chunk
    assert ref_runner.kv_geometry == dataclasses.replace(cuda_runner.kv_geometry)  # one geometry, one policy
    preempted = []
    release = cuda_runner.release

    def spy(seq, finished):
        if not finished:
            preempted.append(seq.request_id)
        release(seq, finished)

    cuda_runner.release = spy
    got, want = _run(cuda_runner, ck.spec), _run(ref_runner, ck.spec)
    assert got == want
    assert preempted, "the third wave did not preempt"
    assert got["a2"][1] > 0 and got["b2"][1] > 0  # a repeated prompt and a conversation's next turn hit
