"""Serve stage: a request's videos from their sources to VideoInputs (frames sampled and preprocessed), off the
event loop, each decode within a time limit.

A source is read (a data URL's header checked, an http(s) URL fetched within the video size cap) and keyed by a
sha256 of its raw form; the base64 decode, PyAV's decode, the frame sampling and the preprocessing then run on a
small pool of worker threads. A decode is bounded twice: PyAV's frame loop stops at the limit
(runtime.media.video.VideoLimits.decode_seconds), and the request stops waiting at that limit plus a second.
Sampled clips are kept (an LRU bounded by their frames' bytes) by that key and the sampling: a clip sent again is
not decoded again, and its frames carry the content hashes the engine's encoder and prefix caches already hold.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..model_spec.types import Gemma4VisionSpec
from ..runtime.media.images import ImageError
from ..runtime.media.video import DEFAULT_BUDGET, VideoError, VideoInput, VideoLimits, load_video
from .image_loader import BytesBoundedLRU, sha256_of
from .media import MediaOptions, b64_bytes, check_count, data_url_payload, fetch, where_param
from .protocol import APIError
from .request import VideoSampling, VideoSource

T = TypeVar("T")
Key = tuple[str, int, int | None, float | None]  # (sha256 of the raw video, budget, num_frames, fps)
Raw = bytes | tuple[str, int]  # a video's bytes, or a data URL and where its base64 starts
WORKERS = 2  # videos decoded at once (PyAV decodes a stream on its own threads)


class SampledVideos(BytesBoundedLRU[Key, VideoInput]):
    """Recently sampled clips by key, bounded by their frames' bytes."""

    @staticmethod
    def size(value: Any) -> int:
        return sum(int(f.patches.nbytes + f.positions.nbytes) for f in value.frames)


def _sample(raw: Raw, vision: Gemma4VisionSpec, key: Key, limits: VideoLimits) -> VideoInput:
    """A worker thread's job: raw bytes (or a data URL's base64) -> the sampled, preprocessed clip."""
    data = b64_bytes(*raw) if isinstance(raw, tuple) else raw
    return load_video(data, vision, key[1], num_frames=key[2], fps=key[3], limits=limits)


class VideoLoader:
    """The server's video reader: `await load(sources, sampling)` -> the VideoInputs, in the sources' order. One
    per server; `decoded` counts the clips it decoded (the misses of its cache)."""

    def __init__(self, vision: Gemma4VisionSpec | None, options: MediaOptions) -> None:
        self.vision, self.options = vision, options
        self.limits = VideoLimits(options.max_video_bytes, options.max_video_seconds, options.video_decode_timeout_s)
        self.cache = SampledVideos(options.cache_bytes)
        self.decoded = 0
        self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="thorgen-video")

    async def _read(self, source: VideoSource) -> tuple[str, Raw]:
        if source.url[:5].lower() == "data:":
            start = data_url_payload(source.url, source.where, kind="video")
            if (len(source.url) - start) * 3 // 4 > self.options.max_video_bytes + 3:
                raise APIError(
                    f"{source.where}: the video is larger than {self.options.max_video_bytes} bytes "
                    "(thorgen serve --video-max-mb)",
                    param=where_param(source.where),
                )
            return "data:" + await self._run(sha256_of, source.url), (source.url, start)
        raw = await fetch(source.url, self.options, source.where, kind="video")
        return "bytes:" + await self._run(sha256_of, raw), raw

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _one(self, source: VideoSource, sampling: VideoSampling, vision: Gemma4VisionSpec) -> VideoInput:
        digest, raw = await self._read(source)
        key: Key = (digest, sampling.budget or DEFAULT_BUDGET, sampling.num_frames, sampling.fps)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        self.decoded += 1
        limit = self.limits.decode_seconds
        try:
            video = await asyncio.wait_for(self._run(_sample, raw, vision, key, self.limits), limit + 1.0)
        except asyncio.TimeoutError:
            raise APIError(
                f"{source.where}: decoding the video took longer than {limit:g} s", param=where_param(source.where)
            ) from None
        except (VideoError, ImageError) as exc:
            raise APIError(f"{source.where}: {exc}", param=where_param(source.where)) from None
        self.cache.put(key, video)
        return video

    async def load(self, sources: list[VideoSource], sampling: VideoSampling) -> list[VideoInput]:
        """Each source read and sampled in the request's order; the first failing one is the 400, naming its field."""
        if not sources:
            return []
        vision = check_count(self.vision, self.options, sources, "video")
        return [await self._one(source, sampling, vision) for source in sources]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
