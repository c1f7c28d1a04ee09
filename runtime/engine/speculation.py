"""Runtime stage (engine core): how many drafts each speculative sequence proposes a step (`DraftPlanner`, the
scheduler's policy), from an estimate of how many land (`Acceptance`, kept per sequence).

Each speculative sequence keeps an exponential average of the drafts its verify steps accepted. A step's draft
count is the one with the most expected tokens per unit of cost, where the runner says what a step of k drafts
costs in plain decode steps beside the step's other sequences (`ModelRunner.speculative_cost`: infinite where it
cannot verify drafts in a batch) and a run of k drafts is expected to accept min(k, 2 * estimate + 1): room to
double, so that an estimate capped by short drafts can grow. When even the best
count is expected to commit fewer tokens per cost than a plain step (1 + estimate < its cost), the sequence
decodes with plain steps: the same work as a request without speculation. Every `probe_every` plain steps it
probes with one speculative step; a probe whose drafts still miss doubles the wait before the next one (at most
`probe_max` steps), one that lands switches speculation back on. Beside other sequences the wait is that many steps
times the batch, since a probe turns the whole step into a verify step, and there is no probe at a batch where
drafts that all landed would not pay. A sequence that has not yet run a verify step probes at its first step
where drafts could pay: the prior is a guess, and at a batch where it says no (a batched verify costs more than a
lone one) waiting `probe_every` times the batch would spend a short request's whole life on plain steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..options import DraftOptions
from .sequence import Sequence

# (drafts, sequences in the step) -> a speculative step's cost in plain decode steps (ModelRunner.speculative_cost)
Cost = Callable[[int, int], float]

# the (estimate, cap, batch) choices DraftPlanner keeps before it starts over (~0.2 KB each): each verify step may
# give its sequences' estimates new values, which a long-running server would otherwise keep for good
BEST_KEPT = 4096


@dataclass
class Acceptance:
    """One sequence's estimate of the drafts a verify step accepts, and its probe schedule while switched off."""

    estimate: float
    probe_wait: int  # plain steps between probes now
    plain_steps: int = 0  # plain steps since the last speculative one
    probed: bool = False  # whether a verify step was planned for it yet (before that the prior is untested)

    def record(self, planned: int, drafted: int, accepted: int, on: bool, options: DraftOptions) -> None:
        """A step planned with `planned` drafts ran `drafted` (0: plain) of which `accepted` were accepted; `on`:
        the policy had speculation on for it (off and planned: a probe). A probe the runner could not run (its
        drafter context too far behind) counts as one that missed."""
        probe = planned > 0 and not on
        self.probed = self.probed or planned > 0
        if drafted == 0:
            self.plain_steps = 0 if probe else self.plain_steps + 1
        else:
            self.plain_steps = 0
            self.estimate += options.weight * (accepted - self.estimate)
        if probe:
            self.probe_wait = min(2 * self.probe_wait, options.probe_max)


