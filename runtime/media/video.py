"""Runtime stage: one video's bytes -> sampled frames (PyAV) -> one ImageInput per frame, as HF's Gemma4 video
processor makes them.

Decode (PyAV, which ships its own FFmpeg: mp4, webm, mov, gif, ...), count the frames (the container's count
when it has one, as HF's PyAV loader takes it, else by decoding), pick frames uniformly (HF's
`default_sample_indices_fn`: index i * total // n), convert each to RGB (`to_ndarray("rgb24")`, as HF's loader),
resize with torchvision's antialiased bicubic (runtime/media/video_resize.py; not Pillow, which the image path
uses) to the image path's target size at the frame budget (70 soft tokens unless asked otherwise), and cut into
patches like an image. Timestamps are frame index / the stream's average rate (HF's `VideoMetadata.timestamps`).
Anything unusable raises VideoError with a message fit for a 400.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np

from ...model_spec.types import Gemma4VisionSpec
from ..backend import ImageInput
from .images import SOFT_TOKEN_BUDGETS, ImageError, content_hash, target_size
from .video_resize import resize_frames

DEFAULT_FRAMES = 32  # HF's Gemma4VideoProcessor.num_frames, vLLM's cap
DEFAULT_BUDGET = 70  # soft tokens per frame (HF's Gemma4VideoProcessor.max_soft_tokens)
DEFAULT_FPS = 24.0  # HF's fallback when a stream states no rate
MAX_BYTES = 64 << 20
MAX_DURATION_S = 3600.0  # a longer stream is refused before any frame is decoded
MAX_FRAMES = 100_000  # frames a stream may have (counted ones included)
MAX_FRAME_PIXELS = 4096 * 4096
DECODE_SECONDS = 30.0  # wall time the decoder may take over one video


@dataclass(frozen=True)
class VideoLimits:
    """What a video may be: its file's bytes, its duration, and the wall time its decode may take."""

    max_bytes: int = MAX_BYTES
    max_duration_s: float = MAX_DURATION_S
    decode_seconds: float = DECODE_SECONDS


class VideoError(ValueError):
    """A video that cannot be used (undecodable, no video stream, no frames, too long or large): says why."""


@dataclass(frozen=True)
class VideoInput:
    """A sampled, preprocessed clip: its frames (each an image to the tower), their times in seconds, the stream's
    frame rate and how many frames it had."""

    frames: tuple[ImageInput, ...]
    timestamps: tuple[float, ...]
    fps: float
    total_frames: int

    @property
    def soft_tokens(self) -> int:
        return sum(f.soft_tokens for f in self.frames)


def sample_indices(
    total: int,
    num_frames: int | None = None,
    fps: float | None = None,
    video_fps: float = 0.0,
    max_frames: int = DEFAULT_FRAMES,
) -> np.ndarray:
    """Frame indices to keep: `num_frames` (or, given `fps`, total / video_fps * fps) uniformly, never more
    than `max_frames` nor than the clip has; HF's `default_sample_indices_fn` for the count."""
    if num_frames is not None and fps is not None:
        raise VideoError("num_frames and fps are mutually exclusive: give one")
    if num_frames is not None and num_frames < 1:
        raise VideoError(f"num_frames must be at least 1, not {num_frames}")
    if fps is not None:
        if not fps > 0:
            raise VideoError(f"fps must be positive, not {fps}")
        num_frames = max(1, int(total / (video_fps or DEFAULT_FPS) * fps))
    n = min(num_frames if num_frames is not None else max_frames, max_frames, total)
    return np.arange(n, dtype=np.int64) * total // n


def _open(data: bytes):  # type: ignore[no-untyped-def]
    import av  # the serve extra's decoder, imported only when a video comes

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, OSError, EOFError) as exc:
        raise VideoError(f"the data is not a video this server can read: {exc}") from None
    if not container.streams.video:
        container.close()
        raise VideoError("the file has no video stream (audio only?)")
    return container


def _frames(container, deadline: float, limit_s: float):  # type: ignore[no-untyped-def]
    import av

    try:
        for frame in container.decode(video=0):
            if time.monotonic() > deadline:
                raise VideoError(f"decoding the video took longer than {limit_s:g} s")
            yield frame
    except av.FFmpegError as exc:
        raise VideoError(f"the video cannot be decoded: {exc}") from None


