"""Runtime stage: `SpecDecoder`, CudaRunner's DFlash stepping of a speculative sequence that decodes alone (each
step launched before the one before it is read) and the catch-up prefill that brings a lane's drafter context
current after plain steps."""

from __future__ import annotations

from typing import Callable

from ...model_spec.conventions import accepted_count
from .dflash import SpecLaunch
from .engine import Engine
from .kv_pages import Lane
from ...model_spec.conventions import VERIFY_ROWS

# a speculative sequence left behind by plain steps catches up when it may still decode a 16th of the positions
CATCH_UP_RATIO = 16


class SpecDecoder:
    """DFlash steps for CudaRunner. Each lane holds its own sequence's drafter context (runtime/cuda/kv_cache.py)
    and `Lane.draft_upto` says how far it is current; a plain or batched step leaves it behind, and once the
    sequence decodes alone again one tap prefill of the positions it missed (`catch_up`) brings it back, when its
    cost is small beside the tokens still to come. `grow(lane, end)` maps the pages of positions 0..end-1."""

    def __init__(self, engine: Engine, grow: Callable[[int, int], None], max_context: int) -> None:
        self.engine, self.grow, self.max_context = engine, grow, max_context
        self.caught_up_tokens = 0  # positions whose drafter context a catch-up prefill restored

    def ready(self, seq, lane: Lane, i: int, pos: int) -> bool:
        """Whether `seq` (in lane i) takes a DFlash step at `pos`: it is speculative and unprocessed (a processed
        sequence decodes without speculation), a verify block fits the context, and the drafter context covers
        positions 0..pos-1, at once or after `catch_up`."""
        return (seq.speculative and pos + VERIFY_ROWS <= self.max_context and not seq.sampling.extended
                and self.catch_up(seq, lane, i, pos))

    def catch_up(self, seq, lane: Lane, i: int, pos: int) -> bool:
        """Whether lane i's drafter context covers positions 0..pos-1, so that a speculative step can run: at once,
        or after one tap prefill of the positions that plain and batched steps left it behind by. That runs when
        its cost is small beside the tokens the sequence may still decode (a prefill position costs about a 16th of
        what a speculative step saves a token: H200, 0.04 vs ~1 ms) and the lane's rings still hold the keys before
        them (else the sequence goes on with plain steps). It writes the target's K/V of those positions again (the
        values a prompt's prefill gives) and never touches a page shared with another sequence: the positions
        were decoded, so their pages are the sequence's own until it finishes. (out_ids[0] then holds the
        prefill's token, which the sequence already has.)"""
        missing = pos - lane.draft_upto
        if missing <= 0:
            return True
        if missing > CATCH_UP_RATIO * seq.room(self.max_context) or lane.draft_upto == 0 or \
                not self.engine.kv.plan.prefix_intact(lane.draft_upto, lane.last_written):
            return False
        if any(s.offset < pos and s.end > lane.draft_upto for s in seq.images):
            return False  # (a prompt's images run in its own tap prefill; decoded positions hold none)
        self.engine.prefill(seq.tokens[:pos], seq.sampling.greedy, taps=True, begin=lane.draft_upto, lane=i)
        lane.drafted(lane.draft_upto, pos, taps=True)
        self.caught_up_tokens += missing
        return True

    def step(self, seq, lane: Lane, i: int, pos: int, cur: SpecLaunch | None, launch_ahead: bool,
             launched=None) -> tuple[list[int], tuple[int, SpecLaunch] | None]:
        """A DFlash step of `seq` at `pos` (`cur`: launched ahead by the step before, else launched now): its
        committed tokens, and (position, launch) of the next step when `launch_ahead` launched it before this
        one's tokens were read, at the block the device's acceptance picks (draft.accept), unless this step surely
        ends the request or that block may not fit the context. out_ids[0] then holds a verify row."""
        room, greedy = seq.room(self.max_context), seq.sampling.greedy
        most, k = 1 + (seq.sampling.draft_tokens or VERIFY_ROWS - 1), self.engine.emulate_acceptance
        dflash = self.engine.dflash
        if cur is None:
            self.grow(i, pos + VERIFY_ROWS)
            cur = dflash.launch(pos, seq.output[-1], greedy, lane=i, most=most, emulate=k)
        lane.last_written = max(lane.last_written, pos + VERIFY_ROWS - 1)
        nxt = None
        # (a draft_hook needs the block's start on the host: known ahead only under emulated acceptance, the bench's)
        hook_start = None if k is None else pos + accepted_count([], [0] * VERIFY_ROWS, most, k)  # (needs no tokens)
        if launch_ahead and (self.engine.draft_hook is None or hook_start is not None) and room >= 2 \
                and pos + 2 * VERIFY_ROWS <= self.max_context:
            self.grow(i, pos + 2 * VERIFY_ROWS)  # (its block starts at pos + 1 .. pos + VERIFY_ROWS)
            nxt = dflash.launch(None, greedy=greedy, hook_start=hook_start)
            lane.last_written = max(lane.last_written, pos + 2 * VERIFY_ROWS - 1)
        if launched is not None:
            launched()
        drafts, target, accepted = dflash.wait(cur)
        # (k: bench --emulate-acceptance commits K drafts + 1 whatever the drafter said; the request may cap drafts)
        new = target[:accepted_count(drafts, target, most, k)]
        # rows 0..len(new)-1 held committed tokens: their drafter context is current (the rest is rewritten)
        lane.drafted(pos, pos + len(new), taps=True)
        # (the device's count equals len(new) unless a kernel is wrong: then the next step finds no match and waits)
        return new[:room], None if nxt is None else (pos + accepted, nxt)