class DraftPlanner:
    """The scheduler's draft policy over a runner's cost model: `plan(seq)` sets `seq.drafts` (this step's
    drafts, 0: a plain step) and `seq.drafts_next` (the next step's drafts should this one accept none: what a
    runner may launch ahead), `record(seq, drafted, accepted)` feeds the estimate after the step."""

    def __init__(self, cost: Cost, max_drafts: int, max_context: int, options: DraftOptions | None = None) -> None:
        self.max_drafts, self.max_context = max_drafts, max_context
        self.options = options or DraftOptions()
        self.batch = 1  # sequences in the step planned last
        self._model = cost
        # (the runner's cost model is fixed: each (drafts, batch) is worked out once, not for every draft count of
        # every sequence at every step, which at 16 sequences was ~480 evaluations a step on the host's critical path)
        self._costs: dict[tuple[int, int], float] = {}
        # (and so is `best` of an (estimate, cap, batch): an estimate changes only at its sequence's verify steps,
        # and sequences with the same history share it, while every sequence asked for it twice a step, each a max
        # over every draft count: ~0.19 ms of host work a step at 16 sequences, ~0.1 ms at 8, on an EPYC core)
        self._best: dict[tuple[float, int, int], tuple[int, bool]] = {}
        self._ladders: dict[tuple[int, int], list[float]] = {}  # (cap, batch) -> the costs of 1..cap drafts

    def cost(self, drafts: int, batch: int) -> float:
        """The runner's cost of a speculative step of `drafts` drafts beside `batch` sequences (memoised)."""
        got = self._costs.get((drafts, batch))
        if got is None:
            got = self._costs[drafts, batch] = self._model(drafts, batch)
        return got

    def crowded(self, batch: int) -> bool:
        """Whether sequences that decode together draft (in batched verify steps: a step of two could verify a
        draft), but a step of `batch` could not give each one (the runner's cost is infinite there)."""
        return math.isfinite(self.cost(1, 2)) and not math.isfinite(self.cost(1, batch))

    def _cap(self, seq: Sequence) -> int:
        """The most drafts `seq` may propose: the drafter's block, the request's own cap, the room left."""
        cap = self.max_drafts
        if seq.sampling.draft_tokens is not None:
            cap = min(cap, seq.sampling.draft_tokens)
        return max(0, min(cap, seq.room(self.max_context) - 1))

    def best(self, estimate: float, cap: int, batch: int = 1) -> tuple[int, bool]:
        """(the draft count with the most expected tokens per cost in a step of `batch` sequences, whether that
        beats a plain step; 0 drafts where the runner cannot verify any) (memoised)."""
        got = self._best.get((estimate, cap, batch))
        if got is None:
            if len(self._best) >= BEST_KEPT:
                self._best.clear()
            got = self._best[estimate, cap, batch] = self._best_of(estimate, cap, batch)
        return got

    def _best_of(self, estimate: float, cap: int, batch: int) -> tuple[int, bool]:
        if cap <= 0 or math.isinf(self.cost(1, batch)):
            return 0, False
        costs = self._ladders.get((cap, batch))
        if costs is None:
            costs = self._ladders[cap, batch] = [self.cost(n, batch) for n in range(1, cap + 1)]
        # (a plain loop over the costs: each new estimate of a drafting sequence comes here, at every verify step,
        # and a max over a generator of tuples took 4x as long)
        reach = 2 * estimate + 1
        top, k = -math.inf, 0
        for n, cost in enumerate(costs, 1):
            value = (1 + (n if n <= reach else reach)) / cost  # (1 + min(n, reach): expected tokens, per cost)
            if value >= top:  # (ties: more drafts)
                top, k = value, n
        return k, 1 + min(k, estimate) >= costs[k - 1]

    def _drafts(
        self, estimate: float, probe_wait: int, probed: bool, cap: int, plain_steps: int, batch: int
    ) -> tuple[int, bool]:
        """(drafts, speculation on) for a step after `plain_steps` plain steps, of an Acceptance's estimate, probe
        wait and whether it probed yet."""
        k, on = self.best(estimate, cap, batch)
        if on or k == 0:
            return k, on
        # (a probe costs every sequence of its step a verify step: its wait grows with the batch, and none where
        # speculation would stay off at this batch even with every draft landing)
        waited = plain_steps >= probe_wait * batch or not probed
        if not waited or not self.best(cap, cap, batch)[1]:
            return 0, False
        return k, False

    def plan(self, seq: Sequence, batch: int = 1) -> None:
        """`seq`'s drafts in a step of `batch` decoding sequences."""
        self.batch = batch
        if not seq.speculative:
            seq.drafts, seq.drafts_next, seq.drafts_on = 0, 0, False
            return
        if not self.options.adaptive:
            seq.drafts = seq.drafts_next = self._cap(seq)
            seq.drafts_on = True
            return
        acc = seq.acceptance
        if acc is None:
            acc = seq.acceptance = Acceptance(self.options.prior, self.options.probe_every)
        # (no draft count is verified at this batch: best's 0 drafts now and next step, without its calls; the cuda
        # runner's every step above 16 sequences, where this is all the planning a sequence gets)
        if math.isinf(self.cost(1, batch)):
            seq.drafts, seq.drafts_next, seq.drafts_on = 0, 0, False
            return
        cap = self._cap(seq)
        seq.drafts, seq.drafts_on = self._drafts(acc.estimate, acc.probe_wait, acc.probed, cap, acc.plain_steps, batch)
        if seq.drafts:  # the next step's estimate should this one accept nothing
            decayed = acc.estimate * (1 - self.options.weight)
            wait = acc.probe_wait if seq.drafts_on else min(2 * acc.probe_wait, self.options.probe_max)
            seq.drafts_next = self._drafts(decayed, wait, True, cap, 0, batch)[0]
        else:
            seq.drafts_next = self._drafts(acc.estimate, acc.probe_wait, acc.probed, cap, acc.plain_steps + 1, batch)[0]

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        acc = seq.acceptance
        if acc is None:
            return
        acc.record(seq.drafts, drafted, accepted, seq.drafts_on, self.options)
        if drafted and not seq.drafts_on and self.best(acc.estimate, self._cap(seq), self.batch)[1]:
            acc.probe_wait = self.options.probe_every  # a probe that landed: speculation is on again


__all__ = ["Acceptance", "DraftPlanner"]
