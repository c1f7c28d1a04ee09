"""Serve stage: Responses API answers: the parser's events as output items (reasoning, message, function_call),
whole or as the Responses event stream (response.created, response.in_progress, output_item.added,
content_part.added, output_text.delta, ..., response.completed), with the Responses usage."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .generation import ClientGone, Generation, deltas, sse
from .parser import Event
from .pipeline import client_gone, collect, start
from .protocol import APIError

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
PART = {"reasoning": "reasoning_text", "content": "output_text"}  # the content part each text kind fills


def item(event: Event, item_id: str, done: bool = True) -> dict:
    """The output item of one event (`done` False: as announced, before its text)."""
    status = "completed" if done else "in_progress"
    if event.call is not None:
        return {"id": item_id, "type": "function_call", "call_id": event.call.id, "name": event.call.name,
                "arguments": event.call.arguments if done else "", "status": status}
    if event.kind == "reasoning":
        return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
                "content": [part(event)] if done else []}
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [part(event)] if done else []}


def part(event: Event, text: str | None = None) -> dict:
    text = event.text if text is None else text
    if event.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def usage(gen: Generation) -> dict:
    cached = gen.result.cached_prompt_tokens if gen.result is not None else 0
    prompt = len(gen.job.prompt_ids)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": gen.n_out,
            "output_tokens_details": {"reasoning_tokens": gen.parser.n_reasoning_tokens},
            "total_tokens": prompt + gen.n_out}


class _Response:
    """The response object, from its first snapshot (in progress, no output) to the final one."""

    def __init__(self, server: Any, gen: Generation, settings: dict) -> None:
        self.gen, self.settings = gen, settings
        self.id = "resp_" + gen.id.split("-", 1)[1]
        self.model, self.created = server.model_id, int(time.time())
        self.output: list[dict] = []
        self.n_items = 0

    def item_id(self, event: Event) -> str:
        self.n_items += 1
        prefix = {"reasoning": "rs", "content": "msg", "tool_call": "fc"}[event.kind]
        return f"{prefix}_{self.id[5:]}_{self.n_items}"

    def body(self, status: str) -> dict:
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "usage": usage(self.gen) if status != "in_progress" else None, **self.settings}

    def final_status(self) -> str:
        return "incomplete" if self.gen.finish_reason() == "length" else "completed"


async def serve_response(server: Any, request: Request, gen: Generation, stream: bool, settings: dict) -> Any:
    firsts = await start(server, request, [gen])
    if firsts is None:
        return client_gone()
    response = _Response(server, gen, settings)
    if stream:
        return StreamingResponse(stream_response(response, request, firsts[0]), media_type="text/event-stream",
                                 headers=STREAM_HEADERS)
    totals = await collect([gen], request, firsts)
    if totals is None:
        return client_gone()
    response.output = [item(e, response.item_id(e)) for e in totals[0].events]
    gen.record(200)
    return JSONResponse(response.body(response.final_status()))


class _Items:
    """The streamed output items: each kind change (and each function call) finishes one item and adds the next."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.open: Event | None = None  # the open item's event so far (its whole text)
        self.open_id = ""
        self.seq = 0

    def emit(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def close(self) -> list[bytes]:
        event, self.open = self.open, None
        if event is None:
            return []
        index, at = len(self.response.output), {"item_id": self.open_id, "output_index": len(self.response.output)}
        done = item(event, self.open_id)
        out = []
        if event.call is not None:
            out.append(self.emit("response.function_call_arguments.done", **at, arguments=event.call.arguments,
                                 name=event.call.name))
        else:
            kind = "response.output_text.done" if event.kind == "content" else "response.reasoning_text.done"
            extra = {"logprobs": []} if event.kind == "content" else {}
            out.append(self.emit(kind, **at, content_index=0, text=event.text, **extra))
            out.append(self.emit("response.content_part.done", **at, content_index=0, part=part(event)))
        self.response.output.append(done)
        out.append(self.emit("response.output_item.done", output_index=index, item=done))
        return out

    def add(self, event: Event) -> list[bytes]:
        out = []
        if self.open is None or event.kind != self.open.kind or event.call is not None:
            out += self.close()
            self.open_id = self.response.item_id(event)
            self.open = Event(event.kind, "", event.call)
            index = len(self.response.output)
            out.append(self.emit("response.output_item.added", output_index=index,
                                 item=item(self.open, self.open_id, done=False)))
            if event.call is None:
                out.append(self.emit("response.content_part.added", item_id=self.open_id, output_index=index,
                                     content_index=0, part=part(event, "")))
        at = {"item_id": self.open_id, "output_index": len(self.response.output)}
        if event.call is not None:
            out.append(self.emit("response.function_call_arguments.delta", **at, delta=event.call.arguments))
            return out
        self.open = Event(event.kind, self.open.text + event.text)
        if event.kind == "content":
            out.append(self.emit("response.output_text.delta", **at, content_index=0, delta=event.text,
                                 logprobs=[]))
        else:
            out.append(self.emit("response.reasoning_text.delta", **at, content_index=0, delta=event.text))
        return out


async def stream_response(response: _Response, request: Request, first: tuple[str, Any]) -> AsyncIterator[bytes]:
    gen, items = response.gen, _Items(response)
    try:
        yield items.emit("response.created", response=response.body("in_progress"))
        yield items.emit("response.in_progress", response=response.body("in_progress"))
        async for _, kind, payload, delta in deltas([gen], request, [first]):
            if kind == "error":
                err: APIError = payload
                yield items.emit("error", code=err.code or err.type, message=err.message, param=err.param)
                gen.record(err.status)
                return
            for event in delta.events:
                for chunk in items.add(event):
                    yield chunk
        for chunk in items.close():
            yield chunk
        status = response.final_status()
        yield items.emit(f"response.{status}", response=response.body(status))
        gen.record(200)
    except ClientGone:
        pass
    finally:
        gen.record(499)
        gen.job.abort()
