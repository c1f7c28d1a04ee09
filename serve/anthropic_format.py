"""Serve stage: Anthropic's Messages shapes over the answer skeleton (serve/answer.py): the blocks of serve/blocks.py
as content blocks (thinking, text, tool_use), whole or as Anthropic's event stream (message_start, ping,
content_block_start/delta/stop, message_delta, message_stop), with stop_reason and usage (cache_read_input_tokens
from the engine's prefix cache)."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from typing import Any

from .answer import Adapter, sse
from .blocks import Block, BlockChange, BlockKind, Blocks, Change
from .context import ServerContext
from .events import Event, Finish, FinishReason, Usage
from .generation import Generation
from .protocol import APIError

STOP_REASONS = {
    FinishReason.STOP: "end_turn",
    FinishReason.LENGTH: "max_tokens",
    FinishReason.TOOL_CALLS: "tool_use",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.CANCELLED: "end_turn",
}


def signature(thinking: str) -> str:
    """A thinking block's signature: the SHA-256 of its text, base64. It lets a client see that a block came back
    unchanged; it proves nothing to this server, which leaves earlier thinking out of the prompt anyway."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def content_block(block: Block, started: bool = False) -> dict[str, Any]:
    """The content block (`started`: as content_block_start announces it, before any of its text)."""
    if block.kind is BlockKind.REASONING:
        return {"type": "thinking", "thinking": block.text, "signature": signature(block.text)}
    if block.kind is BlockKind.TEXT:
        return {"type": "text", "text": block.text}
    return {
        "type": "tool_use",
        "id": "toolu_" + block.call_id,
        "name": block.name,
        "input": {} if started else json.loads(block.text),
    }


def _delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind is BlockKind.REASONING:
        return {"type": "thinking_delta", "thinking": text}
    if block.kind is BlockKind.TEXT:
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def usage_json(used: Usage) -> dict[str, Any]:
    """Anthropic counts the prompt tokens served from the cache apart from the rest: input_tokens are those that
    were not. The engine's prefix cache fills itself, so nothing counts as an explicit cache write."""
    return {
        "input_tokens": used.prompt_tokens - used.cached_tokens,
        "output_tokens": used.completion_tokens,
        "cache_read_input_tokens": used.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


class MessagesAdapter(Adapter):
    """One Messages answer (one generation)."""

    def __init__(self, ctx: ServerContext, gen: Generation, streaming: bool) -> None:
        super().__init__([gen], streaming)
        self.id, self.model = "msg_" + uuid.uuid4().hex, ctx.model_id
        self.blocks = Blocks()
        self.usage = Usage(len(gen.job.prompt_ids), 0, 0, 0)  # as message_start reports it
        self.finish = Finish(FinishReason.STOP)

    def _event(self, change: BlockChange) -> list[bytes]:
        block = change.block
        if change.change is Change.OPEN:
            return [
                sse(
                    {
                        "type": "content_block_start",
                        "index": block.index,
                        "content_block": content_block(block, started=True),
                    },
                    "content_block_start",
                )
            ]
        if change.change is Change.DELTA:
            return [
                sse(
                    {"type": "content_block_delta", "index": block.index, "delta": _delta(block, change.delta)},
                    "content_block_delta",
                )
            ]
        out = []
        if block.kind is BlockKind.REASONING:
            out.append(
                sse(
                    {
                        "type": "content_block_delta",
                        "index": block.index,
                        "delta": {"type": "signature_delta", "signature": signature(block.text)},
                    },
                    "content_block_delta",
                )
            )
        return out + [sse({"type": "content_block_stop", "index": block.index}, "content_block_stop")]

    def _message(
        self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None
    ) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage_json(self.usage),
        }

    def opening(self) -> list[bytes]:
        return [
            sse({"type": "message_start", "message": self._message([], None, None)}, "message_start"),
            sse({"type": "ping"}, "ping"),
        ]

    def add(self, choice: int, event: Event) -> list[bytes]:
        if isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Finish):
            self.finish = event
        changes = self.blocks.add(event)
        return [chunk for change in changes for chunk in self._event(change)] if self.streaming else []

    def closing(self) -> list[bytes]:
        out = [chunk for change in self.blocks.close() for chunk in self._event(change)]
        delta = {"stop_reason": STOP_REASONS[self.finish.reason], "stop_sequence": self.finish.stop_sequence}
        return out + [
            sse({"type": "message_delta", "delta": delta, "usage": usage_json(self.usage)}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop"),
        ]

    def failure(self, error: APIError) -> list[bytes]:
        kind = "overloaded_error" if error.status == 429 else "api_error"
        return [sse({"type": "error", "error": {"type": kind, "message": error.message}}, "error")]

    def body(self) -> dict[str, Any]:
        self.blocks.close()
        return self._message(
            [content_block(b) for b in self.blocks.closed], STOP_REASONS[self.finish.reason], self.finish.stop_sequence
        )
