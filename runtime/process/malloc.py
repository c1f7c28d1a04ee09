"""Runtime stage: how glibc malloc holds the host memory of the server's and the engine's long-running processes:
fewer arenas, and free pages handed back to the kernel every so many finished requests.

Measured with `thorgen bench soak` on the reference backend (the demo model, the engine in its own process, 8
clients), the server's memory sampled with nothing running after each stretch of ~270 requests: malloc's bytes in
use held at 25.3 MiB and gc's object counts did not move, while its free bytes grew 9.7 -> 14.4 -> 18.1 MiB and RSS
with them (128.3 -> 133.3 -> 137.0 MiB, ~16 KB a request). That is fragmentation, not live objects: each thread that
allocates (AnyIO's workers rendering and tokenizing prompts, the image loaders, the resize pool, the engine threads)
gets an arena of its own, up to 8 per core, whose free pages stay resident; and once a large short-lived buffer (a
request body, an image's bytes, a base64 string, a NumPy array) is freed, glibc raises its mmap and trim thresholds,
so that later ones come from the arenas too. With two arenas and a trim every 256 requests, side by side on the
same machine: 124.5 -> 125.8 -> 126.0 MiB (free bytes 5.5 -> 6.6 -> 6.6 MiB). The engine process's RSS held flat
either way there.

Everywhere but glibc (musl, macOS) these do nothing and say so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from typing import Callable

M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)
ARENAS = 2  # arenas per process: Python's small objects come from pymalloc under the GIL, so little contends
TRIM_EVERY = 256  # finished requests between two trims (one took 6 ms over a fragmented 200 MiB heap, on its caller)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has gnu_get_libc_version, mallopt and malloc_trim), else None."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not all(hasattr(libc, f) for f in ("gnu_get_libc_version", "mallopt", "malloc_trim")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


def limit_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas in this process from now on (threads that already have one keep it, so call
    this before the process starts its threads); False where it cannot be set."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, arenas) == 1)


def trim() -> bool:
    """Hand the free pages of every arena back to the kernel (malloc_trim(0)); False where there is nothing to
    call or nothing was released."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class Trimmer:
    """Calls `trim_fn` once every `every` finished requests. Thread-safe: `finished` may be called from any
    thread, and the trim runs on the caller's thread (outside the lock)."""

    def __init__(self, every: int = TRIM_EVERY, trim_fn: Callable[[], object] = trim) -> None:
        if every < 1:
            raise ValueError(f"trim every {every} requests: 1 or more")
        self.every, self._trim = every, trim_fn
        self._lock = threading.Lock()
        self._count = 0
        self.trims = 0

    def finished(self, requests: int = 1) -> None:
        """Count `requests` more finished requests; trims when that makes `every` since the last trim."""
        with self._lock:
            self._count += requests
            due = self._count >= self.every
            if due:
                self._count = 0
                self.trims += 1
        if due:
            self._trim()