def decode(
    data: bytes,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int = DEFAULT_FRAMES,
    limits: VideoLimits = VideoLimits(),
) -> tuple[list[np.ndarray], list[int], float, int]:
    """(sampled RGB frames uint8 [H, W, 3], their indices, the stream's fps, its frame count)."""
    if not data:
        raise VideoError("the video is empty (0 bytes)")
    if len(data) > limits.max_bytes:
        raise VideoError(f"the video is {len(data)} bytes; at most {limits.max_bytes} are accepted")
    longest = limits.max_duration_s
    deadline = time.monotonic() + limits.decode_seconds
    container = _open(data)
    try:
        stream = container.streams.video[0]
        if stream.codec_context is None:  # FFmpeg has no decoder for it
            tag = getattr(stream, "codec_tag", "") or "unknown"
            raise VideoError(f"the video's codec ({tag!r}) is not one this server can decode")
        rate = stream.average_rate or stream.guessed_rate
        video_fps = float(rate) if rate else DEFAULT_FPS
        if stream.width * stream.height > MAX_FRAME_PIXELS:
            raise VideoError(f"the video is {stream.width}x{stream.height}; at most {MAX_FRAME_PIXELS} pixels a frame")
        total = int(stream.frames or 0)
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
            if seconds > longest:
                raise VideoError(f"the video lasts {seconds:.0f} s; at most {longest:g} s are accepted")
        if total > MAX_FRAMES or total / video_fps > longest:
            raise VideoError(
                f"the video has {total} frames ({total / video_fps:.0f} s at {video_fps:g} fps); at most "
                f"{MAX_FRAMES} frames and {longest:g} s are accepted"
            )
        if total == 0:  # no count in the container (webm, some gifs): count by decoding
            for total, _ in enumerate(_frames(container, deadline, limits.decode_seconds), 1):
                if total > MAX_FRAMES or total / video_fps > longest:
                    raise VideoError(
                        f"the video has more than {total} frames ({total / video_fps:.0f} s at {video_fps:g} fps); "
                        f"at most {MAX_FRAMES} frames and {longest:g} s are accepted"
                    )
            container.close()
            container = _open(data)
        if total == 0:
            raise VideoError("the video has no frames")
        indices = sample_indices(total, num_frames, fps, video_fps, max_frames)
        wanted, kept, at = set(indices.tolist()), [], []
        for i, frame in enumerate(_frames(container, deadline, limits.decode_seconds)):
            if i in wanted:
                kept.append(frame.to_ndarray(format="rgb24"))
                at.append(i)
            if i >= indices[-1]:
                break
    finally:
        container.close()
    if not kept:
        raise VideoError("no frame of the video could be decoded")
    return kept, at, video_fps, total


def preprocess_frames(
    frames: list[np.ndarray], vision: Gemma4VisionSpec, budget: int = DEFAULT_BUDGET
) -> list[ImageInput]:
    """RGB frames (one size) -> one ImageInput each: torchvision's resize to the budget's size, then patches."""
    if budget not in SOFT_TOKEN_BUDGETS:
        raise VideoError(f"soft tokens per frame {budget!r} must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}")
    stack = np.stack(frames)
    try:
        th, tw = target_size(stack.shape[1], stack.shape[2], budget, vision)
    except ImageError as exc:
        raise VideoError(str(exc)) from None
    resized = resize_frames(stack, th, tw)
    p = vision.patch_size
    gh, gw = th // p, tw // p
    gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)
    soft = gh * gw // (vision.pooling_kernel_size**2)
    out = []
    for pixels in resized:
        patches = np.ascontiguousarray(pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1))
        out.append(ImageInput(patches, positions, soft, content_hash(patches, (gh, gw))))
    return out


def load_video(
    data: bytes,
    vision: Gemma4VisionSpec,
    budget: int = DEFAULT_BUDGET,
    num_frames: int | None = None,
    fps: float | None = None,
    max_frames: int = DEFAULT_FRAMES,
    limits: VideoLimits = VideoLimits(),
) -> VideoInput:
    """Bytes of a video file -> its VideoInput; VideoError for anything unusable."""
    frames, at, video_fps, total = decode(data, num_frames, fps, max_frames, limits)
    if len({f.shape for f in frames}) != 1:
        raise VideoError("the video's frames change size midway; such streams are not supported")
    images = preprocess_frames(frames, vision, budget)
    return VideoInput(tuple(images), tuple(i / video_fps for i in at), video_fps, total)


def frame_text(seconds: float) -> str:
    """A frame's timestamp as HF's processor writes it before the frame: mm:ss."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"
