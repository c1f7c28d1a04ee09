"""Serve stage: the Responses API's shapes over the answer skeleton (serve/answer.py): the blocks of serve/blocks.py
as output items (reasoning, message, function_call), whole or as the Responses event stream (response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta, ..., response.completed), with the
Responses usage."""

from __future__ import annotations

import time
import uuid
from typing import Any

from .answer import Adapter, sse
from .blocks import Block, BlockChange, BlockKind, Blocks, Change
from .context import ServerContext
from .events import Event, Finish, FinishReason, Usage
from .generation import Generation
from .protocol import APIError

ITEM_PREFIXES = {BlockKind.REASONING: "rs", BlockKind.TEXT: "msg", BlockKind.TOOL_CALL: "fc"}


def part(block: Block) -> dict[str, Any]:
    """The content part a text or reasoning block fills."""
    if block.kind is BlockKind.REASONING:
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


def usage_json(used: Usage) -> dict[str, Any]:
    return {
        "input_tokens": used.prompt_tokens,
        "input_tokens_details": {"cached_tokens": used.cached_tokens},
        "output_tokens": used.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": used.reasoning_tokens},
        "total_tokens": used.prompt_tokens + used.completion_tokens,
    }


class ResponsesAdapter(Adapter):
    """One response object (one generation), from its first snapshot (in progress, no output) to the final one;
    `settings`: the request's settings, which the response object repeats."""

    def __init__(self, ctx: ServerContext, gen: Generation, streaming: bool, settings: dict[str, Any]) -> None:
        super().__init__([gen], streaming)
        self.settings = settings
        self.hex = uuid.uuid4().hex
        self.id, self.model, self.created = "resp_" + self.hex, ctx.model_id, int(time.time())
        self.blocks = Blocks()
        self.usage: Usage | None = None
        self.finish = Finish(FinishReason.STOP)
        self.seq = 0  # the stream's next sequence_number

    def item(self, block: Block, done: bool = True) -> dict[str, Any]:
        """The output item of a block (`done` False: as announced, before its text)."""
        item_id, status = self.item_id(block), "completed" if done else "in_progress"
        if block.kind is BlockKind.TOOL_CALL:
            return {
                "id": item_id,
                "type": "function_call",
                "call_id": "call_" + block.call_id,
                "name": block.name,
                "arguments": block.text if done else "",
                "status": status,
            }
        if block.kind is BlockKind.REASONING:
            return {
                "id": item_id,
                "type": "reasoning",
                "summary": [],
                "status": status,
                "content": [part(block)] if done else [],
            }
        return {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [part(block)] if done else [],
        }

    def item_id(self, block: Block) -> str:
        return f"{ITEM_PREFIXES[block.kind]}_{self.hex}_{block.index + 1}"

    def response(self, status: str) -> dict[str, Any]:
        incomplete = status == "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [self.item(b) for b in self.blocks.closed],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": usage_json(self.usage) if self.usage is not None and status != "in_progress" else None,
            **self.settings,
        }

    def _status(self) -> str:
        return "incomplete" if self.finish.reason is FinishReason.LENGTH else "completed"

    def _emit(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(body, kind)

    def _events(self, change: BlockChange) -> list[bytes]:
        block = change.block
        at = {"item_id": self.item_id(block), "output_index": block.index}
        call = block.kind is BlockKind.TOOL_CALL
        if change.change is Change.OPEN:
            out = [self._emit("response.output_item.added", output_index=block.index, item=self.item(block, False))]
            if not call:
                out.append(self._emit("response.content_part.added", **at, content_index=0, part=part(block)))
            return out
        if change.change is Change.DELTA:
            if call:
                return [self._emit("response.function_call_arguments.delta", **at, delta=change.delta)]
            if block.kind is BlockKind.TEXT:
                return [
                    self._emit("response.output_text.delta", **at, content_index=0, delta=change.delta, logprobs=[])
                ]
            return [self._emit("response.reasoning_text.delta", **at, content_index=0, delta=change.delta)]
        if call:
            out = [self._emit("response.function_call_arguments.done", **at, arguments=block.text, name=block.name)]
        else:
            text = block.kind is BlockKind.TEXT
            out = [
                self._emit(
                    "response.output_text.done" if text else "response.reasoning_text.done",
                    **at,
                    content_index=0,
                    text=block.text,
                    **({"logprobs": []} if text else {}),
                ),
                self._emit("response.content_part.done", **at, content_index=0, part=part(block)),
            ]
        return out + [self._emit("response.output_item.done", output_index=block.index, item=self.item(block))]

    def opening(self) -> list[bytes]:
        return [
            self._emit("response.created", response=self.response("in_progress")),
            self._emit("response.in_progress", response=self.response("in_progress")),
        ]

    def add(self, choice: int, event: Event) -> list[bytes]:
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Finish):
            self.finish = event
        changes = self.blocks.add(event)
        return [chunk for change in changes for chunk in self._events(change)] if self.streaming else []

    def closing(self) -> list[bytes]:
        out = [chunk for change in self.blocks.close() for chunk in self._events(change)]
        status = self._status()
        return out + [self._emit(f"response.{status}", response=self.response(status))]

    def failure(self, error: APIError) -> list[bytes]:
        return [self._emit("error", code=error.code or error.type, message=error.message, param=error.param)]

    def body(self) -> dict[str, Any]:
        self.blocks.close()
        return self.response(self._status())
