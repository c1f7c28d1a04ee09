"""Serve stage: the server process's share of runtime/process/malloc.py: free malloc pages handed back to the kernel
every so many answered HTTP requests, whatever answered them (a stream, a 4xx, a 413 for an oversized body)."""

from __future__ import annotations

from ..runtime.process.malloc import Trimmer


class TrimMiddleware:
    """Plain ASGI: counts each HTTP request once its answer is over (a stream's last event sent, or the client
    gone) and trims through `trimmer` every `trimmer.every` of them, on the event loop (milliseconds at most, once
    every few hundred answers; the engine thread runs on meanwhile, ctypes letting go of the GIL)."""

    def __init__(self, app, trimmer: Trimmer) -> None:
        self.app, self.trimmer = app, trimmer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.trimmer.finished()
