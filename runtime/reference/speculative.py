"""Runtime stage (reference backend): one sequence's prefill and decode steps, plain or DFlash speculative.

Speculative step (block B): block = [last token t at position start, drafts d_1..d_{n}] with n = min(B, room)-1;
the target verifies the block in one forward; y_i = its own token at position start+1+i (greedy argmax, or the
seeded sample, which depends only on seed and position); acc = longest prefix with d_{i+1} == y_i; the step
commits y_0..y_acc (acc drafts + the bonus token), truncated after a stop id. The target K/V is rolled back
to the committed length and the drafter context receives the taps of the committed block positions.
Because every committed token is exactly the token plain decoding would produce at that position, speculative
output equals plain output for the same seed, by construction.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...model_spec.conventions import accepted_count
from ..backend import SamplingParams
from .drafter import Drafter
from .model import ImageRows, TargetModel
from .sampling import sample
from .state import SeqState

# pick(softcapped logits row [V], absolute position) -> token: the runner's per-sequence sampler
Pick = Callable[[np.ndarray, int], int]


class PickedInOrder:
    """The target's tokens of a verify block as a sequence the acceptance rule reads: token i is picked on first
    use, after tokens 0..i-1 (a pick feeds the grammar and the logprobs, so only tokens that can be committed, in
    order, are picked)."""

    def __init__(self, logits: np.ndarray, position: int, pick: Pick) -> None:
        self.logits, self.position, self.pick = logits, position, pick
        self.picked: list[int] = []

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, i: int) -> int:
        while len(self.picked) <= i:
            j = len(self.picked)
            self.picked.append(self.pick(self.logits[j], self.position + j))
        return self.picked[i]


class Decoder:
    """Drives one target (and optionally one drafter) over a SeqState."""

    def __init__(self, target: TargetModel, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.tap_layers: tuple[int, ...] = () if drafter is None else tuple(drafter.tap_layers)
        # `thorgen bench --emulate-acceptance K`: every verify step commits K drafts + 1 whatever the drafter said
        # (a speed measurement at a chosen acceptance on random weights; the tokens are not the model's)
        self.emulate_acceptance: int | None = None

    def new_state(self) -> SeqState:
        return SeqState([], self.target.new_cache(), None if self.drafter is None else self.drafter.new_context())

    def _forward(self, state: SeqState, ids: list[int], last_only: bool, images: ImageRows = ()) -> np.ndarray:
        extra = {"images": images} if images else {}
        out = self.target.forward(ids, state.kv, taps=self.tap_layers, last_only=last_only, **extra)
        self._pending_taps = (
            np.concatenate([out.taps[l] for l in self.tap_layers], axis=-1)
            if self.tap_layers
            else np.zeros((len(ids), 0), dtype=np.float32)
        )
        return out.logits

    def _commit(self, state: SeqState, ids: list[int], n: int) -> None:
        """Keep the first n of the tokens just forwarded (their K/V and taps); roll back the rest."""
        state.kv.truncate(state.length + n)
        if state.draft is not None:
            state.draft.append(self._pending_taps[:n])
        state.tokens.extend(ids[:n])

    def prefill(
        self,
        state: SeqState,
        ids: list[int],
        sampling: SamplingParams,
        sample_at: int | None,
        pick: Pick | None = None,
        score: Callable[[np.ndarray], None] | None = None,
        images: ImageRows = (),
        keys: list[int] | None = None,
    ) -> int | None:
        """Forward `ids` after what `state` covers and keep them; with `sample_at` (the new token's position),
        sample the token that follows them (with `pick` where given, else the plain sampler). `score` is given
        every row's softcapped logits [len(ids), V] (prompt logprobs). `images` (row, embeddings) replace rows;
        `keys` (the cache keys of ids, image placeholders keyed by image) are what the state records."""
        logits = self._forward(state, ids, last_only=score is None, images=images)
        if score is not None:
            score(logits)
        self._commit(state, ids if keys is None else keys, len(ids))
        if sample_at is None:
            return None
        return sample(logits[-1], sampling, sample_at) if pick is None else pick(logits[-1], sample_at)

    def step(
        self,
        state: SeqState,
        tok: int,
        start: int,
        sampling: SamplingParams,
        drafts: int,
        room: int,
        pick: Pick | None = None,
        allowed: Callable[[list[int]], int] | None = None,
    ) -> tuple[list[int], int]:
        """One step for `tok` at position `start` (not yet in the K/V): plain (`drafts` 0), or draft + verify of
        a block of at most `drafts` drafts and `room` tokens. Returns the committed tokens (accepted drafts + the
        bonus token), whose K/V it keeps (the engine core cuts them at a stop id), and the drafts it verified.
        `pick` (default: the plain sampler) is called once per committed token, in order. `allowed(drafts)`: how
        many leading drafts the sequence's grammar and min_tokens allow (Sequence.allowed_prefix); the block
        verifies those only, since `pick` masks every row as a plain step would and so never takes a refused one."""
        if pick is None:

            def pick(row: np.ndarray, position: int) -> int:
                return sample(row, sampling, position)

        proposed: list[int] = []
        n_drafts = min(self.drafter.block_size, room) - 1 if self.drafter else 0
        n_drafts = min(n_drafts, drafts)  # (the draft policy's count: within the request's own cap already)
        if n_drafts > 0:
            assert self.drafter is not None and state.draft is not None
            # The drafter always runs its full block (same masks as the real engine); extra drafts past the
            # step's count are dropped.
            proposed = [int(d) for d in self.drafter.propose(state.draft, tok, start)][:n_drafts]
        drafted = len(proposed)
        if allowed is not None and proposed:
            proposed = proposed[: allowed(proposed)]
        block = [tok] + proposed
        logits = self._forward(state, block, last_only=False)
        targets = PickedInOrder(logits, start + 1, pick)
        n = accepted_count(proposed, targets, len(block), self.emulate_acceptance)
        new = [targets[i] for i in range(n)]
        self._commit(state, block, n)
        return new, drafted
