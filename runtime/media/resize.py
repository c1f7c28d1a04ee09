"""Runtime stage: Pillow's BICUBIC resize of an RGB image straight into patches, in bands on a small thread pool,
byte-identical to one `Image.resize` call.

Pillow resamples in two passes, each on 8-bit pixels: horizontal (every row to the new width, each output pixel
from one row) and vertical (every column to the new height, each output pixel from one column), horizontal first,
or from Pillow 13 vertical first when the height shrinks by much more than the width. The taps of a pass depend only
on the source length, the box and the output length along its axis. So a pass may run on bands across its axis: a
band of whole rows resized to (W', rows), or of whole columns resized to (cols, H'), keeps the whole image's taps
and makes Pillow run that pass alone; the second pass's bands then read the first one's assembled result. Every
pixel is the very sum, rounded the very same way, as in the one-call resize. A `box` cutting bands along the
resized axis would not do: its centres, from float32 box edges, may round differently from the whole image's.

Each worker crops what it reads (Pillow gives no views into an image): a copy of a band is cheap next to its
resampling, and a band at a time keeps the copies small enough for the allocator to reuse. The pool is this
module's alone and its jobs never wait on other jobs, so a caller on any other pool (the server's image loaders)
cannot deadlock it; the caller works through the bands too, rather than idling while the pool is busy.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
from PIL import Image

THREADS = min(8, os.cpu_count() or 1)
PARALLEL_PIXELS = 1 << 18  # source + output pixels from which bands pay for the pool's hand-offs (~0.1 ms)
# one band a thread: each band's crop, resize and paste take the GIL back between threads (~0.1 ms a hand-off on a
# 16-core host, in turn), which costs more than bands that finish at different times (720p at 280 tokens, 8 threads:
# 6.1 ms in 8 bands, 7.2 ms in 16)
BANDS_PER_THREAD = 1

Sink = Callable[[Image.Image, tuple[int, int]], None]  # a resized band and its top-left corner in the result

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            # the caller works through bands too, so THREADS - 1 workers make THREADS threads on one image
            _pool = ThreadPoolExecutor(max_workers=max(1, THREADS - 1), thread_name_prefix="thorgen-resize")
        return _pool


def run_all(jobs: list[Callable[[], None]], threads: int = THREADS) -> None:
    """Run every job, on up to `threads` threads, the caller's one of them; returns when all have finished and
    raises the first error (after the others have stopped)."""
    it, lock = iter(jobs), threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                job = next(it, None)
            if job is None:
                return
            job()

    helpers: list[Future[None]] = []
    if threads > 1 and len(jobs) > 1:
        pool = _executor()
        helpers = [pool.submit(drain) for _ in range(min(threads, len(jobs)) - 1)]
    try:
        drain()
    finally:
        # a helper still queued behind other callers' jobs has nothing left to do: dropping it, not waiting for a
        # thread to pick it up, keeps a busy pool from adding its queue to this image's time
        for f in helpers:
            if not f.cancel():
                f.result()


def spans(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, n) cut into at most `parts` nonempty spans of about equal length, each edge but n a multiple of `unit`."""
    units = -(-n // unit)
    parts = max(1, min(parts, units))
    edges = [min(n, units * i // parts * unit) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def worth_bands(size: tuple[int, int], target: tuple[int, int], threads: int = THREADS) -> bool:
    """Whether resizing an image of `size` (W, H) to `target` (W', H') in bands beats one call."""
    pixels = size[0] * size[1] + target[0] * target[1]
    return threads > 1 and pixels >= PARALLEL_PIXELS and pass_order() is not None


def _bands(src: Image.Image, size: tuple[int, int], rows: bool, unit: int, threads: int, sink: Sink) -> None:
    """One pass of `src` resized to `size` that changes one side only: in bands of whole rows (`rows`, the new width)
    or of whole columns (the new height), each edge but the last a multiple of `unit`, each band handed to `sink`
    with its top-left corner. Keeping the band's other side makes Pillow run this pass alone, with the taps of the
    whole image (the bands never cross a filter's edge clipping: that depends on the resized axis only)."""
    w, h = src.size
    cuts = spans(h if rows else w, threads * BANDS_PER_THREAD, unit)

    def band(a: int, b: int) -> None:
        part = src.crop((0, a, w, b) if rows else (a, 0, b, h))
        new = (size[0], b - a) if rows else (b - a, size[1])
        if new != part.size:
            part = part.resize(new, resample=Image.Resampling.BICUBIC)
        sink(part, (0, a) if rows else (a, 0))

    run_all([lambda a=a, b=b: band(a, b) for a, b in cuts], threads)


def vertical_first(size: tuple[int, int], target: tuple[int, int]) -> bool:
    """Whether this Pillow resizes (W, H) to (W', H') vertical pass first: from Pillow 13 it does when the height
    shrinks by more than twice what the width does (python-pillow/Pillow#9549); before, never."""
    (w, h), (tw, th) = size, target
    return pass_order() == "by shrink" and h - th > 2 * (w - tw) and th < h


@functools.cache
def pass_order() -> str | None:
    """How the installed Pillow orders its passes, told from one small resize that the two orders round apart:
    "by shrink" (Pillow 13 on), "horizontal first" (before), or None (neither: no bands, only one-call resizes)."""
    rng = np.random.default_rng(0)
    probe = Image.fromarray(rng.integers(0, 256, (200, 24, 3), dtype=np.uint8), "RGB")  # 24 x 200: by shrink, V
    bicubic = Image.Resampling.BICUBIC
    full = probe.resize((16, 48), resample=bicubic).tobytes()
    if full == probe.resize((24, 48), resample=bicubic).resize((16, 48), resample=bicubic).tobytes():
        return "by shrink"
    if full == probe.resize((16, 200), resample=bicubic).resize((16, 48), resample=bicubic).tobytes():
        return "horizontal first"
    return None


def resized_patches(image: Image.Image, th: int, tw: int, patch: int, threads: int = THREADS) -> np.ndarray:
    """An RGB image resized (BICUBIC) to th x tw, both multiples of `patch`, as [th/p * tw/p, p*p*3] uint8 patches
    in (py, px, c) order, row-major over the patch grid: the bytes of `image.resize((tw, th), BICUBIC)` cut into
    patches, each of its two passes run in bands on `threads` threads, in the order Pillow runs them."""
    if image.mode != "RGB" or th % patch or tw % patch:
        raise ValueError(f"an RGB image and sides that are multiples of {patch} are needed, not {image.mode} {tw}x{th}")
    image.load()  # a file not yet decoded would be decoded by the first band's crop, racing the others
    w, h = image.size
    gh, gw = th // patch, tw // patch
    patches = np.empty((gh * gw, patch * patch * 3), np.uint8)
    grid = patches.reshape(gh, gw, patch, patch, 3)

    def cut(part: Image.Image, at: tuple[int, int]) -> None:
        (bw, bh), (x, y) = part.size, at
        pixels = np.asarray(part).reshape(bh // patch, patch, bw // patch, patch, 3)
        grid[y // patch : (y + bh) // patch, x // patch : (x + bw) // patch] = pixels.transpose(0, 2, 1, 3, 4)

    rows_first = not vertical_first((w, h), (tw, th))
    if tw != w and th != h:  # both passes: the second one's bands read the first one's whole result
        mid = Image.new("RGB", (tw, h) if rows_first else (w, th))
        _bands(image, mid.size, rows_first, 1, threads, lambda part, at: mid.paste(part, at))  # disjoint areas
        image, rows = mid, not rows_first
    else:
        rows = tw != w  # the one side that changes (neither: the image as it is, cut into patches)
    _bands(image, (tw, th), rows, patch, threads, cut)
    return patches
