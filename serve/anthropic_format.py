"""Serve stage: Anthropic Messages answers: the parser's events as content blocks (thinking, text, tool_use), whole
or as Anthropic's event stream (message_start, ping, content_block_start/delta/stop, message_delta, message_stop),
with stop_reason and usage (cache_read_input_tokens from the engine's prefix cache)."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .generation import ClientGone, Generation, deltas, sse
from .parser import Event, ToolCall
from .pipeline import client_gone, collect, start
from .protocol import APIError

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def signature(thinking: str) -> str:
    """A thinking block's signature: the SHA-256 of its text, base64. It lets a client see that a block came back
    unchanged; it proves nothing to this server, which leaves earlier thinking out of the prompt anyway."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def tool_use_id(call: ToolCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def block(event: Event) -> dict:
    if event.kind == "reasoning":
        return {"type": "thinking", "thinking": event.text, "signature": signature(event.text)}
    if event.kind == "content":
        return {"type": "text", "text": event.text}
    call = event.call
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": json.loads(call.arguments)}


def stop_reason(gen: Generation) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    reason = gen.finish_reason()
    if reason == "tool_calls":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    matched = gen.parser.stop_sequence
    return ("stop_sequence", matched) if matched is not None else ("end_turn", None)


def usage(gen: Generation) -> dict:
    """Anthropic counts the prompt tokens served from the cache apart from the rest: input_tokens are those that
    were not. The engine's prefix cache fills itself, so nothing counts as an explicit cache write."""
    cached = gen.result.cached_prompt_tokens if gen.result is not None else 0
    return {"input_tokens": len(gen.job.prompt_ids) - cached, "output_tokens": gen.n_out,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def message_id(gen: Generation) -> str:
    return "msg_" + gen.id.split("-", 1)[1]


async def serve_message(server: Any, request: Request, gen: Generation, stream: bool) -> Any:
    firsts = await start(server, request, [gen])
    if firsts is None:
        return client_gone()
    if stream:
        return StreamingResponse(stream_message(server, request, gen, firsts[0]), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    totals = await collect([gen], request, firsts)
    if totals is None:
        return client_gone()
    reason, matched = stop_reason(gen)
    gen.record(200)
    return JSONResponse({"id": message_id(gen), "type": "message", "role": "assistant", "model": server.model_id,
                         "content": [block(e) for e in totals[0].events], "stop_reason": reason,
                         "stop_sequence": matched, "usage": usage(gen)})


class _Blocks:
    """The streamed content blocks: each kind change (and each tool call) closes one block and opens the next."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None
        self.thinking = ""

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "reasoning":
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "signature_delta", "signature": signature(self.thinking)}},
                           "content_block_delta"))
        self.kind, self.thinking = None, ""
        return out + [sse({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def add(self, event: Event) -> list[bytes]:
        out = []
        if event.kind != self.kind or event.call is not None:
            out += self.close()
            self.index += 1
            self.kind = event.kind
            start = block(Event(event.kind, "", event.call))
            if event.call is not None:
                start["input"] = {}
            out.append(sse({"type": "content_block_start", "index": self.index, "content_block": start},
                           "content_block_start"))
        if event.kind == "reasoning":
            self.thinking += event.text
            delta = {"type": "thinking_delta", "thinking": event.text}
        elif event.kind == "content":
            delta = {"type": "text_delta", "text": event.text}
        else:
            delta = {"type": "input_json_delta", "partial_json": event.call.arguments}
        out.append(sse({"type": "content_block_delta", "index": self.index, "delta": delta}, "content_block_delta"))
        return out


async def stream_message(server: Any, request: Request, gen: Generation, first: tuple[str, Any]
                         ) -> AsyncIterator[bytes]:
    blocks = _Blocks()
    try:
        start_usage = {"input_tokens": len(gen.job.prompt_ids), "output_tokens": 0,
                       "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        yield sse({"type": "message_start", "message": {
            "id": message_id(gen), "type": "message", "role": "assistant", "model": server.model_id, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": start_usage}}, "message_start")
        yield sse({"type": "ping"}, "ping")
        async for _, kind, payload, delta in deltas([gen], request, [first]):
            if kind == "error":
                err: APIError = payload
                yield sse({"type": "error", "error": {"type": "overloaded_error" if err.status == 429 else
                                                      "api_error", "message": err.message}}, "error")
                gen.record(err.status)
                return
            for event in delta.events:
                for chunk in blocks.add(event):
                    yield chunk
        for chunk in blocks.close():
            yield chunk
        reason, matched = stop_reason(gen)
        yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": matched},
                   "usage": usage(gen)}, "message_delta")
        yield sse({"type": "message_stop"}, "message_stop")
        gen.record(200)
    except ClientGone:
        pass
    finally:
        gen.record(499)
        gen.job.abort()
