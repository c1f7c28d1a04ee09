"""Runtime stage: `thorgen bench --video FILE`: one video's sampled frames ahead of the text prompt, timed: the
decode and frame sampling (PyAV, on the CPU), the frames' preprocessing (resize, patches), the vision tower over
every frame, TTFT (encode + prefill, the encoder cache kept out of it) and decode after it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ..backend import BackendError, ImageSpan
from ..media.prompts import expand_image_tokens, frames_layout
from ..media.video import DEFAULT_BUDGET, VideoError, VideoInput, decode, load_video, preprocess_frames
from ..text.tokenizer import Tokenizer
from .image import median_ms, timed_prompt, tower_encoder


def video_prompt(
    spec: Any, tokenizer: Tokenizer, text: list[int], video: VideoInput
) -> tuple[list[int], list[ImageSpan]]:
    """<bos>, the video's frames (timestamps, boi, soft tokens, eoi), then the rest of the text prompt."""
    layout = tokenizer.encode(frames_layout(video, lambda i: tokenizer.id_to_token(i) or "", spec.vision))
    return expand_image_tokens([text[0], *layout, *text[1:]], [], spec.vision, list(video.frames))


def measure_video(
    backend: Any,
    report: dict,
    path: Path,
    tokenizer: Tokenizer,
    text: list[int],
    gen: int,
    runs: int,
    budget: int = DEFAULT_BUDGET,
    num_frames: int | None = None,
) -> None:
    """Add `video` to a `run_bench` report: the clip's frames and soft tokens, decode_ms (PyAV decode and frame
    sampling), preprocess_ms, encode_ms (every frame through the tower; None without one), and the TTFT and decode
    tok/s of the video + text prompt (medians). The prompt is checked against the context before anything is
    timed."""
    spec = backend.spec
    if spec.vision is None:
        raise BackendError("--video: this model has no vision tower")
    data = path.read_bytes()
    decodes, preps = [], []
    try:
        video = load_video(data, spec.vision, budget, num_frames=num_frames)
        for _ in range(runs):
            t0 = time.perf_counter()
            frames, *_ = decode(data, num_frames)
            t1 = time.perf_counter()
            preprocess_frames(frames, spec.vision, budget)
            decodes.append(t1 - t0)
            preps.append(time.perf_counter() - t1)
    except VideoError as exc:
        raise BackendError(f"--video {path}: {exc}") from None
    ids, spans = video_prompt(spec, tokenizer, text, video)
    if len(ids) + gen > backend.max_context:
        raise BackendError(
            f"the video's {len(video.frames)} frames ({video.soft_tokens} soft tokens) + the prompt + --gen "
            f"({len(ids) + gen}) exceed the context of {backend.max_context} (--ctx)"
        )
    encode = tower_encoder(backend)
    encodes = []
    if encode is not None:
        for _ in range(runs):
            t0 = time.perf_counter()
            for frame in video.frames:
                encode(frame)
            encodes.append(time.perf_counter() - t0)
    timed = timed_prompt(backend, ids, spans, gen, runs)
    height, width = frames[0].shape[:2]
    report["video"] = {
        "file": path.name,
        "width": int(width),
        "height": int(height),
        "fps": round(video.fps, 3),
        "total_frames": video.total_frames,
        "frames": len(video.frames),
        "budget": budget,
        "soft_tokens": video.soft_tokens,
        "prompt_tokens": len(ids),
        "decode_ms": median_ms(decodes),
        "preprocess_ms": median_ms(preps),
        "encode_ms": median_ms(encodes) if encodes else None,
        **timed,
    }


def video_text(run: dict) -> str:
    """The bench's text line for the video."""
    v = run["video"]
    encode = "n/a (no tower exposed)" if v.get("encode_ms") is None else f"{v['encode_ms']:.1f} ms"
    return (
        f"  video           {v['file']} {v['width']}x{v['height']}, {v['frames']} of {v['total_frames']} frames "
        f"at {v['budget']} soft tokens ({v['soft_tokens']} in all, {v['prompt_tokens']} prompt tokens; medians, "
        f"TTFT includes the encode): decode + sampling {v['decode_ms']:.1f} ms (CPU), preprocess "
        f"{v['preprocess_ms']:.1f} ms, encode {encode}, TTFT {v['ttft_ms']:.1f} ms, "
        f"decode {v['decode_tok_s']:.2f} tok/s"
    )
