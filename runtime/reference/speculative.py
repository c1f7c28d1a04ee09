"""Runtime stage (reference backend): the decode loop, plain (one token per step) or DFlash speculative.

Speculative step (block B): block = [last token t at position start, drafts d_1..d_{n}] with n = min(B, room)-1;
the target verifies the block in one forward; y_i = its own token at position start+1+i (greedy argmax, or the
seeded sample, which depends only on seed and position); acc = longest prefix with d_{i+1} == y_i; the step
commits y_0..y_acc (acc drafts + the bonus token), truncated after a stop id. The target K/V is rolled back
to the committed length and the drafter context receives the taps of the committed block positions.
Because every committed token is exactly the token plain decoding would produce at that position, speculative
output equals plain output for the same seed, by construction.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator

import numpy as np

from ..backend import GenerationResult, SamplingParams, StepOutput
from .drafter import Drafter
from .model import TargetModel
from .sampling import sample
from .state import SeqState


class Decoder:
    """Drives one target (and optionally one drafter) over a SeqState."""

    def __init__(self, target: TargetModel, drafter: Drafter | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.tap_layers: tuple[int, ...] = () if drafter is None else tuple(drafter.tap_layers)

    def new_state(self) -> SeqState:
        return SeqState([], self.target.new_cache(), None if self.drafter is None else self.drafter.new_context())

    def _forward(self, state: SeqState, ids: list[int], last_only: bool) -> np.ndarray:
        out = self.target.forward(ids, state.kv, taps=self.tap_layers, last_only=last_only)
        self._pending_taps = (np.concatenate([out.taps[l] for l in self.tap_layers], axis=-1)
                              if self.tap_layers else np.zeros((len(ids), 0), dtype=np.float32))
        return out.logits

    def _commit(self, state: SeqState, ids: list[int], n: int) -> None:
        """Keep the first n of the tokens just forwarded (their K/V and taps); roll back the rest."""
        state.kv.truncate(state.length + n)
        if state.draft is not None:
            state.draft.append(self._pending_taps[:n])
        state.tokens.extend(ids[:n])

    def run(self, state: SeqState, prompt: list[int], max_tokens: int, sampling: SamplingParams,
            stop_ids: frozenset[int], speculative: bool, max_context: int, result: GenerationResult,
            cancelled: Callable[[], bool] | None = None) -> Iterator[StepOutput]:
        """Generate after `prompt`; `state` covers a prefix (shorter than the prompt) of it. Fills `result`."""
        if speculative and self.drafter is None:
            raise ValueError("speculative decoding needs a drafter")
        is_cancelled = cancelled or (lambda: False)
        p = len(prompt)
        t0 = time.perf_counter()
        rest = prompt[state.length:]
        logits = self._forward(state, rest, last_only=True)
        self._commit(state, rest, len(rest))
        tok = sample(logits[-1], sampling, p)
        result.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            result.token_ids.append(tok)
            yield StepOutput([tok])
            if tok in stop_ids:
                result.finish_reason = "stop"
                return
            start = p  # absolute position of `tok`, the last sampled token (not yet in the K/V)
            while True:
                room = min(max_tokens - len(result.token_ids), max_context - (start + 1))
                if room <= 0:
                    result.finish_reason = "length"
                    return
                if is_cancelled():
                    result.finish_reason = "cancelled"
                    return
                drafts: list[int] = []
                n_drafts = min(self.drafter.block_size, room) - 1 if speculative and self.drafter else 0
                if n_drafts > 0:
                    assert self.drafter is not None and state.draft is not None
                    # The drafter always runs its full block (same masks as the real engine); extra drafts
                    # past the token budget are dropped.
                    drafts = [int(d) for d in self.drafter.propose(state.draft, tok, start)][:n_drafts]
                block = [tok] + drafts
                logits = self._forward(state, block, last_only=False)
                new = [sample(logits[0], sampling, start + 1)]
                while len(new) <= len(drafts) and drafts[len(new) - 1] == new[-1]:
                    new.append(sample(logits[len(new)], sampling, start + 1 + len(new)))
                stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
                if stop_at is not None:
                    new = new[: stop_at + 1]
                self._commit(state, block, len(new))
                result.token_ids.extend(new)
                if speculative:
                    result.accepted_lengths.append(len(new))
                yield StepOutput(new, accepted=len(new) - 1 if speculative else None)  # drafts committed
                if stop_at is not None:
                    result.finish_reason = "stop"
                    return
                tok, start = new[-1], start + len(new)
        finally:
            result.decode_s = time.perf_counter() - t1
