"""Serve stage: the one answer skeleton of every API: a request's generations started, then their neutral events
driven into a whole JSON answer or an SSE stream; an `Adapter` supplies only its API's shapes.

The skeleton owns what every API does alike: the first engine output awaited before answering (an engine-side
rejection is still a 4xx), a client that goes away (499, the engine stopped), an error after the stream began (the
API's error event ends it), each request counted once in /metrics, and every job aborted at the end.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..runtime.client import RequestOutput
from .context import ServerContext
from .events import Error, Event
from .generation import ClientGone, Generation, events, submit
from .protocol import APIError

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (OpenAI), with an `event:` line first when named (Anthropic)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


class Adapter(ABC):
    """One API's shapes over the skeleton. `add` takes every event but `Error`, in order (streamed: it returns
    their SSE; whole: it only keeps what `body` needs); the other hooks return the SSE of the stream's start, its
    normal end (every choice finished), and its end after an error."""

    def __init__(self, gens: list[Generation], streaming: bool) -> None:
        self.gens, self.streaming = gens, streaming

    @abstractmethod
    def opening(self) -> list[bytes]: ...

    @abstractmethod
    def add(self, choice: int, event: Event) -> list[bytes]: ...

    @abstractmethod
    def closing(self) -> list[bytes]: ...

    @abstractmethod
    def failure(self, error: APIError) -> list[bytes]: ...

    @abstractmethod
    def body(self) -> dict[str, Any]: ...


def client_gone() -> JSONResponse:
    return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)


async def start(ctx: ServerContext, request: Request, gens: list[Generation]) -> list[RequestOutput] | None:
    """Submit every generation and wait for each one's first output (so that an engine-side rejection can still
    become a 4xx); None when the client left meanwhile (recorded as 499)."""
    firsts = []
    try:
        for g in gens:
            submit(ctx.client, g.job)
        for g in gens:
            firsts.append(await g.first_output(request))
    except ClientGone:
        for g in gens:
            g.job.abort()
            g.record(499)
        return None
    except BaseException:
        for g in gens:
            g.job.abort()
        raise
    return firsts


async def answer(ctx: ServerContext, request: Request, adapter: Adapter) -> Response:
    """Run the adapter's generations (n choices, each its own engine sequence) and answer, streamed or whole."""
    gens = adapter.gens
    firsts = await start(ctx, request, gens)
    if firsts is None:
        return client_gone()
    if adapter.streaming:
        return StreamingResponse(
            _stream(adapter, request, firsts), media_type="text/event-stream", headers=STREAM_HEADERS
        )
    try:
        async for choice, event in events(gens, request, firsts):
            if isinstance(event, Error):
                raise event.error  # the route's handler answers it in the API's error shape
            adapter.add(choice, event)
    except ClientGone:
        for g in gens:
            g.record(499)
        return client_gone()
    finally:
        for g in gens:
            g.job.abort()
    for g in gens:
        g.record(200)
    return JSONResponse(adapter.body())


async def _stream(adapter: Adapter, request: Request, firsts: list[RequestOutput]) -> AsyncIterator[bytes]:
    gens = adapter.gens
    try:
        for chunk in adapter.opening():
            yield chunk
        failed: APIError | None = None
        async for choice, event in events(gens, request, firsts):
            if isinstance(event, Error):
                failed = event.error
                break
            for chunk in adapter.add(choice, event):
                yield chunk
        tail = adapter.closing() if failed is None else adapter.failure(failed)
        for g in gens:  # counted before the last events go out, so a client that has them sees them counted
            g.record(200 if failed is None else failed.status)
        for chunk in tail:
            yield chunk
    except ClientGone:
        pass
    finally:
        # Also reached when the server cancels this generator (the client disconnected while a chunk was being
        # sent, or shutdown): the request then still counts as aborted.
        for g in gens:
            g.record(499)
            g.job.abort()  # no-op after a normal end; stops the engine when the client went away
