"""Serve stage: a request's images from their URLs to ImageInputs: `data:` URLs decoded, http(s) URLs fetched only
from the allowed domains (a timeout, a size cap, no redirects), then decoded and preprocessed on a worker thread."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx

from ..model_spec.types import Gemma4VisionSpec
from ..runtime.backend import ImageInput
from ..runtime.media.images import DEFAULT_BUDGET, SOFT_TOKEN_BUDGETS, ImageError, load_image
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


def _param(where: str) -> str:
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


def data_url_bytes(url: str, where: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL."""
    header, comma, payload = url.partition(",")
    media_type, *params = header[len("data:") :].split(";")
    if not comma or "base64" not in params:
        raise APIError(f"{where}: a data URL must be data:<image type>;base64,<data>", param=_param(where))
    if media_type and not media_type.lower().startswith("image/"):
        raise APIError(f"{where}: the data URL's media type {media_type!r} is not an image type", param=_param(where))
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(f"{where}: the data URL's payload is not valid base64", param=_param(where)) from None


async def fetch(url: str, options: MediaOptions, where: str) -> bytes:
    """An http(s) image from an allowed host: no redirects followed, at most max_fetch_bytes, within the timeout."""
    host = (urlsplit(url).hostname or "").lower()
    if not options.allowed_domains:
        raise APIError(
            f"{where}: this server does not fetch image URLs (thorgen serve --allowed-media-domains "
            "turns it on); send the image inline as a data: URL",
            param=_param(where),
        )
    if host not in options.allowed_domains:
        raise APIError(f"{where}: the host {host!r} is not among the allowed media domains", param=_param(where))
    limit = options.max_fetch_bytes
    try:
        async with httpx.AsyncClient(
            timeout=options.fetch_timeout_s, follow_redirects=False, trust_env=False
        ) as client:
            async with client.stream("GET", url) as response:
                if response.is_redirect:
                    raise APIError(
                        f"{where}: the image URL answered a redirect ({response.status_code}), which is not followed",
                        param=_param(where),
                    )
                if response.status_code != 200:
                    raise APIError(
                        f"{where}: fetching the image URL answered HTTP {response.status_code}", param=_param(where)
                    )
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > limit:
                        raise APIError(
                            f"{where}: the image at the URL is larger than {limit} bytes", param=_param(where)
                        )
                    chunks.append(chunk)
                return b"".join(chunks)
    except httpx.TimeoutException:
        raise APIError(
            f"{where}: fetching the image URL took longer than {options.fetch_timeout_s:g} s", param=_param(where)
        ) from None
    except httpx.HTTPError as exc:
        raise APIError(
            f"{where}: the image URL could not be fetched ({type(exc).__name__})", param=_param(where)
        ) from None


def check_count(vision: Gemma4VisionSpec | None, options: MediaOptions, sources: list[ImageSource]) -> Gemma4VisionSpec:
    """The vision tower, or a 400 unless the model has one and the prompt holds no more images than allowed."""
    if vision is None:
        raise APIError("this model has no vision tower: image inputs are not supported", param=_param(sources[0].where))
    if len(sources) > options.max_images:
        raise APIError(
            f"the prompt holds {len(sources)} images; at most {options.max_images} are accepted "
            "(thorgen serve --limit-images-per-prompt)",
            param=_param(sources[0].where),
        )
    return vision


async def load_images(
    vision: Gemma4VisionSpec | None, options: MediaOptions, sources: list[ImageSource], budget: int | None
) -> list[ImageInput]:
    """Each source read (data URL or fetch) and preprocessed once for the `vision` tower; the decoding runs on a
    worker thread."""
    tower, default = check_count(vision, options, sources), budget or options.budget
    raw: dict[str, bytes] = {}
    for source in sources:
        if source.url not in raw:
            raw[source.url] = (
                data_url_bytes(source.url, source.where)
                if source.url[:5].lower() == "data:"
                else await fetch(source.url, options, source.where)
            )

    def decode_all() -> list[ImageInput]:
        done: dict[tuple[str, int], ImageInput] = {}
        for source in sources:
            key = (source.url, source.budget or default)
            if key not in done:
                try:
                    done[key] = load_image(raw[source.url], tower, key[1])
                except ImageError as exc:
                    raise APIError(f"{source.where}: {exc}", param=_param(source.where)) from None
        return [done[(s.url, s.budget or default)] for s in sources]

    return await anyio.to_thread.run_sync(decode_all)
