"""Runtime stage: `StagingRing`, the engine's pinned host staging memory cut into named slots of NumPy record types.

Every host <-> device copy of a step (its positions, lanes, token ids and sampling parameters in; its tokens out)
goes through pinned memory, asynchronously. A slot must not be rewritten while a copy from or into it may still be
queued, so each kind of slot has several copies used in turn (`next`): as many as steps of that kind can be in
flight at once, times what the stream's synchronisation guarantees. The record types below name every field, so
the engine writes `slot.record["positions"][:n]` and copies from `slot.at("positions")`, never from a hand-counted
byte offset.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...model_spec.conventions import MAX_BATCH, SAMPLE_PARAMS, VERIFY_ROWS
from .memory import PinnedBuffer

I32 = np.int32
# a one-row step's inputs: its position, the position it samples at, a staged token id (-1: the one in out_ids[0])
ROW_INPUT = np.dtype([("position", I32), ("sampled", I32), ("token", I32), ("lane", I32)])
# tokens read back (one row, or a batched step's rows)
ROW_TOKEN = np.dtype([("tokens", I32, (1,))])
# a batched step: each row's token id, position, sampled position, KV lane and SampleParams; its tokens read back
BATCH = np.dtype(
    [
        ("ids", I32, (MAX_BATCH,)),
        ("positions", I32, (MAX_BATCH,)),
        ("sampled", I32, (MAX_BATCH,)),
        ("lanes", I32, (MAX_BATCH,)),
        ("params", SAMPLE_PARAMS, (MAX_BATCH,)),
        ("tokens", I32, (MAX_BATCH,)),
    ]
)
# a DFlash block: positions, sampled positions, the last committed token, KV lanes, the acceptance rule
# [most tokens a step commits, emulated K or -1]
SPEC_BLOCK = np.dtype(
    [
        ("positions", I32, (VERIFY_ROWS,)),
        ("sampled", I32, (VERIFY_ROWS,)),
        ("last", I32),
        ("lanes", I32, (VERIFY_ROWS,)),
        ("rule", I32, (2,)),
    ]
)
# a DFlash step's forced drafts (draft_hook) and its read-back: drafts, verified tokens, the device's count
SPEC_STEP = np.dtype(
    [
        ("forced", I32, (VERIFY_ROWS - 1,)),
        ("ids", I32, (VERIFY_ROWS,)),
        ("out_ids", I32, (VERIFY_ROWS,)),
        ("accepted", I32),
    ]
)

# a batched verify's batched draft step (runtime/cuda/draft_batch.py), a block of VERIFY_ROWS rows per drafting
# sequence (at most MAX_BATCH // 2 of them: each takes two verify rows): each row's position, KV lane and token id
# (a block's last committed token; the embedding masks the others); the drafts read back (carry's first rows)
DRAFT_ROWS = np.dtype(
    [
        ("positions", I32, (MAX_BATCH // 2 * VERIFY_ROWS,)),
        ("lanes", I32, (MAX_BATCH // 2 * VERIFY_ROWS,)),
        ("ids", I32, (MAX_BATCH // 2 * VERIFY_ROWS,)),
        ("drafts", I32, (MAX_BATCH,)),
    ]
)

ALIGN = 64  # bytes between slots (a cache line: the host writes one slot while the DMA engine reads another)

# Turns per kind. One-row inputs: 128, used in turn (the stream is synchronised at least every 128 steps).
# One-row, batched and DFlash steps: two each (a runner launches step n + 1 before it waits for step n, so a slot
# is rewritten only after the step that used it was waited for). The DFlash block is rewritten only when no step
# is in flight (a step launched ahead reads its block from the device), the prefill token only after a wait, the
# token of a chunk run in pieces (one chunk at a time) only after it was read; the batched verify's drafter blocks
# likewise (that step is never launched ahead: the runner waits for it).
ENGINE_SLOTS: dict[str, tuple[np.dtype, int]] = {
    "row_input": (ROW_INPUT, 128),
    "row_token": (ROW_TOKEN, 2),
    "prefill_token": (ROW_TOKEN, 1),
    "piece_token": (ROW_TOKEN, 1),
    "batch": (BATCH, 2),
    "spec_block": (SPEC_BLOCK, 1),
    "spec_step": (SPEC_STEP, 2),
    "draft_rows": (DRAFT_ROWS, 1),
}


class Slot(NamedTuple):
    """One record in pinned memory: `record` (a 0-d structured array over its bytes), its address, its turn."""

    record: np.ndarray
    ptr: int
    turn: int

    def at(self, field: str) -> int:
        """The address of `field` (a copy's host source or destination)."""
        return self.ptr + self.record.dtype.fields[field][1]


class StagingRing:
    """Pinned host memory holding `turns` slots of each named kind; `next(kind)` hands them out in turn."""

    def __init__(self, kinds: dict[str, tuple[np.dtype, int]]) -> None:
        layout, total = {}, 0
        for kind, (dtype, turns) in kinds.items():
            size = -(-dtype.itemsize // ALIGN) * ALIGN
            layout[kind] = (dtype, [total + t * size for t in range(turns)])
            total += turns * size
        self._pinned = PinnedBuffer(max(total, ALIGN))
        self._slots = {
            kind: [self._slot(dtype, off, t) for t, off in enumerate(offs)] for kind, (dtype, offs) in layout.items()
        }
        self._turn = dict.fromkeys(kinds, 0)

    def _slot(self, dtype: np.dtype, offset: int, turn: int) -> Slot:
        record = self._pinned.array[offset : offset + dtype.itemsize].view(dtype).reshape(())
        return Slot(record, self._pinned.ptr + offset, turn)

    def next(self, kind: str) -> Slot:
        """The next slot of `kind`, in turn."""
        slots, turn = self._slots[kind], self._turn[kind]
        self._turn[kind] = (turn + 1) % len(slots)
        return slots[turn]

    def free(self) -> None:
        self._slots = {}
        self._pinned.free()


__all__ = [
    "BATCH",
    "DRAFT_ROWS",
    "ENGINE_SLOTS",
    "ROW_INPUT",
    "ROW_TOKEN",
    "SPEC_BLOCK",
    "SPEC_STEP",
    "Slot",
    "StagingRing",
]
