"""Runtime stage (cuda backend): packs a step's logits processing for the lm_process kernel — one LogitRow per row,
the sparse token-count and logit_bias lists, and the grammar masks — as NumPy arrays in the device layouts.

The dtypes mirror templates/include/thorgen/logits.cuh (its static_asserts pin the layouts; tests/test_logits_kernels.py
checks that both sides agree). Per step the runner uploads `rows` [T] (48 B each), `counts` (8 B per distinct
token of prompt + output), `biases` (16 B per logit_bias entry) and `masks` (V / 8 bytes per grammar row).
`TokenCounts` keeps a sequence's counts incrementally, so a step costs O(distinct tokens) to pack, not a sort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from ..backend import SamplingParams, SequenceFailed

LOGIT_ROW = np.dtype(
    [
        ("repetition_penalty", "<f8"),
        ("frequency_penalty", "<f8"),
        ("presence_penalty", "<f8"),
        ("counts_offset", "<i4"),
        ("n_counts", "<i4"),
        ("bias_offset", "<i4"),
        ("n_bias", "<i4"),
        ("mask_row", "<i4"),
        ("pad", "<i4"),
    ]
)  # thorgen::LogitRow, 48 bytes
TOKEN_COUNT = np.dtype([("token", "<i4"), ("count", "<i4")])  # thorgen::TokenCount, 8 bytes
TOKEN_BIAS = np.dtype([("token", "<i4"), ("pad", "<i4"), ("bias", "<f8")])  # thorgen::TokenBias, 16 bytes
# lm_process status bits (per row)
STATUS_NONE_ALLOWED = 1  # the mask allows no token: a grammar bug (the pick's id is meaningless)
STATUS_NON_FINITE = 2  # a processed value is +inf or NaN (e.g. a tiny repetition_penalty overflowed)


class TokenCounts:
    """A sequence's distinct prompt + output token ids (sorted) with each one's count in the output."""

    def __init__(self, prompt: list[int], vocab: int) -> None:
        self.vocab = vocab
        ids = np.asarray(prompt, dtype=np.int64)
        self.ids = np.unique(ids[(ids >= 0) & (ids < vocab)]).astype(np.int32)
        self.counts = np.zeros(self.ids.shape[0], np.int32)

    def add(self, token: int) -> None:
        """One more output token."""
        if not 0 <= token < self.vocab:
            return
        i = int(np.searchsorted(self.ids, token))
        if i < self.ids.shape[0] and self.ids[i] == token:
            self.counts[i] += 1
        else:
            self.ids = np.insert(self.ids, i, np.int32(token))
            self.counts = np.insert(self.counts, i, np.int32(1))

    def plus(self, tokens: tuple[int, ...]) -> TokenCounts:
        """A copy with `tokens` counted as more output (a verify row's drafts before it)."""
        out = TokenCounts.__new__(TokenCounts)
        out.vocab, out.ids, out.counts = self.vocab, self.ids.copy(), self.counts.copy()
        for t in tokens:
            out.add(t)
        return out

    @classmethod
    def of(cls, prompt: list[int], output: list[int], vocab: int) -> TokenCounts:
        tc = cls(prompt, vocab)
        for t in output:
            tc.add(t)
        return tc

    def entries(self) -> np.ndarray:
        out = np.empty(self.ids.shape[0], TOKEN_COUNT)
        out["token"], out["count"] = self.ids, self.counts
        return out


def mask_words(allowed: np.ndarray, vocab: int) -> np.ndarray:
    """The [vocab / 32] u32 mask row (bit v % 32 of word v / 32: token v allowed) from a bool mask [>= vocab]
    (runtime.text.grammar.Matcher.allowed) or llguidance's u32 bitmask words; ids past either are disallowed."""
    words = np.zeros(vocab // 32, np.uint32)
    allowed = np.asarray(allowed)
    if allowed.dtype == np.bool_:
        bits = np.zeros(vocab, bool)
        n = min(vocab, allowed.shape[0])
        bits[:n] = allowed[:n]
        words[:] = np.packbits(bits, bitorder="little").view("<u4")
    else:
        src = allowed.astype("<u4", copy=False).ravel()
        n = min(words.shape[0], src.shape[0])
        words[:n] = src[:n]
    return words


class VerifyRow(NamedTuple):
    """A row of a batched verify whose sequence's logits are processed: the sequence, its drafts before the row
    (taken as generated: its penalties count them) and the row's mask (runtime/cuda/spec_grammar.py walk)."""

    seq: Any
    before: tuple[int, ...]
    mask: Any


@dataclass
class LogitsBatch:
    """One step's upload: rows [T] LOGIT_ROW, counts [n] TOKEN_COUNT, biases [m] TOKEN_BIAS, masks [k, V/32] u32."""

    rows: np.ndarray
    counts: np.ndarray
    biases: np.ndarray
    masks: np.ndarray


def plain_row() -> np.ndarray:
    """A row the kernel only softcaps (r = 1, no entries, no mask)."""
    row = np.zeros((), LOGIT_ROW)
    row["repetition_penalty"], row["mask_row"] = 1.0, -1
    return row


def pack(rows: list[tuple[SamplingParams, TokenCounts | None, np.ndarray | None] | None], vocab: int) -> LogitsBatch:
    """The batch for rows 0..T-1: each (params, the sequence's TokenCounts, the grammar mask or None), or None
    for a row without processing. TokenCounts may be None when no penalty is on."""
    if vocab % 32:
        raise ValueError(f"vocab {vocab} must be a multiple of 32")
    out = np.empty(len(rows), LOGIT_ROW)
    counts, biases, masks = [], [], []
    n_counts = n_bias = 0
    for i, item in enumerate(rows):
        out[i] = plain_row()
        if item is None:
            continue
        params, tc, mask = item
        r = out[i]
        r["repetition_penalty"] = params.repetition_penalty
        r["frequency_penalty"], r["presence_penalty"] = params.frequency_penalty, params.presence_penalty
        if params.repetition_penalty != 1.0 or params.frequency_penalty or params.presence_penalty:
            if tc is None:
                raise ValueError(f"row {i}: penalties need the sequence's TokenCounts")
            e = tc.entries()
            if params.repetition_penalty == 1.0:
                e = e[e["count"] > 0]  # prompt-only tokens matter to the repetition penalty alone
            r["counts_offset"], r["n_counts"] = n_counts, e.shape[0]
            counts.append(e)
            n_counts += e.shape[0]
        bias = [(t, b) for t, b in params.logit_bias if 0 <= t < vocab]  # sorted by id (SamplingParams)
        if bias:
            e = np.zeros(len(bias), TOKEN_BIAS)
            e["token"], e["bias"] = [t for t, _ in bias], [b for _, b in bias]
            r["bias_offset"], r["n_bias"] = n_bias, e.shape[0]
            biases.append(e)
            n_bias += e.shape[0]
        if mask is not None:
            r["mask_row"] = len(masks)
            masks.append(mask_words(mask, vocab))
    return LogitsBatch(
        out,
        np.concatenate(counts) if counts else np.zeros(0, TOKEN_COUNT),
        np.concatenate(biases) if biases else np.zeros(0, TOKEN_BIAS),
        np.stack(masks) if masks else np.zeros((0, vocab // 32), np.uint32),
    )


def logprob_entry(ids: np.ndarray, lps: np.ndarray, chosen: np.ndarray, row: int, top: int) -> tuple:
    """Row `row` of Engine.read_logits' arrays as a TokenLogprob: (its token's logprob, the `top` best
    (id, logprob))."""
    return float(chosen[row]), tuple((int(ids[row, j]), float(lps[row, j])) for j in range(top))


class RequestLogits:
    """A runner's logits processing: stages a step's rows for the engine (`stage`), and after the step checks the
    rows' status and feeds each request's grammar, token counts and logprobs (`picked`), through the engine's
    `set_logits` and `read_logits` (runtime/cuda/engine.py)."""

    def __init__(
        self,
        set_logits: Callable[[LogitsBatch], None],
        read_logits: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
        vocab: int,
    ) -> None:
        self.set_logits, self.read_logits, self.vocab = set_logits, read_logits, vocab
        self._counts: dict[str, TokenCounts] = {}  # prompt + output token counts of requests with penalties

    def stage(self, seqs: list) -> bool:
        """Upload the step's logits processing when any of `seqs` (one a row: a sequence, a VerifyRow, or None: a
        row without processing, a batched verify's row of a sequence that takes none) needs it (else the plain head
        runs): the penalties' token counts, logit_bias and the grammar's allowed-token mask, computed now on the
        host for a sequence (a VerifyRow brings its own). A sequence whose grammar fails raises its SequenceFailed
        before anything is uploaded."""
        if not any(_owner(s) is not None and _owner(s).sampling.extended for s in seqs):
            return False
        rows = []
        for s in seqs:
            seq = _owner(s)
            if seq is None or not seq.sampling.processed:
                rows.append(None)
                continue
            sp = seq.sampling
            counts = None
            if sp.repetition_penalty != 1.0 or sp.frequency_penalty or sp.presence_penalty:
                counts = self._counts.get(seq.request_id)
                if counts is None:
                    counts = self._counts[seq.request_id] = TokenCounts.of(seq.prompt, seq.output, self.vocab)
                if isinstance(s, VerifyRow) and s.before:
                    counts = counts.plus(s.before)
            rows.append((sp, counts, s.mask if isinstance(s, VerifyRow) else _allowed(seq, self.vocab)))
        self.set_logits(pack(rows, self.vocab))
        return True

    def picked(self, seqs: list, tokens: list[int]) -> dict[str, SequenceFailed]:
        """After a staged step (`seqs` as staged, one token a row): `verified` with each sequence's one row."""
        return self.verified(len(seqs), [(s, r, [t]) for r, (s, t) in enumerate(zip(seqs, tokens)) if s is not None])

    def verified(self, rows: int, runs: list[tuple[Any, int, list[int]]]) -> dict[str, SequenceFailed]:
        """After a staged step of `rows` rows, per (sequence, its first row, the tokens it commits from that row
        on): feed its grammar and counts the tokens and keep their logprobs; a sequence that has a row whose status
        is bad (a fully masked row, a non-finite processed logit) or whose grammar refuses the token comes back as
        its request's SequenceFailed (its tokens are not committed; the other sequences' stand)."""
        status, ids, lps, chosen = self.read_logits(rows)
        failed = {}
        for s, r0, tokens in runs:
            error = self._feed(s, r0, tokens, status, ids, lps, chosen)
            if error is not None:
                failed[s.request_id] = error
        return failed

    def _feed(self, s, r0: int, tokens: list[int], status, ids, lps, chosen) -> SequenceFailed | None:
        entries = []
        for j, tok in enumerate(tokens):
            r = r0 + j
            if status[r]:
                overflow = not status[r] & STATUS_NONE_ALLOWED
                what = (
                    "a processed logit is not finite (its penalties or logit_bias overflowed)"
                    if overflow
                    else "the grammar allows no token"
                )
                return SequenceFailed(s.request_id, f"{what} at position {s.num_tokens + j}", request_fault=overflow)
            if s.matcher is not None:
                try:
                    s.matcher.accept(tok)
                except Exception as exc:
                    return SequenceFailed(s.request_id, f"the grammar failed: {type(exc).__name__}: {exc}")
            if s.request_id in self._counts:
                self._counts[s.request_id].add(tok)
            if s.sampling.logprobs is not None:
                entries.append(logprob_entry(ids, lps, chosen, r, s.sampling.logprobs))
        if s.sampling.logprobs is not None:
            s.step_logprobs = entries
        return None

    def forget(self, request_id: str) -> None:
        self._counts.pop(request_id, None)


def _owner(row: Any) -> Any:
    """The sequence of a staged row (a Sequence, a VerifyRow or None)."""
    return row.seq if isinstance(row, VerifyRow) else row


def _allowed(seq, vocab: int) -> np.ndarray:
    """The sequence's allowed-token mask (grammar and min_tokens; None for all); its SequenceFailed when the grammar
    fails."""
    try:
        return seq.allowed(vocab)
    except Exception as exc:
        raise SequenceFailed(seq.request_id, f"the grammar failed: {type(exc).__name__}: {exc}") from exc
