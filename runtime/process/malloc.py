"""Runtime stage: how glibc malloc holds the host memory of the server's and the engine's long-running processes:
fewer arenas, and free pages handed back to the kernel every so many finished requests.

Measured with `thorgen bench soak` on the reference backend (the demo model, the engine in its own process): the
server's malloc bytes in use stay flat from one drained point to the next while its free bytes grow (mallinfo2:
in use 26.2 -> 26.3 -> 26.1 MiB, free 18.5 -> 21.5 -> 23.9 MiB over 847 and 680 requests), and RSS with them;
gc's object counts do not move. That is fragmentation, not live objects: each thread that allocates (AnyIO's
worker threads rendering and tokenizing prompts, the image loaders, the resize pool, the engine threads) gets an
arena of its own, up to 8 per core, and a large short-lived buffer (a request body, an image's bytes, a base64
string, a NumPy array) raises glibc's mmap and trim thresholds, after which such buffers come from the arenas and
their free pages stay resident. malloc_trim(0) at a drained point returned 6.1 of the server's 14.2 MiB free and
7.0 of the engine process's 7.6.

Everywhere but glibc (musl, macOS) these do nothing and say so by returning False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading

M_ARENA_MAX = -8  # mallopt's parameter number (glibc's malloc.h)
ARENAS = 2  # arenas per process: Python's small objects come from pymalloc under the GIL, so little contends
TRIM_EVERY = 256  # finished requests between two trims (a trim of a ~50 MiB heap takes about a millisecond)


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

    def __init__(self, every: int = TRIM_EVERY, trim_fn=trim) -> None:
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
