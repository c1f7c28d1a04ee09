"""Runtime stage (reference backend): `ReferenceRunner`, the engine core's ModelRunner over the NumPy model.

Each KV lane holds a SeqState (target K/V of every position + drafter context); a step runs the sequences one after
another, which is what batching means for a CPU oracle: the same tokens as one at a time, by construction. The
engine core's KV manager decides prefix reuse exactly as for the cuda backend (the same lanes, pages and rings, so
both report the same cached tokens for the same traffic): a finished sequence's state stays in its lane, a new one
keeps the first positions its admission reuses and drops the rest, and a lane copy copies the state.
Logits processing (penalties, logit_bias, a grammar, min_tokens) keeps speculation: a verify block's rows are
picked in order (speculative.PickedInOrder), each processed with the tokens picked before it in the step, which
are the accepted drafts, so every row gets the mask and penalties a plain step would give it; drafts the grammar
refuses are cut before the verify (Sequence.allowed_prefix), as none of them could be accepted. Logprobs are those
of each committed position's own logits.
A sequence whose step fails (its processing, grammar, sampling or verify) gets its error as its row's result;
the sequences after it in the step run as they would have alone.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from ...model_spec.conventions import KV_PAGE, MAX_STEP_TOKENS, ring_slots
from ..backend import BackendError, EngineStateLost, SequenceFailed, check_image_spans
from ..engine.kv_manager import ClaimLane, CopyPrefix, KVGeometry, KVOp, keys_of
from ..engine.sequence import Sequence
from .logits import process, token_logprob
from .sampling import sample
from .state import SeqState

PREFILL_CHUNK = 256  # prompt tokens per prefill call (the engine core interleaves chunks with decode steps)
SPEC_STEP_COST, DRAFT_ROW_COST = 1.2, 0.1  # speculative_cost: a step with drafts, and each draft's verify row


class ReferenceRunner:
    def __init__(
        self, backend, max_num_seqs: int = 8, kv_tokens: int | None = None, prefill_chunk: int = PREFILL_CHUNK
    ) -> None:
        self.backend, self.decoder = backend, backend.decoder
        self.max_context, self.max_num_seqs = backend.max_context, max_num_seqs
        drafter = backend.drafter
        self.verify_block = drafter.block_size if drafter is not None else 1
        self.lookahead = 0  # (each step runs to its end before the next is scheduled)
        self.prefill_chunk = prefill_chunk
        self.caught_up_tokens = 0  # (each sequence's drafter state follows it through every step)
        self.device_memory_used: int | None = None  # (host memory only)
        self.kv_geometry = reference_geometry(
            backend.spec, max_num_seqs, self.max_context, kv_tokens, backend.prefix_cache
        )
        self._lanes: list[SeqState | None] = [None] * max_num_seqs

    @property
    def image_rows_bytes(self) -> int:
        cache = self.backend.encoder_cache
        return 0 if cache is None else cache.bytes

    def media_ready(self, seq: Sequence, wait: bool, queued: Iterable[Sequence] = ()) -> bool:
        return True  # (the NumPy tower encodes in the prefill that needs the rows)

    def chunks_in_pieces(self, seq: Sequence) -> bool:
        return False  # (each chunk runs whole: NumPy has no decode step to let through between pieces)

    def check(self, seq: Sequence) -> None:
        if seq.speculative and self.backend.drafter is None:
            raise BackendError("speculative decoding needs a drafter: this checkpoint has none (pass --draft DIR)")
        seq.prepare(self.backend.spec.target.vocab_size)
        vision = self.backend.spec.vision
        if seq.images and vision is None:
            raise BackendError(f"{self.backend.spec.name} has no vision tower: it cannot take images")
        if vision is not None:  # placeholders and images must agree (a typed `<|image|>` has no image)
            check_image_spans(seq.prompt, seq.images, vision.placeholder_ids)

    def draft_context(self, lane: int) -> int:
        state = self._lanes[lane]
        return 0 if state is None or state.draft is None else state.draft.length

    def apply(self, ops: tuple[KVOp, ...]) -> None:
        for op in ops:  # (page-table rows: the reference keeps every position of a lane in its own state)
            if isinstance(op, ClaimLane):
                state = self._lanes[op.lane]
                if state is None:
                    self._lanes[op.lane] = self.decoder.new_state()
                elif state.length > op.keep:
                    state.truncate(op.keep)
            elif isinstance(op, CopyPrefix):
                src = self._lanes[op.src]
                assert src is not None and src.length >= op.tokens, "a lane copy from a lane without that prefix"
                state = src.copy()
                state.truncate(op.tokens)
                self._lanes[op.dst] = state

    def _state(self, seq: Sequence, covered: int) -> SeqState:
        """The state of `seq`'s lane, which covers its first `covered` positions."""
        assert seq.lane is not None, f"{seq.request_id} holds no lane"
        state = self._lanes[seq.lane]
        assert state is not None and state.length == covered, (None if state is None else state.length, covered)
        return state

    def _image_rows(self, seq: Sequence, start: int, end: int) -> list:
        """(row in the chunk, embeddings) of the images in prompt positions start..end-1; never a part of one."""
        rows = []
        for span in seq.images:
            if span.offset < end and span.end > start:
                if span.offset < start or span.end > end:
                    raise BackendError(f"prefill chunk {start}..{end} splits image span {span.offset}..{span.end}")
                rows.append((span.offset - start, self.backend.encoder_cache.rows(span.image)))
        return rows

    def prefill(self, seq: Sequence, start: int, end: int, sample: bool, launched=None, beside=False) -> int | None:
        if launched is not None:  # NumPy computes on this thread: nothing runs beside it
            launched()
        state = self._state(seq, start)
        pick = _Pick.of(seq) if sample else None
        score = None
        if seq.scores_prompt:
            targets, top = seq.prompt[start + 1 : seq.scored_upto(start, end)], seq.sampling.prompt_logprobs

            def score(logits: np.ndarray) -> None:
                seq.prompt_logprobs.extend(token_logprob(logits[i], t, top) for i, t in enumerate(targets))

        token = self.decoder.prefill(
            state,
            seq.tokens[start:end],
            seq.sampling,
            end if sample else None,
            pick,
            score,
            self._image_rows(seq, start, end) if seq.images else (),
            keys_of(seq, end)[start:] if seq.images else None,
        )
        if pick is not None:
            seq.step_logprobs = pick.logprobs
        return token

    def decode(self, seqs: list[Sequence], launched=None) -> list[tuple[list[int], int] | Exception]:
        if launched is not None:
            launched()
        out: list[tuple[list[int], int] | Exception] = []
        for seq in seqs:
            try:
                out.append(self._decode_one(seq))
            except EngineStateLost:
                raise
            except Exception as exc:  # this sequence's own fault: its state is dropped when the core finishes it
                out.append(exc)
        return out

    def speculative_cost(self, drafts: int, batch: int) -> float:
        """A rough model of this CPU oracle, which runs a step's sequences one after another: the drafter's
        forward and one verify row per draft beside the sequence's own row, whatever the batch."""
        return SPEC_STEP_COST + DRAFT_ROW_COST * drafts

    def _decode_one(self, seq: Sequence) -> tuple[list[int], int]:
        start = seq.num_tokens - 1
        state = self._state(seq, start)
        pick = _Pick.of(seq)
        allowed = seq.allowed_prefix if seq.sampling.processed else None
        tokens, drafted = self.decoder.step(
            state, seq.output[-1], start, seq.sampling, seq.drafts, seq.room(self.max_context), pick, allowed
        )
        if pick is not None:
            seq.step_logprobs = pick.logprobs
        return tokens, drafted

    def release(self, seq: Sequence, finished: bool) -> None:
        pass  # (its state stays in its lane: the KV manager says whether anyone reuses it)


