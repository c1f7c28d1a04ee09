"""Runtime stage (reference backend): `ReferenceRunner`, the engine core's ModelRunner over the NumPy model.

Each sequence has its own SeqState (target K/V + drafter context); a step runs the sequences one after another,
which is what batching means for a CPU oracle: the same tokens as one at a time, by construction. Finished
sequences go to the backend's LRU prefix cache, and a new sequence starts from its longest cached prefix.
"""

from __future__ import annotations

from ..backend import BackendError
from ..scheduler import Sequence
from .state import SeqState

PREFILL_CHUNK = 256  # prompt tokens per prefill call (the engine core interleaves chunks with decode steps)


class ReferenceRunner:
    def __init__(self, backend, max_num_seqs: int = 8, kv_tokens: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK) -> None:
        self.backend, self.decoder = backend, backend.decoder
        self.max_context, self.max_num_seqs = backend.max_context, max_num_seqs
        self.kv_tokens = kv_tokens if kv_tokens is not None else max_num_seqs * backend.max_context
        drafter = backend.drafter
        self.verify_block = drafter.block_size if drafter is not None else 1
        self.prefill_chunk = prefill_chunk
        self._states: dict[str, SeqState] = {}

    def check(self, seq: Sequence) -> None:
        vocab = self.backend.spec.target.vocab_size
        bad = [t for t in seq.prompt if not 0 <= t < vocab]
        if bad:
            raise BackendError(f"prompt token ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}")
        if seq.speculative and self.backend.drafter is None:
            raise BackendError("speculative decoding needs a drafter: this checkpoint has none (pass --draft DIR)")

    def admit(self, seq: Sequence) -> int:
        state, reused = self.backend.prefix_cache.lookup(seq.tokens[:seq.prefill_target + 1])
        self._states[seq.request_id] = state if state is not None else self.decoder.new_state()
        return reused

    def prefill(self, seq: Sequence, start: int, end: int, sample: bool, launched=None) -> int | None:
        if launched is not None:  # NumPy computes on this thread: nothing runs beside it
            launched()
        state = self._states[seq.request_id]
        assert state.length == start, (state.length, start)
        return self.decoder.prefill(state, seq.tokens[start:end], seq.sampling, end if sample else None)

    def decode(self, seqs: list[Sequence], launched=None) -> list[tuple[list[int], bool]]:
        if launched is not None:
            launched()
        out = []
        for seq in seqs:
            state, start = self._states[seq.request_id], len(seq.tokens) - 1
            assert state.length == start, (state.length, start)
            out.append((self.decoder.step(state, seq.output[-1], start, seq.sampling, seq.speculative,
                                          seq.room(self.max_context)), seq.speculative))
        return out

    def release(self, seq: Sequence, finished: bool) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None and finished and state.length >= len(seq.prompt):
            self.backend.prefix_cache.store(state)  # reusable for any prompt it is a prefix of
