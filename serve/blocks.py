"""Serve stage: the one content-block state machine, which Anthropic's content blocks and the Responses output items
both are: neutral output events -> numbered blocks (text, reasoning, tool call), each opened when its kind starts
and closed when the kind changes, its call ends, or the answer ends.

Adjacent text of one kind joins one block, so the blocks are the same for any split of the output into steps.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from .events import Event, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallBegin, ToolCallEnd


class BlockKind(enum.Enum):
    TEXT = "text"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


@dataclass(frozen=True)
class Block:
    """One block as it stands: its place in the answer (0, 1, ...), its text so far (a tool call's: its arguments'
    JSON so far), and a tool call's id and name."""

    index: int
    kind: BlockKind
    text: str = ""
    call_id: str = ""
    name: str = ""


class Change(enum.Enum):
    OPEN = "open"
    DELTA = "delta"
    CLOSE = "close"


@dataclass(frozen=True)
class BlockChange:
    """What an event did to a block: opened it (still empty), added `delta` to it, or closed it (whole)."""

    change: Change
    block: Block
    delta: str = ""


class Blocks:
    """Feed neutral events, get the block changes they make; `closed` holds the finished blocks in order."""

    def __init__(self) -> None:
        self.open: Block | None = None
        self.closed: list[Block] = []

    def add(self, event: Event) -> list[BlockChange]:
        """The changes `event` makes (none for events that are no output: tokens, usage, finish)."""
        if isinstance(event, (TextDelta, ReasoningDelta)):
            kind = BlockKind.TEXT if isinstance(event, TextDelta) else BlockKind.REASONING
            if self.open is not None and self.open.kind is kind:
                return self._extend(self.open, event.text)
            out = self._start(Block(0, kind))
            return out + self._extend(out[-1].block, event.text)
        if isinstance(event, ToolCallBegin):
            return self._start(Block(0, BlockKind.TOOL_CALL, call_id=event.id, name=event.name))
        if isinstance(event, ToolCallArguments):
            if self.open is None or self.open.call_id != event.id:
                raise ValueError(f"arguments of the tool call {event.id!r}, which is not open")
            return self._extend(self.open, event.delta)
        if isinstance(event, ToolCallEnd):
            return self.close()
        return []

    def close(self) -> list[BlockChange]:
        """Close the open block, if any (at the end of the answer)."""
        block, self.open = self.open, None
        if block is None:
            return []
        self.closed.append(block)
        return [BlockChange(Change.CLOSE, block)]

    def _start(self, block: Block) -> list[BlockChange]:
        out = self.close()
        self.open = replace(block, index=len(self.closed))
        return out + [BlockChange(Change.OPEN, self.open)]

    def _extend(self, block: Block, text: str) -> list[BlockChange]:
        self.open = replace(block, text=block.text + text)
        return [BlockChange(Change.DELTA, self.open, text)]
