"""CPU tests of video on the CUDA engine in the emulator (tests/engine_emulator.py): a clip's frames are image
spans at 70 soft tokens, encoded by the engine's tower, token-exact against the reference backend's engine-precision
mode sharing the engine's rows (tests/test_engine_images_emulated.py's pair); a re-sent clip runs no frame through
the tower again and hits the prefix cache past its frames."""

from __future__ import annotations

import pytest

pytest.importorskip("av")
pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from test_engine_images_emulated import GEN, pair  # noqa: E402  (the emulated engine and its reference)
from video_clips import mp4, video_prompt  # noqa: E402

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.media.video import load_video  # noqa: E402

__all__ = ["pair"]


@pytest.fixture(scope="module")
def clip(pair, tiny_checkpoint):
    _, _, ck = pair
    video = load_video(mp4(frames=6), ck.spec.vision, num_frames=3)
    return video_prompt(tiny_checkpoint, ck.spec.vision, [video], after="What moves? " * 8)


def test_greedy_with_a_video_equals_w4a16_reference(pair, clip):
    cuda, ref, ck = pair
    ids, spans = clip
    assert len(spans) == 3 and all(ids[s.offset] == ck.spec.vision.video_token_id for s in spans)
    got = cuda.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    want = ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    assert len(want) == GEN and got == want


def test_a_resent_clip_hits_the_encoder_and_prefix_caches(pair, clip, tiny_checkpoint):
    from thorgen.runtime.cuda.runner import CudaRunner
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    ids, spans = clip
    core = EngineCore(CudaRunner(cuda.engine, max_num_seqs=1))

    def run(rid):
        core.add(rid, ids, GEN, SamplingParams(), images=tuple(spans))
        toks, cached = [], None
        while core.unfinished:
            for o in core.step():
                toks += o.token_ids
                if o.finished:
                    cached = o.result.cached_prompt_tokens
        return toks, cached

    first, _ = run("first")
    encoded = cuda.engine.encoder_cache.encoded
    # the same clip decoded again (a client that sends it twice): equal frames by content hash
    again_video = load_video(mp4(frames=6), ck.spec.vision, num_frames=3)
    assert [f.hash for f in again_video.frames] == [s.image.hash for s in spans]
    again, hit = run("again")
    assert cuda.engine.encoder_cache.encoded == encoded  # no frame through the tower again
    assert hit >= spans[-1].end, (hit, spans[-1].end)
    assert again == first == ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids
