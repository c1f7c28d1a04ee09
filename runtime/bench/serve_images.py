"""Serve stage: the image side of `thorgen bench serve`: chat requests that carry --image as a data URL, and the
client that sends such requests beside a level's text streams (--image-arrivals).

Unless --same-image, every request sends its own variant of the image: the same size and format, with a band of
blocks along its top edge holding the request's number as grey levels, so that neither the server's image caches
nor its prefix cache can answer for it and each TTFT includes the decode, the preprocessing and the encode. The
variants are made before a level's clock starts, on a few threads. With --same-image every request sends the file's
own bytes: after the first, the TTFT is that of the cache-hit path.
"""

from __future__ import annotations

import asyncio
import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Awaitable, Callable

import numpy as np

Send = Callable[[Any, dict], Awaitable[dict]]  # (http client, body) -> the request's timings (serve_load._one)


def variant(rgb: np.ndarray, number: int, fmt: str) -> bytes:
    """The RGB pixels `rgb` (uint8 [H, W, 3], left as they are) with their top band of blocks set to `number` + 1
    in base 256, saved as `fmt`."""
    pixels = rgb.copy()
    height, width = pixels.shape[:2]
    block = max(1, min(height, width) // 16)
    digits, n = [], number + 1
    while n:
        digits.append(n % 256)
        n //= 256
    if len(digits) * block > width:
        raise ValueError(f"the image ({width}x{height}) is too small to number {number + 1} variants")
    for k, digit in enumerate(digits):  # every request differs from the next in the first block at least
        pixels[:block, k * block : (k + 1) * block] = digit
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return out.getvalue()


class ImageRequests:
    """--image and its settings: the file, the budget requests ask for (None: the server's), whether every request
    sends the same bytes, and the chat `text` that follows the image; ValueError for a file that is no image."""

    def __init__(self, path: Path, budget: int | None, same: bool, text: str = "") -> None:
        from PIL import Image, UnidentifiedImageError

        self.path, self.budget, self.same, self.text = path, budget, same, text
        self._data = path.read_bytes()
        self._made = 0  # variants made so far: each request's number
        self._urls: list[str] = []  # prepared, not yet sent
        try:
            with Image.open(io.BytesIO(self._data)) as image:
                self.width, self.height, self.format = image.width, image.height, image.format or "PNG"
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"--image {path}: not an image file ({exc})") from None

    @property
    def prepared(self) -> int:
        return len(self._urls)

    def _url(self, data: bytes) -> str:
        return f"data:image/{self.format.lower()};base64," + base64.b64encode(data).decode()

    def prepare(self, n: int) -> None:
        """Make the next `n` requests' data URLs (before a level's clock starts)."""
        if self.same:
            self._urls = [self._url(self._data)] * n
            return
        from PIL import Image

        numbers = range(self._made, self._made + n)
        self._made += n
        with Image.open(io.BytesIO(self._data)) as image:
            rgb = np.asarray(image.convert("RGB"))
        with ThreadPoolExecutor(4) as pool:  # (Pillow's encoders let the GIL go)
            self._urls = [self._url(v) for v in pool.map(lambda i: variant(rgb, i, self.format), numbers)]

    def body(self, fields: dict) -> dict:
        """The next prepared request: a chat of the image, then the text, with the load's shared `fields`."""
        content = [{"type": "image_url", "image_url": {"url": self._urls.pop()}}, {"type": "text", "text": self.text}]
        body = {"messages": [{"role": "user", "content": content}], **fields}
        if self.budget is not None:
            body["mm_processor_kwargs"] = {"max_soft_tokens": self.budget}
        return body

    def describe(self) -> dict:
        return {
            "file": self.path.name,
            "width": self.width,
            "height": self.height,
            "budget": self.budget,
            "same_image": self.same,
            "text": self.text[:80] + ("..." if len(self.text) > 80 else ""),
        }


async def send_beside(images: ImageRequests, fields: dict, send: Send, http: Any, stop: asyncio.Event) -> list[dict]:
    """--image-arrivals: image chats of one token each, sent back to back until `stop` is set (the level's text
    streams are done); their timings. Each takes a prepared variant (more are made, off the loop, when they run
    out: that time is spent between two arrivals, not inside one)."""
    done: list[dict] = []
    while not stop.is_set():
        if not images.prepared:
            await asyncio.to_thread(images.prepare, 4)
        done.append(await send(http, images.body(fields | {"max_tokens": 1})))
    return done


def arrival_stats(results: list[dict], percentile: Callable[[list[float], float], float | None]) -> dict:
    """The image arrivals of a level: how many, and their TTFT p50 / p99 (ms)."""
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    return {
        "image_requests": len(results),
        "image_ttft_ms_p50": ms(percentile(ttft, 50)),
        "image_ttft_ms_p99": ms(percentile(ttft, 99)),
    }
