"""Runtime stage (reference backend): `ReferenceRunner`, the engine core's ModelRunner over the NumPy model.

Each sequence has its own SeqState (target K/V + drafter context); a step runs the sequences one after another,
which is what batching means for a CPU oracle: the same tokens as one at a time, by construction. Finished
sequences go to the backend's LRU prefix cache, and a new sequence starts from its longest cached prefix.
A sequence with logits processing (penalties, logit_bias, a grammar) decodes without speculation: each token's
processing depends on the tokens before it, which a verify block does not know yet. Logprobs alone keep
speculation (the verify logits of each committed position are that position's own logits).
A sequence whose step fails (its processing, grammar, sampling or verify) gets its error as its row's result;
the sequences after it in the step run as they would have alone.
"""

from __future__ import annotations

import numpy as np

from ..backend import BackendError, EngineStateLost, SequenceFailed, check_image_spans, span_floor
from ..engine.scheduler import Sequence
from .logits import process, token_logprob
from .sampling import sample
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
        self.lookahead = 0  # (each step runs to its end before the next is scheduled)
        self.prefill_chunk = prefill_chunk
        self.caught_up_tokens = 0  # (each sequence's drafter state follows it through every step)
        self._states: dict[str, SeqState] = {}

    def check(self, seq: Sequence) -> None:
        if seq.speculative and self.backend.drafter is None:
            raise BackendError("speculative decoding needs a drafter: this checkpoint has none (pass --draft DIR)")
        seq.prepare(self.backend.spec.target.vocab_size)
        vision = self.backend.spec.vision
        if seq.images and vision is None:
            raise BackendError(f"{self.backend.spec.name} has no vision tower: it cannot take images")
        if vision is not None:  # placeholders and images must agree (a typed `<|image|>` has no image)
            check_image_spans(seq.prompt, seq.images, vision.image_token_id)

    def _keys(self, seq: Sequence, start: int, end: int) -> list[int]:
        """Cache keys of tokens start..end-1: the prompt's (images keyed by content), then the output's ids."""
        keys = seq.prompt_keys
        return keys[start:end] + seq.output[max(start - len(keys), 0):max(end - len(keys), 0)]

    def admit(self, seq: Sequence, limit: int) -> int:
        # lookup() keeps at least the last token it is given to run: give it one past the limit
        state, reused = self.backend.prefix_cache.lookup(self._keys(seq, 0, limit + 1))
        floor = span_floor(reused, seq.images)  # a hit never ends inside an image: its span runs whole
        if state is not None and floor < reused:
            state.truncate(floor)
            reused = floor
        self._states[seq.request_id] = state if state is not None else self.decoder.new_state()
        return reused

    def _image_rows(self, seq: Sequence, start: int, end: int) -> list:
        """(row in the chunk, embeddings) of the images in prompt positions start..end-1; never a part of one."""
        rows = []
        for span in seq.images:
            if span.offset < end and span.end > start:
                if span.offset < start or span.end > end:
                    raise BackendError(f"prefill chunk {start}..{end} splits image span {span.offset}..{span.end}")
                rows.append((span.offset - start, self.backend.encoder_cache.rows(span.image)))
        return rows

    def prefill(self, seq: Sequence, start: int, end: int, sample: bool, launched=None) -> int | None:
        if launched is not None:  # NumPy computes on this thread: nothing runs beside it
            launched()
        state = self._states[seq.request_id]
        assert state.length == start, (state.length, start)
        pick = _Pick.of(seq) if sample else None
        score = None
        if seq.scores_prompt:
            targets, top = seq.prompt[start + 1:seq.scored_upto(start, end)], seq.sampling.prompt_logprobs

            def score(logits: np.ndarray) -> None:
                seq.prompt_logprobs.extend(token_logprob(logits[i], t, top) for i, t in enumerate(targets))
        token = self.decoder.prefill(state, seq.tokens[start:end], seq.sampling, end if sample else None, pick,
                                     score, self._image_rows(seq, start, end) if seq.images else (),
                                     self._keys(seq, start, end) if seq.images else None)
        if pick is not None:
            seq.step_logprobs = pick.logprobs
        return token

    def decode(self, seqs: list[Sequence], launched=None) -> list[tuple[list[int], bool] | Exception]:
        if launched is not None:
            launched()
        out: list[tuple[list[int], bool] | Exception] = []
        for seq in seqs:
            try:
                out.append(self._decode_one(seq))
            except EngineStateLost:
                raise
            except Exception as exc:  # this sequence's own fault: its state is dropped when the core finishes it
                out.append(exc)
        return out

    def _decode_one(self, seq: Sequence) -> tuple[list[int], bool]:
        state, start = self._states[seq.request_id], seq.num_tokens - 1
        assert state.length == start, (state.length, start)
        speculative = seq.speculative and not seq.sampling.processed
        pick = _Pick.of(seq)
        tokens = self.decoder.step(state, seq.output[-1], start, seq.sampling, speculative,
                                   seq.room(self.max_context), pick)
        if pick is not None:
            seq.step_logprobs = pick.logprobs
        return tokens, speculative

    def release(self, seq: Sequence, finished: bool) -> None:
        state = self._states.pop(seq.request_id, None)
        if state is not None and finished and state.length >= len(seq.prompt):
            self.backend.prefix_cache.store(state)  # reusable for any prompt it is a prefix of


class _Pick:
    """One step's sampler for a sequence that uses logits processing or logprobs: processes each row (with the
    tokens picked earlier in the step), samples, records the logprob and feeds the grammar."""

    def __init__(self, seq: Sequence) -> None:
        self.seq, self.picked = seq, []
        self.logprobs: list | None = [] if seq.sampling.logprobs is not None else None

    @classmethod
    def of(cls, seq: Sequence) -> "_Pick | None":
        return cls(seq) if seq.sampling.extended else None  # None: the plain sampler, no extra work

    def __call__(self, row: np.ndarray, position: int) -> int:
        params, matcher = self.seq.sampling, self.seq.matcher
        z = row
        if params.processed:
            allowed = self.seq.allowed(row.shape[0], len(self.picked))
            z = process(row, params, self.seq.prompt, self.seq.output + self.picked, allowed)
            if not np.all(z < np.inf):  # +inf or NaN: refused as the device's lm_process status refuses it
                raise SequenceFailed(self.seq.request_id, "a processed logit is not finite (its penalties or "
                                     f"logit_bias overflowed) at position {position}", request_fault=True)
        token = sample(z, params, position)
        if matcher is not None:
            matcher.accept(token)
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(row, token, params.logprobs))
        self.picked.append(token)
        return token
