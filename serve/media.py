"""Serve stage: how the server takes images: its options, a request's budgets and image count checked, `data:` URLs
read (header, then base64), and http(s) images fetched only from the allowed domains (a timeout, a size cap, no
redirects). serve/image_loader.py runs these for a request's images, off the event loop."""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..model_spec.types import Gemma4VisionSpec
from ..runtime.media.images import DEFAULT_BUDGET, SOFT_TOKEN_BUDGETS, ImageError
from .protocol import APIError
from .request import ImageSource


@dataclass(frozen=True)
class MediaOptions:
    """How the server takes images (thorgen serve's --image-max-tokens, --limit-images-per-prompt,
    --allowed-media-domains)."""

    budget: int = DEFAULT_BUDGET  # soft tokens per image unless a request asks for another budget
    max_images: int = 16  # images one prompt may hold
    allowed_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name; empty: only data: URLs
    fetch_timeout_s: float = 5.0
    max_fetch_bytes: int = 20 << 20
    # worker threads that decode and preprocess images (Pillow and NumPy release the GIL for most of it)
    workers: int = field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    cache_bytes: int = 256 << 20  # preprocessed images kept for requests that send them again (their patches)


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


def image_budget(kwargs: dict[str, Any] | None) -> int | None:
    """vLLM's mm_processor_kwargs: {"max_soft_tokens": N} (the only key taken here) -> N, checked."""
    if not kwargs:
        return None
    unknown = sorted(set(kwargs) - {"max_soft_tokens"})
    if unknown:
        raise APIError(
            f"mm_processor_kwargs: only max_soft_tokens is supported (got {', '.join(unknown)})",
            param="mm_processor_kwargs",
        )
    return check_budget(kwargs.get("max_soft_tokens"), "mm_processor_kwargs.max_soft_tokens")


# base64 characters decoded per call (a multiple of 4; well under a millisecond): binascii holds the GIL while it
# runs, so a long payload is decoded in pieces, between which the event loop's thread can take the GIL
B64_PIECE = 1 << 18


def data_url_payload(url: str, where: str) -> int:
    """Where the base64 payload of a `data:image/...;base64,...` URL starts, its header checked (the payload is
    read later, by `b64_bytes` on a worker thread, and never copied whole)."""
    comma = url.find(",")
    media_type, *params = url[len("data:") : max(comma, 0)].split(";")
    if comma < 0 or "base64" not in params:
        raise APIError(f"{where}: a data URL must be data:<image type>;base64,<data>", param=where_param(where))
    if media_type and not media_type.lower().startswith("image/"):
        raise APIError(
            f"{where}: the data URL's media type {media_type!r} is not an image type", param=where_param(where)
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


async def fetch(url: str, options: MediaOptions, where: str) -> bytes:
    """An http(s) image from an allowed host: no redirects followed, at most max_fetch_bytes, within the timeout."""
    host = (urlsplit(url).hostname or "").lower()
    if not options.allowed_domains:
        raise APIError(
            f"{where}: this server does not fetch image URLs (thorgen serve --allowed-media-domains "
            "turns it on); send the image inline as a data: URL",
            param=where_param(where),
        )
    if host not in options.allowed_domains:
        raise APIError(f"{where}: the host {host!r} is not among the allowed media domains", param=where_param(where))
    limit = options.max_fetch_bytes
    try:
        async with httpx.AsyncClient(
            timeout=options.fetch_timeout_s, follow_redirects=False, trust_env=False
        ) as client:
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    raise APIError(
                        f"{where}: the image URL answered a redirect ({response.status_code}), which is not followed",
                        param=where_param(where),
                    )
                if response.status_code != 200:
                    raise APIError(
                        f"{where}: fetching the image URL answered HTTP {response.status_code}",
                        param=where_param(where),
                    )
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(
                            f"{where}: the image at the URL is larger than {limit} bytes", param=where_param(where)
                        )
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.TimeoutException:
        raise APIError(
            f"{where}: fetching the image URL took longer than {options.fetch_timeout_s:g} s", param=where_param(where)
        ) from None
    except httpx.HTTPError as exc:
        raise APIError(
            f"{where}: the image URL could not be fetched ({type(exc).__name__})", param=where_param(where)
        ) from None


def check_count(vision: Gemma4VisionSpec | None, options: MediaOptions, sources: list[ImageSource]) -> Gemma4VisionSpec:
    """The vision tower, or a 400 unless the model has one and the prompt holds no more images than allowed."""
    if vision is None:
        raise APIError(
            "this model has no vision tower: image inputs are not supported", param=where_param(sources[0].where)
        )
    if len(sources) > options.max_images:
        raise APIError(
            f"the prompt holds {len(sources)} images; at most {options.max_images} are accepted "
            "(thorgen serve --limit-images-per-prompt)",
            param=where_param(sources[0].where),
        )
    return vision
