"""Serve stage: how the server takes images and videos: its options, a request's budgets, sampling and counts
checked, `data:` URLs read (header, then base64), and http(s) media fetched only from the allowed domains (a
timeout, a size cap, no redirects). serve/image_loader.py and serve/video_loader.py run these off the event loop."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Any, Sequence
from urllib.parse import urlsplit

import httpx

from ..model_spec.types import Gemma4VisionSpec
from ..runtime.media.images import DEFAULT_BUDGET, SOFT_TOKEN_BUDGETS, ImageError
from .protocol import APIError
from .request import ImageSource, VideoSampling, VideoSource


@dataclass(frozen=True)
class MediaOptions:
    """How the server takes images and videos (thorgen serve's --image-max-tokens, --limit-images-per-prompt,
    --allowed-media-domains, --limit-videos-per-prompt, --video-max-seconds, --video-max-mb)."""

    budget: int = DEFAULT_BUDGET  # soft tokens per image unless a request asks for another budget
    max_images: int = 16  # images one prompt may hold
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name; empty: only data: URLs
    fetch_timeout_s: float = 5.0
    max_fetch_bytes: int = 20 << 20
    # worker threads that decode and preprocess images (Pillow and NumPy release the GIL for most of it)
    workers: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    cache_bytes: int = 256 << 20  # preprocessed images kept for requests that send them again (their patches)
    max_videos: int = 1  # videos one prompt may hold
    max_video_seconds: float = 600.0  # a longer video is refused before its frames are decoded
    max_video_bytes: int = 32 << 20  # a video file's size (a data URL's decoded payload or a fetched file)
    video_decode_timeout_s: float = 30.0  # wall time one video's decode and sampling may take


def where_param(where: str) -> str:
    """The request field an error about `where` (e.g. "messages[0].content[1]") names: "messages"."""
    return where.split("[", 1)[0].split(".", 1)[0]


def check_budget(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value not in SOFT_TOKEN_BUDGETS:
        raise APIError(
            f"{param} must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))} (soft tokens per image); got {value!r}",
            param=param.split(".", 1)[0],
        )
    return value


MM_KWARGS = ("max_soft_tokens", "num_frames", "fps")


def media_kwargs(kwargs: dict[str, Any] | None) -> tuple[int | None, VideoSampling]:
    """vLLM's mm_processor_kwargs -> (the soft-token budget of images and frames, the videos' sampling), checked:
    max_soft_tokens (70..1120), num_frames (a positive integer) or fps (a positive number)."""
    if not kwargs:
        return None, VideoSampling()
    unknown = sorted(set(kwargs) - set(MM_KWARGS))
    if unknown:
        raise APIError(
            f"mm_processor_kwargs: only {', '.join(MM_KWARGS)} are supported (got {', '.join(unknown)})",
            param="mm_processor_kwargs",
        )
    budget = kwargs.get("max_soft_tokens")
    if budget is not None:
        budget = check_budget(budget, "mm_processor_kwargs.max_soft_tokens")
    frames, fps = kwargs.get("num_frames"), kwargs.get("fps")
    if frames is not None and (isinstance(frames, bool) or not isinstance(frames, int) or frames < 1):
        raise APIError(
            f"mm_processor_kwargs.num_frames must be a positive integer; got {frames!r}", param="mm_processor_kwargs"
        )
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps <= 1000):
        raise APIError(
            f"mm_processor_kwargs.fps must be a number in (0, 1000]; got {fps!r}", param="mm_processor_kwargs"
        )
    if frames is not None and fps is not None:
        raise APIError("mm_processor_kwargs: give num_frames or fps, not both", param="mm_processor_kwargs")
    return budget, VideoSampling(frames, None if fps is None else float(fps), budget)


# base64 characters decoded per call (a multiple of 4; well under a millisecond): binascii holds the GIL while it
# runs, so a long payload is decoded in pieces, between which the event loop's thread can take the GIL
B64_PIECE = 1 << 18


def data_url_payload(url: str, where: str, kind: str = "image") -> int:
    """Where the base64 payload of a `data:<kind>/...;base64,...` URL (kind: image or video) starts, its header
    checked (the payload is read later, by `b64_bytes` on a worker thread, and never copied whole)."""
    comma = url.find(",")
    media_type, *params = url[len("data:") : max(comma, 0)].split(";")
    if comma < 0 or "base64" not in params:
        raise APIError(f"{where}: a data URL must be data:<{kind} type>;base64,<data>", param=where_param(where))
    if media_type and not media_type.lower().startswith(f"{kind}/"):
        raise APIError(
            f"{where}: the data URL's media type {media_type!r} is not {'an image' if kind == 'image' else 'a video'} "
            "type",
            param=where_param(where),
        )
    return comma + 1


def b64_bytes(text: str, start: int = 0) -> bytes:
    """The bytes of the base64 in `text[start:]` (whitespace ignored); ImageError if it is not valid base64."""
    if not text.isascii() or any(c in text for c in " \t\n\r\x0b\x0c"):
        text, start = "".join(text[start:].split()), 0  # the copy only where there is whitespace to drop
    pieces, end = [], len(text)
    try:
        for at in range(start, end, B64_PIECE):
            piece = text[at : at + B64_PIECE]
            if at + B64_PIECE < end and "=" in piece:  # padding only at the very end, as in one call
                raise ValueError("padding inside the data")
            pieces.append(base64.b64decode(piece, validate=True))
    except (binascii.Error, ValueError):
        raise ImageError("the data URL's payload is not valid base64") from None
    return b"".join(pieces)


async def fetch(url: str, options: MediaOptions, where: str, kind: str = "image") -> bytes:
    """An http(s) image (or video) from an allowed host: no redirects followed, at most max_fetch_bytes (a video:
    max_video_bytes), within the timeout."""
    host = (urlsplit(url).hostname or "").lower()
    if not options.allowed_domains:
        raise APIError(
            f"{where}: this server does not fetch {kind} URLs (thorgen serve --allowed-media-domains "
            f"turns it on); send the {kind} inline as a data: URL",
            param=where_param(where),
        )
    if host not in options.allowed_domains:
        raise APIError(f"{where}: the host {host!r} is not among the allowed media domains", param=where_param(where))
    limit = options.max_fetch_bytes if kind == "image" else options.max_video_bytes
    try:
        async with httpx.AsyncClient(
            timeout=options.fetch_timeout_s, follow_redirects=False, trust_env=False
        ) as client:
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    raise APIError(
                        f"{where}: the {kind} URL answered a redirect ({response.status_code}), which is not followed",
                        param=where_param(where),
                    )
                if response.status_code != 200:
                    raise APIError(
                        f"{where}: fetching the {kind} URL answered HTTP {response.status_code}",
                        param=where_param(where),
                    )
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(
                            f"{where}: the {kind} at the URL is larger than {limit} bytes", param=where_param(where)
                        )
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.TimeoutException:
        raise APIError(
            f"{where}: fetching the {kind} URL took longer than {options.fetch_timeout_s:g} s", param=where_param(where)
        ) from None
    except httpx.HTTPError as exc:
        raise APIError(
            f"{where}: the {kind} URL could not be fetched ({type(exc).__name__})", param=where_param(where)
        ) from None


def check_count(
    vision: Gemma4VisionSpec | None, options: MediaOptions, sources: Sequence[ImageSource | VideoSource], kind: str
) -> Gemma4VisionSpec:
    """The vision tower, or a 400 unless the model has one and the prompt holds no more `kind`s ("image" or
    "video") than allowed."""
    if vision is None:
        raise APIError(
            f"this model has no vision tower: {kind} inputs are not supported", param=where_param(sources[0].where)
        )
    most = options.max_images if kind == "image" else options.max_videos
    if len(sources) > most:
        raise APIError(
            f"the prompt holds {len(sources)} {kind}s; at most {most} are accepted "
            f"(thorgen serve --limit-{kind}s-per-prompt)",
            param=where_param(sources[0].where),
        )
    return vision
