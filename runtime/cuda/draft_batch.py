"""Runtime stage: `BatchedDraft`, the drafter of a batched verify step (runtime/cuda/spec_batch.py): the DFlash blocks
of every drafting sequence through the drafter in one launch of its program, then their drafts into `carry`.

A step of n drafting sequences, each (KV lane, position `pos`, last token, k drafts wanted):
  1. one staging copy each of the blocks' positions (pos..pos+15), lanes and ids (the last token; the block
     embedding masks slots 1..15), then the graph of the draft.batch program for the bucket of blocks holding n
     (2, 4, 8 or 16: padding blocks repeat block 0, rewriting its drafter K/V with the same values): the drafter's
     layers over every block at once, its weights read once, each block's attention over its own lane's drafter
     context with its own block mask (codegen/lower_draft.py LowerDraft.batch_ops); the final norm's rows in `da`;
  2. per sequence one device copy of its slots 1..k's rows into `dhead`, consecutive in sequence order;
  3. the graph of the draft.head program for those rows: lm_head once over them, each row's argmax into `carry`,
     so sequence i's drafts are carry[first_i .. first_i + k_i), where a batched verify's rows take them from.
Each block's drafts are those its one-sequence draft graph gives (the same kernels' tiling and splits per block).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...model_spec.conventions import MAX_BATCH, VERIFY_ROWS, decode_bucket
from ...model_spec.step_program import DRAFT_BATCH, DRAFT_HEAD, draft_batch_blocks
from ..backend import BackendError
from .device import check, driver
from .dflash import DraftForward
from .graphs import CudaGraph
from .staging import Slot
from .steps import StepParts


class DraftBlock(NamedTuple):
    """A drafting sequence's block: its KV lane, the position of its last token, that token, the drafts wanted."""

    lane: int
    pos: int
    last: int
    drafts: int


class BatchedDraft:
    """The batched draft steps of an engine with a drafter, over its step parts."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.most = draft_batch_blocks(parts.max_rows)
        d = parts.fwd.spec.drafter
        assert d is not None
        self.row_bytes = 2 * d.hidden_size  # (a row of da and dhead: f16)

    def missing(self) -> list[str]:
        """What the batched draft step lacks (empty: it can run)."""
        return self.parts.fwd.missing("speculative", DRAFT_BATCH, DRAFT_HEAD)

    def launch(self, blocks: list[DraftBlock]) -> tuple[Slot, list[int]]:
        """Enqueue the batched draft step of `blocks` (module docstring): its staging slot and each block's first
        draft row in carry (its drafts are carry[first .. first + drafts))."""
        n, rows = len(blocks), sum(b.drafts for b in blocks)
        if not 1 <= n <= self.most or rows > MAX_BATCH or min(b.drafts for b in blocks) < 1:
            raise BackendError(
                f"a batched draft step of {n} blocks and {rows} drafts: 1..{self.most} blocks, 1..{MAX_BATCH} drafts"
            )
        nb = decode_bucket(max(n, 2))
        padded = blocks + [blocks[0]] * (nb - n)
        eng, cu = self.parts, driver()
        h, act, B = eng.stream.handle, eng.act, VERIFY_ROWS
        slot = eng.staging.next("draft_rows")
        rec = slot.record
        rec["positions"][: nb * B] = np.concatenate([np.arange(b.pos, b.pos + B) for b in padded])
        rec["lanes"][: nb * B] = np.repeat([b.lane for b in padded], B)
        rec["ids"][: nb * B] = np.repeat([b.last for b in padded], B)
        for field, what in (("positions", "block positions"), ("lanes", "block KV lanes"), ("ids", "last tokens")):
            check(cu.cuMemcpyHtoDAsync(act[field].ptr, slot.at(field), 4 * nb * B, h), what)
        self.batch_graph(nb).replay(eng.stream)
        da, dhead, first, at = act["da"].ptr, act["dhead"].ptr, [], 0
        for i, b in enumerate(blocks):
            src, size = da + (B * i + 1) * self.row_bytes, b.drafts * self.row_bytes
            check(cu.cuMemcpyDtoDAsync(dhead + at * self.row_bytes, src, size, h), "draft rows to the head")
            first.append(at)
            at += b.drafts
        self.head_graph(rows).replay(eng.stream)
        return slot, first

    def batch_graph(self, nb: int) -> CudaGraph:
        """The graphed drafter pass over `nb` blocks (a DECODE_BUCKETS size), captured on first use."""
        fwd = self.parts.fwd  # (bound only when the graph is captured: replays build nothing)
        return self.parts.launches.captured(
            f"draft_batch{nb}", lambda: DraftForward(fwd).batch_ops(nb), f"batched draft x{nb}"
        )

    def head_graph(self, rows: int) -> CudaGraph:
        """The graphed drafter head over `rows` draft rows (1..MAX_BATCH), captured on first use."""
        fwd = self.parts.fwd
        return self.parts.launches.captured(
            f"draft_head{rows}", lambda: DraftForward(fwd).head_ops(rows), f"draft head x{rows}"
        )

    def read(self, slot: Slot, rows: int) -> np.ndarray:
        """The drafts carry[0..rows) of the step `slot` launched, on the host (waits for the stream)."""
        cu, act = driver(), self.parts.act
        check(cu.cuMemcpyDtoHAsync(slot.at("drafts"), act["carry"].ptr, 4 * rows, self.parts.stream.handle), "drafts")
        self.parts.stream.synchronize()
        return slot.record["drafts"][:rows].copy()


__all__ = ["BatchedDraft", "DraftBlock"]