def reference_geometry(spec, lanes: int, max_context: int, kv_tokens: int | None, prefix_cache: bool) -> KVGeometry:
    """The KV geometry the cuda engine would have for this model (runtime/cuda/kv_cache.py plan_kv, at the default
    build's step rows): `lanes` lanes, pages of KV_PAGE positions for the full-attention layers (`kv_tokens` of
    them, default every lane's whole context), and a ring per sliding layer shorter than the context (the
    drafter's too)."""
    t = spec.target
    windows = [t.layer_window(l) for l in range(t.num_hidden_layers)]
    paged = any(w is None for w in windows)
    if spec.drafter is not None:
        windows += [spec.drafter.layer_window(l) for l in range(spec.drafter.num_hidden_layers)]
    rings = tuple(
        (w, ring_slots(w, MAX_STEP_TOKENS))
        for w in windows
        if w is not None and ring_slots(w, MAX_STEP_TOKENS) < max_context
    )
    tokens = lanes * max_context if kv_tokens is None else kv_tokens
    return KVGeometry(lanes, max_context, -(-tokens // KV_PAGE) if paged else 0, rings, KV_PAGE, prefix_cache)


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
                raise SequenceFailed(
                    self.seq.request_id,
                    f"a processed logit is not finite (its penalties or logit_bias overflowed) at position {position}",
                    request_fault=True,
                )
        token = sample(z, params, position)
        if matcher is not None:
            matcher.accept(token)
        if self.logprobs is not None:
            self.logprobs.append(token_logprob(row, token, params.logprobs))
        self.picked.append(token)
        return token
