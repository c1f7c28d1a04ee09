"""Serve stage: a request's images from their sources to ImageInputs, off the event loop and in parallel.

Each distinct image of a request is read (a data URL's header checked, an http(s) URL fetched) and keyed by a
sha256 of its raw form (the data URL's text, or the fetched bytes); the base64 decode, the Pillow decode and the
preprocessing then run on a bounded pool of worker threads, one job per image, so that the images of one request,
and those of concurrent requests, are decoded side by side while the event loop keeps serving other streams.
Preprocessed images are kept (an LRU bounded by their patches' bytes) by that key and the budget: an image sent
again is neither decoded nor preprocessed, and the ImageInput it gets back carries the content hash the engine's
encoder cache already holds, so it is not encoded either. Two requests that send one new image at the same time
share one decode. A chat's data-URL images are submitted (`prefetch`) before its prompt is rendered and tokenized,
so that their decode runs beside that work.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Generic, TypeVar

from ..model_spec.types import Gemma4VisionSpec
from ..runtime.backend import ImageInput
from ..runtime.media.images import ImageError, load_image
from .media import MediaOptions, b64_bytes, check_count, data_url_payload, fetch, where_param
from .protocol import APIError
from .request import ImageSource

T = TypeVar("T")
Key = tuple[str, int]  # (sha256 of the raw image, budget)
Raw = bytes | tuple[str, int]  # an image's bytes, or a data URL and where its base64 starts
INLINE_HASH_CHARS = 1 << 20  # the longest data URL `prefetch` hashes on the event loop's thread (~0.6 ms)


K = TypeVar("K")
V = TypeVar("V")


class BytesBoundedLRU(Generic[K, V]):
    """Values by key, least recently used dropped first once their `size()` bytes pass `max_bytes` (a value larger
    than that is not kept). Used from the event loop's thread only, so it needs no lock."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self._values: OrderedDict[K, V] = OrderedDict()

    @staticmethod
    def size(value: Any) -> int:
        raise NotImplementedError

    def get(self, key: K) -> V | None:
        value = self._values.get(key)
        if value is not None:
            self._values.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        if self.size(value) > self.max_bytes or key in self._values:
            return
        self._values[key] = value
        self.bytes += self.size(value)
        while self.bytes > self.max_bytes:
            _, dropped = self._values.popitem(last=False)
            self.bytes -= self.size(dropped)

    def __len__(self) -> int:
        return len(self._values)


class PreprocessedImages(BytesBoundedLRU[Key, ImageInput]):
    """Recently preprocessed images by (raw key, budget), bounded by their patches' and positions' bytes."""

    @staticmethod
    def size(value: Any) -> int:
        return int(value.patches.nbytes + value.positions.nbytes)


