"""Serve stage: request guards: the body-size limit, the last-resort 500 handler, and prompt building off the event
loop behind a cheap length bound."""

from __future__ import annotations

import logging
import re
from typing import Callable

import anyio
from fastapi.responses import JSONResponse

from ..runtime.text.tokenizer import Tokenizer
from .context import ServerContext
from .protocol import APIError, error_body_for

log = logging.getLogger("thorgen.serve")
DRAIN_FACTOR = 4  # a too-large body up to this many limits is read and dropped so the client sees the 413
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _reply(scope, status: int, message: str, code: str | None, close: bool = False) -> JSONResponse:
    return JSONResponse(
        error_body_for(scope["path"], status, message, code=code),
        status_code=status,
        headers={"Connection": "close"} if close else None,
    )


class BodyLimitMiddleware:
    """Plain ASGI (BaseHTTPMiddleware would hide client disconnects from streaming responses): refuses bodies
    over `limit` bytes with a 413, by Content-Length and by counting what actually arrives (chunked uploads).

    The body is read here and replayed to the app; afterwards `receive` is the server's own again, so handlers
    still see `http.disconnect`. An oversized body is drained (up to DRAIN_FACTOR x limit) before answering: a
    client like httpx sends its whole body before reading, and a server that closes on it mid-upload makes it
    see a connection reset instead of the 413."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await _reply(scope, 400, "the Content-Length header is not a number", None, close=True)(
                    scope, receive, send
                )
                return
            if int(declared) > self.limit * DRAIN_FACTOR:
                await self._too_large(scope, receive, send, close=True)
                return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before its body was complete: nobody to answer
            body = message.get("body", b"")
            size += len(body)
            more = message.get("more_body", False)
            if size > self.limit:
                size = await self._drain(receive, size, more)
                await self._too_large(scope, receive, send, close=size > self.limit * DRAIN_FACTOR)
                return
            chunks.append(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _drain(self, receive, size: int, more: bool) -> int:
        while more and size <= self.limit * DRAIN_FACTOR:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
        return size

    async def _too_large(self, scope, receive, send, close: bool) -> None:
        mb = self.limit / (1 << 20)
        await _reply(
            scope,
            413,
            f"the request body is larger than the server's limit of {mb:g} MB (thorgen serve --max-body-mb)",
            "request_too_large",
            close,
        )(scope, receive, send)


class BugMiddleware:
    """Turns an unexpected exception into an OpenAI-style 500 and logs it. Unlike an `Exception` handler (which
    Starlette's ServerErrorMiddleware re-raises to the server after answering, so the keep-alive connection is
    dropped), this answers and returns, and the connection stays usable."""

    def __init__(self, app, on_error: Callable[[dict], None]) -> None:
        self.app, self.on_error = app, on_error

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            log.exception("unhandled error on %s", scope["path"])
            if started:  # a stream already under way: nothing left to answer with
                raise
            self.on_error(scope)
            await JSONResponse(
                error_body_for(scope["path"], 500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                status_code=500,
            )(scope, receive, tracked)


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """An upper bound on the characters one token decodes to (byte-fallback tokens count as one), so that
    `len(text) > max_context * bound` proves, without tokenizing, that text cannot fit the context."""
    longest = 1
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(i) or ""
        if not _BYTE_TOKEN.fullmatch(piece):
            longest = max(longest, len(piece))
    return longest


def _bounded_ids(ctx: ServerContext, build: Callable[[], str], param: str) -> list[int]:
    text = build()
    limit = ctx.caps.max_context
    if len(text) > limit * ctx.max_token_chars:
        raise APIError(
            f"this model's maximum context length is {limit} tokens, and the prompt's {len(text)} "
            f"characters are more than that many tokens can hold; shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )
    return ctx.tokenizer.encode(text)


async def prompt_ids(ctx: ServerContext, build: Callable[[], str], param: str = "messages") -> list[int]:
    """Token ids of the prompt `build()` renders. Rendering and tokenizing run on a worker thread so that one
    large request cannot stall other streams or /health; a prompt longer than the context could ever hold is
    refused before it is tokenized."""
    return await anyio.to_thread.run_sync(_bounded_ids, ctx, build, param)
