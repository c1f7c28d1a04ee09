"""Runtime stage: `DecodeSteps`, the engine's decode steps (one row, or a batch of sequences, also a batched verify's
rows: runtime/cuda/spec_batch.py): launch, then wait.

A step is staged through the pinned staging ring (runtime/cuda/staging.py), replayed as a captured graph
(runtime/cuda/launch_lists.py), and its tokens copied back into its staging slot; `wait` reads them once the
event after the copy fired. A runner enqueues step n + 1 before it waits for step n, so the GPU does not wait for
the host between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ...model_spec.conventions import MAX_BATCH, SAMPLE_PARAMS, decode_bucket
from ...model_spec.step_program import DRAFT_CONTEXT
from ..backend import BackendError
from .device import Device, Stream, check, driver
from .graphs import CudaGraph
from .launch_lists import LaunchLists
from .memory import Arena
from .programs import Forward
from .staging import ENGINE_SLOTS, Slot, StagingRing


@dataclass(frozen=True)
class StepParts:
    """What every step class of the engine launches with (decode, DFlash, vision), made once by the Engine and
    passed explicitly: the device and the stream steps run on, the activation arena, the bound forward programs,
    the launch lists (graphs), the pinned staging ring and the step rows."""

    device: Device
    stream: Stream
    act: Arena
    fwd: Forward
    launches: LaunchLists
    staging: StagingRing
    max_rows: int


class BatchLaunch(NamedTuple):
    """A batched (or one-row) step in flight: its row count, the staging slot its tokens land in, the event after
    them."""

    rows: int
    slot: Slot
    done: Any


class DecodeSteps:
    """Graphed one-row and batched decode steps over the engine's buffers and streams."""

    def __init__(self, parts: StepParts, lanes: int) -> None:
        self.stream, self.act, self.fwd, self.launches, self.staging = (
            parts.stream,
            parts.act,
            parts.fwd,
            parts.launches,
            parts.staging,
        )
        self.max_rows, self.lanes = parts.max_rows, lanes
        # a launch's tokens landed in its staging slot: an event per slot of each read-back kind
        self._landed = {
            kind: [parts.device.event(timing=False) for _ in range(ENGINE_SLOTS[kind][1])]
            for kind in ("row_token", "batch")
        }

    def row_graph(self, greedy: bool, ext: bool = False, taps: bool = False) -> CudaGraph:
        """The graphed one-row step (captured on first use); `taps`: its tap layers also write row 0 of `taps`."""
        return self.launches.captured(
            ("greedy" if greedy else "sample") + ("_ext" if ext else "") + ("_taps" if taps else ""),
            lambda: self.fwd.ops(1, decode=True, last=True, greedy=greedy, ext=ext, taps=taps),
            "decode step",
        )

    def batch_graph(self, B: int, greedy: bool, ext: bool = False, taps: bool = False) -> CudaGraph:
        """The graphed batched step of bucket `B` (captured on first use); `taps`: a batched verify's, the drafter's
        context program after the forward (launch_batch)."""
        return self.launches.captured(
            f"batch{B}_{'greedy' if greedy else 'sample'}" + ("_taps" if taps else "") + ("_ext" if ext else ""),
            lambda: (
                self.fwd.ops(B, decode=False, last=True, greedy=greedy, batched=True, ext=ext, taps=taps)
                + (self.fwd.program(DRAFT_CONTEXT, B) if taps else [])
            ),
            f"{'verify' if taps else 'decode'} x{B}",
        )

    def stage_row(self, position: int, token: int | None, lane: int = 0) -> None:
        """Async copies of a one-row step's position (and sampled position, KV lane, and a prompt token into
        out_ids[0]) from the next row-input slot (a step launched ahead may still wait for its own)."""
        slot = self.staging.next("row_input")
        slot.record[()] = (position, position + 1, -1 if token is None else token, lane)
        cu, h, pos = driver(), self.stream.handle, self.act["positions"].ptr
        check(cu.cuMemcpyHtoDAsync(pos, slot.at("position"), 4, h), "position")
        check(cu.cuMemcpyHtoDAsync(pos + 4 * self.max_rows, slot.at("sampled"), 4, h), "sample position")
        check(cu.cuMemcpyHtoDAsync(self.act["lanes"].ptr, slot.at("lane"), 4, h), "KV lane")
        if token is not None:
            check(cu.cuMemcpyHtoDAsync(self.act["out_ids"].ptr, slot.at("token"), 4, h), "prompt token")

    def launch_one(
        self,
        position: int,
        greedy: bool = True,
        token: int | None = None,
        lane: int = 0,
        ext: bool = False,
        tap_row: int | None = None,
    ) -> BatchLaunch:
        """Enqueue the graphed one-row step for the token at `position` (its id is out_ids[0], or `token` when
        given) without waiting for it: a runner may enqueue the next step of the same sequence (token None: the one
        this step leaves in out_ids[0]) before it reads this one's token (`wait`). `tap_row`: the step keeps its
        DFlash taps in that row of the tap ring (runtime/cuda/tap_ring.py): the graph with taps, then one copy of
        `taps` row 0 into it, on the same stream (a step enqueued after this one writes `taps` after the copy)."""
        self.stage_row(position, token, lane)
        self.row_graph(greedy, ext, taps=tap_row is not None).replay(self.stream)
        if tap_row is not None:
            taps, ring = self.act["taps"], self.act["tap_ring"]
            width = taps.nbytes // self.max_rows  # (a row of taps: n_taps * H f16, as a ring row)
            check(
                driver().cuMemcpyDtoDAsync(ring.ptr + tap_row * width, taps.ptr, width, self.stream.handle),
                "taps into the tap ring",
            )
        return self._read_back("row_token", 1, 1)

    def launch_batch(
        self,
        rows: list[tuple[int, int, int, Any]],
        carried: dict[int, int] | None = None,
        ext: bool = False,
        taps: bool = False,
    ) -> BatchLaunch:
        """Stage and enqueue one batched forward without waiting for it: rows of (KV lane, position, token id,
        sampling params or None for greedy), each the next token of its own sequence. The rows run the graph of the
        smallest bucket holding them (17..32 rows: the M = 32 kernels, each weight byte read once for all rows);
        padding rows repeat row 0 (they rewrite its K/V with the same values, and their tokens are dropped).
        `carried` maps a row to a row of `carry` on the device: that row's input token is the one there (the row's
        own token id is ignored). The batched launch before this one leaves its tokens there, so a runner can
        launch step n + 1 before step n's tokens reach the host; a batched verify's drafter leaves its drafts.
        `taps` (a batched verify, runtime/cuda/spec_batch.py): several rows may be one sequence's consecutive
        positions in its lane (rowwise attention is causal: every row's K/V is written before any row attends);
        the DFlash taps of every row go into the drafter context of its lane and position (the drafter's context
        program after the forward), and the rows' input token ids are read back with the tokens (`inputs`)."""
        n = len(rows)
        if not 1 <= n <= MAX_BATCH:
            raise BackendError(f"a batched decode step of {n} rows: 1..{MAX_BATCH}")
        distinct = len({r[:2] for r in rows}) if taps else len({r[0] for r in rows})
        if distinct != n or not all(0 <= r[0] < self.lanes for r in rows):
            raise BackendError(
                f"batched decode: KV lanes {[r[0] for r in rows]} (positions {[r[1] for r in rows]}) must be "
                f"distinct{' (lane, position) pairs' if taps else ''}, in 0..{self.lanes - 1}"
            )
        carried = carried or {}
        greedy = all(r[3] is None or r[3].greedy for r in rows)
        B = decode_bucket(max(n, 2 if taps else 1))  # (a verify's programs start at 2 rows)
        padded = rows + [rows[0]] * (B - n)
        slot = self.staging.next("batch")
        rec = slot.record
        for field, col in (("lanes", 0), ("positions", 1), ("ids", 2)):
            rec[field] = 0
            rec[field][:B] = [r[col] for r in padded]
        rec["sampled"] = 0
        rec["sampled"][:B] = rec["positions"][:B] + 1
        cu, h = driver(), self.stream.handle
        ids, pos_ptr, carry = self.act["ids"].ptr, self.act["positions"].ptr, self.act["carry"].ptr
        check(cu.cuMemcpyHtoDAsync(ids, slot.at("ids"), 4 * B, h), "batch token ids")
        check(cu.cuMemcpyHtoDAsync(pos_ptr, slot.at("positions"), 4 * B, h), "batch positions")
        check(
            cu.cuMemcpyHtoDAsync(pos_ptr + 4 * self.max_rows, slot.at("sampled"), 4 * B, h), "batch sampled positions"
        )
        check(cu.cuMemcpyHtoDAsync(self.act["lanes"].ptr, slot.at("lanes"), 4 * B, h), "batch KV lanes")
        for dst, first, count in _runs(carried):  # carried ids: runs of consecutive rows, one copy each
            check(cu.cuMemcpyDtoDAsync(ids + 4 * dst, carry + 4 * first, 4 * count, h), "carried token ids")
        if 0 in carried and B > n:  # padding rows repeat row 0's token: copy it once, then double the copies
            check(cu.cuMemcpyDtoDAsync(ids + 4 * n, ids, 4, h), "padding token id")
            done = n + 1
            while done < B:
                count = min(done - n, B - done)
                check(cu.cuMemcpyDtoDAsync(ids + 4 * done, ids + 4 * n, 4 * count, h), "padding token ids")
                done += count
        if not greedy:  # greedy rows of a sampled step: temperature 0 (the sampler's argmax)
            for i, (_, _, _, sp) in enumerate(padded):
                rec["params"][i] = sample_record(sp)
            check(
                cu.cuMemcpyHtoDAsync(self.act["params"].ptr, slot.at("params"), B * SAMPLE_PARAMS.itemsize, h),
                "batch sampling params",
            )
        self.batch_graph(B, greedy, ext, taps).replay(self.stream)
        if taps:  # (the same slot: its ids were copied to the device before, in stream order)
            check(cu.cuMemcpyDtoHAsync(slot.at("ids"), ids, 4 * B, h), "verified input ids")
        # (the carried copy: a prefill may reuse out_ids before the next batched step reads these tokens)
        check(cu.cuMemcpyDtoDAsync(carry, self.act["out_ids"].ptr, 4 * B, h), "tokens to carry")
        return self._read_back("batch", B, n, slot)

    def _read_back(self, kind: str, count: int, rows: int, slot: Slot | None = None) -> BatchLaunch:
        """Enqueue the copy of out_ids[:count] into the (next) slot of `kind`, then the event that says it landed."""
        slot = slot or self.staging.next(kind)
        check(
            driver().cuMemcpyDtoHAsync(slot.at("tokens"), self.act["out_ids"].ptr, 4 * count, self.stream.handle),
            "token ids",
        )
        done = self._landed[kind][slot.turn]
        done.record(self.stream)
        return BatchLaunch(rows, slot, done)

    @staticmethod
    def wait(launch: BatchLaunch) -> list[int]:
        """The tokens of a launch_one or launch_batch (waits for that launch only, not for work enqueued after)."""
        launch.done.synchronize()
        return [int(t) for t in launch.slot.record["tokens"][: launch.rows]]

    @staticmethod
    def inputs(launch: BatchLaunch) -> list[int]:
        """The input token ids a waited-for `taps` launch ran (carried rows included: a verify's drafts)."""
        return [int(t) for t in launch.slot.record["ids"][: launch.rows]]

    @staticmethod
    def settle(launch: Any) -> None:
        """Wait for a launched step whose tokens nobody reads (a runner's step launched ahead, then not needed)."""
        launch.done.synchronize()
        for ev in getattr(launch, "timing", None) or []:
            ev.destroy()

    def destroy(self) -> None:
        for ev in [e for evs in self._landed.values() for e in evs]:
            ev.destroy()
        self._landed = {}


def sample_record(sampling: Any) -> np.void:
    """A thorgen::SampleParams record for runtime.backend.SamplingParams (None or greedy: temperature 0)."""
    rec = np.zeros((), SAMPLE_PARAMS)
    rec["top_p"] = 1.0  # (off)
    if sampling is not None and not sampling.greedy:
        rec["temperature"], rec["top_k"] = sampling.temperature, sampling.top_k
        rec["top_p"], rec["min_p"] = sampling.top_p, sampling.min_p
        rec["seed"] = np.uint64(int(sampling.seed or 0) % 2**64)
    return rec


def _runs(carried: dict[int, int]) -> list[tuple[int, int, int]]:
    """(first row, first source row, count) for each run of consecutive rows carried from consecutive rows."""
    runs: list[list[int]] = []
    for dst in sorted(carried):
        src = carried[dst]
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [tuple(r) for r in runs]


__all__ = ["BatchLaunch", "DecodeSteps", "StepParts", "sample_record"]
