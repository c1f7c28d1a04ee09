"""Runtime stage: the DFlash tap ring, where the plain one-row steps of a speculative sequence that decodes alone keep
their taps on the device, so that the catch-up before a draft probe projects them into the drafter context instead
of running the target over the positions those steps decoded again (a tap prefill).

Why: the draft policy (runtime/engine/speculation.py) turns a sequence whose drafts miss to plain steps and probes
again after 16, 32, ... probe_max of them; before each probe the lane's drafter context must cover every position
since its last DFlash step. The tap prefill that did this cost ~0.26 ms a position against a 2.1 ms one-row step
(H100/H200 through the server, one stream, zero acceptance): ~11 % of the plain steps' time. The plain steps
compute the tap layers' residual outputs anyway; the one-row programs with taps (codegen/programs.py, group
"speculative") also write them into row 0 of `taps`, and one device copy per step moves that row into the ring.

The ring is one activation array, `tap_ring` [TAP_RING_ROWS, n_taps * H] f16, shared by the engine's lanes: one
lane owns it at a time. `TapRing` is the host's record of which lane's positions lo..hi it holds (position p in row
p % rows); `TapRingSteps` records the steps (DecodeSteps.launch_one enqueues the copy right after its graph, on the
same stream, so a step launched ahead writes `taps` only after the step before it was copied) and projects a
range: the ring rows copied into `taps` rows 0.., their positions and lane staged, then the drafter's context
program (DRAFT_CONTEXT) over them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...model_spec.conventions import VERIFY_ROWS
from ...model_spec.step_program import DRAFT_CONTEXT, program_key
from ..options import DraftOptions
from .device import check, driver
from .steps import StepParts

# The longest run of plain steps between two DFlash steps of a lone sequence is the draft policy's longest probe
# wait; the margin holds a step launched ahead past it. (288 rows: 9.7 MB at full size, n_taps 6 x H 2816 x f16.)
TAP_RING_ROWS = DraftOptions().probe_max + 2 * VERIFY_ROWS


@dataclass
class TapRing:
    """Which lane's positions lo..hi the device's tap ring holds (position p in row p % rows); lane None: none.
    Positions are recorded as their steps are enqueued: the device has written a row once the work enqueued
    before a later use has run, which stream order gives every use (the catch-up's copies)."""

    rows: int = TAP_RING_ROWS
    lane: int | None = None
    lo: int = 0
    hi: int = -1

    def record(self, lane: int, pos: int) -> int:
        """A step of `lane` at `pos` keeps its taps: the ring row they go to. A position that does not follow the
        last one recorded (another lane, a gap, a rewind) restarts the ring there: rows before it may hold another
        sequence's taps, or none of this one's positions between."""
        if lane != self.lane or pos != self.hi + 1:
            self.lane, self.lo = lane, pos
        self.hi = pos
        self.lo = max(self.lo, pos - self.rows + 1)  # (the row it overwrites held position pos - rows)
        return pos % self.rows

    def holds(self, lane: int, start: int, end: int) -> bool:
        """Whether the ring holds every position start..end-1 of `lane`."""
        return self.lane == lane and self.lo <= start < end <= self.hi + 1

    def runs(self, start: int, end: int) -> list[tuple[int, int]]:
        """(first ring row, rows) of positions start..end-1 in order: one run, or two where the range wraps."""
        out, p = [], start
        while p < end:
            row = p % self.rows
            n = min(end - p, self.rows - row)
            out.append((row, n))
            p += n
        return out

    def drop(self, lane: int | None = None) -> None:
        """Forget what the ring holds (only where it is `lane`'s, when given): the lane holds another sequence,
        or positions a copy wrote."""
        if lane is None or lane == self.lane:
            self.lane, self.lo, self.hi = None, 0, -1


class TapRingSteps:
    """The tap ring of an engine with a drafter: its record (`book`), which one-row programs keep taps, and the
    projection of held positions into a lane's drafter context."""

    def __init__(self, parts: StepParts, rows: int = TAP_RING_ROWS) -> None:
        self.parts, self.book = parts, TapRing(rows)
        programs = parts.fwd.programs
        # (a build from before the one-row programs with taps has none: its steps keep no taps)
        self._keeps = {
            (g, e): program_key(decode=True, last=True, greedy=g, ext=e, taps=True) in programs
            for g in (True, False)
            for e in (True, False)
        }
        self.projected = 0  # positions projected from the ring (the rest of caught_up_tokens ran a tap prefill)

    def keeps(self, greedy: bool, ext: bool = False) -> bool:
        """Whether the build has the one-row step of that mode with taps."""
        return self._keeps[greedy, ext]

    def project(self, lane: int, start: int, end: int) -> None:
        """Enqueue the drafter context of positions start..end-1 of `lane` (the ring holds them: `book.holds`) in
        pieces of at most max_rows: each piece's ring rows copied into `taps` rows 0.. (two copies where it wraps),
        its positions and lane staged, then DRAFT_CONTEXT over its rows. Its row count differs from one catch-up
        to the next, so it runs the launch list its program's row range keeps, set for that count in place
        (LaunchLists.eager_rows): a catch-up of a new size binds nothing."""
        parts, cu = self.parts, driver()
        act, stream, h = parts.act, parts.stream, parts.stream.handle
        taps, ring = act["taps"], act["tap_ring"]
        width = ring.nbytes // self.book.rows
        for first in range(start, end, parts.max_rows):
            n = min(parts.max_rows, end - first)
            at = 0
            for row, count in self.book.runs(first, first + n):
                check(
                    cu.cuMemcpyDtoDAsync(taps.ptr + at * width, ring.ptr + row * width, count * width, h),
                    "taps from the tap ring",
                )
                at += count
            # (stream-ordered copies, as Engine._stage_chunk's: a step in flight may still read the last ones)
            act["positions"].view(0, 4 * n).upload(np.arange(first, first + n, dtype=np.int32), stream=stream)
            act["lanes"].view(0, 4 * n).upload(np.full(n, lane, np.int32), stream=stream)
            lists = parts.launches
            span = parts.fwd.span([DRAFT_CONTEXT], n)
            lists.run(lists.eager_rows(("tap ring",), n, span, lambda r: parts.fwd.program(DRAFT_CONTEXT, r)))
        self.projected += end - start


__all__ = ["TAP_RING_ROWS", "TapRing", "TapRingSteps"]
