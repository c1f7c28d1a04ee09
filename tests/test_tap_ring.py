"""The tap ring's record (runtime/cuda/tap_ring.py TapRing): which lane's positions it holds as steps are recorded,
the rows they take (position p in row p % rows, at most two runs a range), restarts on another lane, a gap or a
rewind, drops; and that it is long enough for the draft policy's longest run of plain steps between two DFlash
steps of a lone sequence whose drafts never land."""

from __future__ import annotations

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.cuda.runner import SPEC_STEP_COST
from thorgen.runtime.cuda.tap_ring import TAP_RING_ROWS, TapRing
from thorgen.runtime.engine.sequence import Sequence
from thorgen.runtime.engine.speculation import DraftPlanner


def _recorded(ring: TapRing, lane: int, positions: range) -> list[int]:
    return [ring.record(lane, p) for p in positions]


def test_consecutive_positions_are_held_and_wrap_in_rows():
    ring = TapRing(rows=8)
    assert not ring.holds(0, 0, 1)  # (nothing recorded)
    assert _recorded(ring, 0, range(5, 17)) == [5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0]
    # 12 positions through 8 rows: the last 8 (9..16) are held
    assert (ring.lane, ring.lo, ring.hi) == (0, 9, 16)
    assert ring.holds(0, 9, 17) and ring.holds(0, 12, 14)
    assert not ring.holds(0, 8, 17) and not ring.holds(0, 9, 18) and not ring.holds(1, 9, 17)
    assert not ring.holds(0, 12, 12)  # (an empty range is never asked for)
    assert ring.runs(9, 17) == [(1, 7), (0, 1)]  # 9..15 in rows 1..7, 16 in row 0
    assert ring.runs(16, 17) == [(0, 1)] and ring.runs(10, 13) == [(2, 3)]
    assert ring.runs(8, 16) == [(0, 8)]  # (a whole turn from row 0: one run)
    assert sum(n for _, n in ring.runs(9, 17)) == 8


def test_another_lane_a_gap_or_a_rewind_restarts_it():
    ring = TapRing(rows=8)
    _recorded(ring, 0, range(10, 14))
    ring.record(1, 14)  # another lane
    assert (ring.lane, ring.lo, ring.hi) == (1, 14, 14) and not ring.holds(0, 10, 14)
    _recorded(ring, 1, range(15, 18))
    assert ring.holds(1, 14, 18)
    ring.record(1, 19)  # a gap: 18 was never recorded
    assert (ring.lo, ring.hi) == (19, 19) and not ring.holds(1, 17, 20)
    _recorded(ring, 1, range(20, 23))
    ring.record(1, 21)  # a rewind
    assert (ring.lo, ring.hi) == (21, 21) and not ring.holds(1, 19, 22)
    ring.record(1, 21)  # the same position again is a rewind too
    assert (ring.lo, ring.hi) == (21, 21)


def test_drops_forget_only_the_owners_positions():
    ring = TapRing(rows=8)
    _recorded(ring, 2, range(0, 6))
    ring.drop(1)  # another lane's: kept
    assert ring.holds(2, 0, 6)
    ring.drop(2)
    assert ring.lane is None and not ring.holds(2, 0, 6)
    ring.record(2, 6)  # (after a drop the next position starts afresh, even where it follows the last one)
    assert (ring.lo, ring.hi) == (6, 6) and not ring.holds(2, 5, 7)
    ring.drop()
    assert ring.lane is None


def test_the_ring_holds_the_longest_run_of_plain_steps_between_probes():
    """A lone sequence whose drafts never land, under the default draft policy and the runner's cost model: every
    run of plain steps (the positions a probe's catch-up needs), plus a step launched ahead, fits the ring."""
    planner = DraftPlanner(lambda drafts, batch: SPEC_STEP_COST, 15, 1 << 20)
    seq = Sequence("r", [2, 3, 4], SamplingParams(), 1 << 16, speculative=True)
    runs, plain, probes = [], 0, 0
    for _ in range(4000):
        planner.plan(seq)
        if seq.drafts:
            probes += not seq.drafts_on
            planner.record(seq, seq.drafts, 0)
            runs.append(plain)
            plain = 0
        else:
            planner.record(seq, 0, 0)
            plain += 1
        seq.output.append(5)
    assert probes >= 8 and max(runs) == planner.options.probe_max  # (the waits reached the longest)
    assert max(runs) + 1 <= TAP_RING_ROWS
