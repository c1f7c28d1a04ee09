"""Runtime stage (cuda backend): the grammar walk of a sequence whose logits are processed in a batched verify, its
drafts cut where its grammar refuses one and each of its rows' mask as a plain step at that row's position would
have it (`walk`).

A batched verify (runtime/cuda/spec_batch.py) processes every row of such a sequence: row j verifies the token after
the input token and drafts 1..j, so it gets the mask of the grammar after those drafts (and, in RequestLogits, the
penalties' counts with them taken as generated), exactly what plain decoding gives that position whenever the drafts
before it are accepted, which is the only case where its token is committed. The walk runs on a fork of the
sequence's matcher: the matcher itself takes only the committed tokens, after the step (RequestLogits.verified).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..backend import SequenceFailed
from ..engine.sequence import Sequence


class MaskedRun(NamedTuple):
    """A sequence's rows in a batched verify: the drafts it verifies (rows 1..k) and the mask of each of its rows
    0..k (None: every token)."""

    drafts: list[int]
    masks: list[Any]


def masked(seq: Sequence) -> bool:
    """Whether `seq`'s next tokens take logits processing (its drafts are walked on the host and every one of its
    rows processed); otherwise its rows run as they are, cut where a grammar that leaves them free takes over
    (dflash.grammar_free_run)."""
    return seq.sampling.extended and not seq.unmasked()


def walk(seq: Sequence, drafts: list[int], vocab: int) -> MaskedRun:
    """`seq`'s drafts up to the first one its row's mask refuses (its grammar, or a stop id before min_tokens) and
    before any stop id (the row after one would verify a token past the end: the engine core drops it, and a
    grammar's state after its end has no mask to give), with the masks of its rows; its SequenceFailed when its
    grammar fails on its own state (as a plain step's would)."""
    masks = [_mask(seq, vocab, 0, None)]
    fork = None
    kept: list[int] = []
    for j, token in enumerate(drafts):
        mask = masks[-1]
        if token in seq.stop_ids or not 0 <= token < vocab or (mask is not None and not mask[token]):
            break
        if seq.matcher is not None:
            try:
                fork = seq.matcher.fork() if fork is None else fork
                fork.accept(token)
                masks.append(seq.allowed(vocab, j + 1, fork))
            except Exception:  # (a grammar that fails past its committed state: plain decoding meets it there)
                break
        else:
            masks.append(_mask(seq, vocab, j + 1, None))
        kept.append(int(token))
    return MaskedRun(kept, masks[: len(kept) + 1])


def _mask(seq: Sequence, vocab: int, picked: int, matcher: Any) -> Any:
    try:
        return seq.allowed(vocab, picked, matcher)
    except Exception as exc:
        raise SequenceFailed(seq.request_id, f"the grammar failed: {type(exc).__name__}: {exc}") from exc


__all__ = ["MaskedRun", "masked", "walk"]