def sha256_of(data: bytes | str) -> str:
    """hashlib lets the GIL go while it hashes a long buffer."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return hashlib.sha256(raw).hexdigest()


def data_key(digest: str) -> str:
    """The cache key of a data URL whose text has sha256 `digest` (`load` and `prefetch` must agree on it)."""
    return "data:" + digest


def _preprocess(raw: Raw, vision: Gemma4VisionSpec, budget: int) -> ImageInput:
    """A worker thread's job: raw bytes (or a data URL's base64) -> the preprocessed image."""
    return load_image(b64_bytes(*raw) if isinstance(raw, tuple) else raw, vision, budget)


class ImageLoader:
    """The server's image reader: `await load(sources, budget)` -> the ImageInputs, in the sources' order. One per
    server; `decoded` counts the images it decoded and preprocessed (the misses of its cache)."""

    def __init__(self, vision: Gemma4VisionSpec | None, options: MediaOptions) -> None:
        self.vision, self.options = vision, options
        self.cache = PreprocessedImages(options.cache_bytes)
        self.decoded = 0
        self._pool = ThreadPoolExecutor(max_workers=options.workers, thread_name_prefix="thorgen-image")
        self._pending: dict[Key, asyncio.Future[ImageInput]] = {}  # decodes under way, shared by their askers

    async def _run(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def _read(self, source: ImageSource) -> tuple[str, Raw]:
        """(key, raw): a data URL stays text until a worker decodes it, and is keyed by its text, so that a
        repeated data URL is never base64-decoded again."""
        if source.url[:5].lower() == "data:":
            start = data_url_payload(source.url, source.where)
            return data_key(await self._run(sha256_of, source.url)), (source.url, start)
        raw = await fetch(source.url, self.options, source.where)
        return "bytes:" + await self._run(sha256_of, raw), raw

    def _settle(self, key: Key, job: asyncio.Future[ImageInput]) -> None:
        self._pending.pop(key, None)
        if not job.cancelled() and job.exception() is None:
            self.cache.put(key, job.result())

    async def _preprocessed(self, key: Key, raw: Raw, vision: Gemma4VisionSpec) -> ImageInput:
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        job = self._pending.get(key) or self._start(key, raw, vision)
        return await asyncio.shield(job)  # a request that gives up does not cancel a decode others wait for

    def _start(self, key: Key, raw: Raw, vision: Gemma4VisionSpec) -> asyncio.Future[ImageInput]:
        """The image's decode and preprocessing, submitted to the pool at once (no turn of the event loop first)."""
        self.decoded += 1
        job = asyncio.wrap_future(self._pool.submit(_preprocess, raw, vision, key[1]))
        self._pending[key] = job
        job.add_done_callback(lambda done: self._settle(key, done))
        return job

    def prefetch(self, sources: list[ImageSource], budget: int | None) -> None:
        """Start the decodes of a request's data-URL images now, before `load` is awaited for them (while the prompt
        is rendered and tokenized). A data URL of up to INLINE_HASH_CHARS is hashed here and submitted to the pool
        with no turn of the event loop in between, which, with another thread holding the GIL, could wait
        milliseconds; a longer one (a photo's PNG is 1-3 MB of base64) is hashed on a worker, and its decode
        submitted when that is done. `load` hashes it again on a worker, beside the decode, and finds the decode
        under way. Best effort: any source that is not such a data URL, or is refused, is left to `load`, which
        reads it and reports its errors in order."""
        if self.vision is None or len(sources) > self.options.max_images:
            return
        for source in sources:
            if source.url[:5].lower() != "data:":
                continue
            try:
                start = data_url_payload(source.url, source.where)
            except APIError:
                continue
            image_budget = source.budget or budget or self.options.budget
            if len(source.url) > INLINE_HASH_CHARS:  # hashed on a worker: the decode starts once it is keyed
                hashed = asyncio.wrap_future(self._pool.submit(sha256_of, source.url))
                hashed.add_done_callback(functools.partial(self._hashed, raw=(source.url, start), budget=image_budget))
                continue
            self._start_missing((data_key(sha256_of(source.url)), image_budget), (source.url, start), self.vision)

    def _hashed(self, done: asyncio.Future[str], raw: Raw, budget: int) -> None:
        """A long data URL's prefetch, once its worker has hashed it (on the event loop's thread): its decode."""
        if self.vision is not None and not done.cancelled() and done.exception() is None:
            self._start_missing((data_key(done.result()), budget), raw, self.vision)

    def _start_missing(self, key: Key, raw: Raw, vision: Gemma4VisionSpec) -> None:
        if self.cache.get(key) is None and key not in self._pending:
            self._start(key, raw, vision)

    async def load(self, sources: list[ImageSource], budget: int | None) -> list[ImageInput]:
        """Each source read once and preprocessed once per budget it is asked at; the first failing source (in
        the request's order) is the 400, naming its field."""
        if not sources:
            return []
        vision, default = check_count(self.vision, self.options, sources, "image"), budget or self.options.budget
        reads: dict[str, asyncio.Future[tuple[str, Raw]]] = {}
        images: dict[tuple[str, int], asyncio.Future[ImageInput]] = {}

        async def one(source: ImageSource, image_budget: int) -> ImageInput:
            key, raw = await reads[source.url]
            try:
                return await self._preprocessed((key, image_budget), raw, vision)
            except ImageError as exc:
                raise APIError(f"{source.where}: {exc}", param=where_param(source.where)) from None

        jobs: list[asyncio.Future[Any]] = []  # in the request's order, each source's read before its preprocessing
        for source in sources:
            if source.url not in reads:
                reads[source.url] = asyncio.ensure_future(self._read(source))
                jobs.append(reads[source.url])
            wanted = (source.url, source.budget or default)
            if wanted not in images:
                images[wanted] = asyncio.ensure_future(one(source, wanted[1]))
                jobs.append(images[wanted])
        try:
            await asyncio.wait(jobs)
        finally:
            for job in jobs:  # the request was cancelled (its client left): its own reads stop too
                job.cancel()
        # in the request's order: the first source that failed is the one reported (every failure is read, so
        # asyncio does not log the others as never retrieved)
        failed = [error for error in (job.exception() for job in jobs) if error is not None]
        if failed:
            raise failed[0]
        return [images[(s.url, s.budget or default)].result() for s in sources]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
