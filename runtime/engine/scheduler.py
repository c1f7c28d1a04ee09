"""Runtime stage (engine core): the `Scheduler` (nano-vllm's shape) over the one KV manager.

A sequence's K/V covers `num_cached` of its tokens. While it decodes, that is every token but the last sampled
one, which is the next step's input. Each step the scheduler first gives every running decoder its step (one
token, or a verify block when speculative; the draft policy, runtime/engine/speculation.py, sets its drafts) and
the KV for it, then fills the rest of the per-step token budget with prefill chunks: of sequences already
admitted, then of new ones (FCFS), each admitted only when the KV manager gives it a lane and the pages of its
prompt (less what its prefix cache hit shares); in a step with decoders, a chunk the runner runs in pieces there
(ModelRunner.chunks_in_pieces) goes alone. When a decoder needs
a page and none is free, the most recently admitted other sequence is preempted by recompute: its KV is freed and
it re-queues at the front, keeping its output. On readmission it prefills its prompt plus all its output but the
last token, and continues, with the tokens it would have produced anyway (seeded sampling depends only on seed
and position). The schedule carries the KV manager's instructions for the device (page-table rows, lane copies).
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from dataclasses import dataclass, replace
from typing import Callable, NamedTuple

from ..backend import span_floor
from .kv_manager import KVManager, KVOp
from .sequence import Sequence, Status
from .speculation import DraftPlanner


@dataclass(frozen=True)
class Prefill:
    seq: Sequence
    start: int
    end: int
    sample: bool  # the chunk ends the prompt of a sequence with no output yet: sample its first token
    admitted: bool = False  # the sequence's first chunk since this step admitted it (KVManager.rebind)


class Schedule(NamedTuple):  # a tuple: built every step, and cheap to build
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Sequence, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    exhausted: tuple[Sequence, ...] = ()  # alone, it outgrew the whole KV cache: it ends at its length
    kv_ops: tuple[KVOp, ...] = ()  # the KV manager's instructions, for the runner to execute before the step


class KVExhausted(Exception):
    """A single sequence needs more KV than the whole cache has."""


class Scheduler:
    """FCFS admission under the KV manager and `max_num_seqs`; chunked prefill under `max_step_tokens` per step (a
    step's first chunk may be cut by the budget, later ones only whole, and none beside decodes next to a chunk
    that runs in pieces: _more_chunks)."""

    def __init__(
        self,
        kv: KVManager,
        max_num_seqs: int,
        max_step_tokens: int,
        max_context: int,
        verify_block: int = 1,
        prefill_chunk: int | None = None,
        lookahead: int = 0,
        media_ready: Callable[[Sequence, bool, list[Sequence]], bool] = lambda seq, wait, queued: True,
        drafts: DraftPlanner | None = None,
        in_pieces: Callable[[Sequence], bool] = lambda seq: False,
    ) -> None:
        self.kv, self.max_num_seqs, self.max_step_tokens = kv, max_num_seqs, max_step_tokens
        self.max_context, self.verify_block = max_context, verify_block
        # steps a runner launches before the step before them is read (ModelRunner.lookahead)
        self.lookahead = lookahead
        self.prefill_chunk = prefill_chunk  # None: a runner that prefills a whole prompt in one call
        self.media_ready = media_ready  # ModelRunner.media_ready: its images' rows at hand without a wait
        self.drafts = drafts  # the draft policy: each decoder's drafts this step (None: the most it may propose)
        # whether the runner cuts a long chunk of the sequence into pieces of a few layers beside decoders
        # (ModelRunner.chunks_in_pieces): a step with decoders and such a chunk takes no other chunk, which would
        # add its own whole forward to the one piece the decoders wait for
        self.in_pieces = in_pieces
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        if not self.kv.fits(len(seq.prompt) + 1):
            g = self.kv.geometry
            raise KVExhausted(
                f"the prompt has {len(seq.prompt)} tokens and needs "
                f"{g.pages_for(len(seq.prompt) + 1)} KV blocks of {g.page} tokens, but the whole KV "
                f"cache holds {self.kv.total_pages} blocks ({self.kv.total_pages * g.page} tokens)"
            )
        self.waiting.append(seq)

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step_tokens(self, seq: Sequence) -> int:
        """K/V positions a decode step of `seq` may write: its verify block when speculative, else one; as many
        again for each step the runner launches before this one is read (`lookahead`)."""
        return (self.verify_block if seq.speculative else 1) * (1 + self.lookahead)

    def _decode_tokens(self, seq: Sequence) -> int:
        return min(seq.num_cached + self.step_tokens(seq), self.max_context)

    def schedule(self) -> Schedule:
        if not self.waiting and all(
            s.num_cached >= s.prefill_target and self.kv.granted(s) >= self._decode_tokens(s) for s in self.running
        ):
            return Schedule(decodes=self._planned(self.running))  # the steady state: everyone decodes in its pages
        budget = self.max_step_tokens
        decodes: list[Sequence] = []
        preempted: list[Sequence] = []
        exhausted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_cached < seq.prefill_target:  # preempted / prefilling
                continue
            tokens = self._decode_tokens(seq)
            while not self.kv.grow(seq, tokens):
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim in decodes:  # it was given this step already: it gives its budget back
                    decodes.remove(victim)
                    budget += 1
            if self.kv.granted(seq) < tokens:
                exhausted.append(seq)
                continue
            decodes.append(seq)
            budget -= 1
        prefills: list[Prefill] = []
        for seq in [s for s in self.running if s.num_cached < s.prefill_target]:  # admitted, prompt not done
            if budget <= 0 or (prefills and not self._more_chunks(seq, budget, decodes, prefills)):
                break
            chunk = self._chunk(seq, budget)
            if chunk is not None:
                prefills.append(chunk)
                budget -= chunk.end - chunk.start
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if prefills and not self._more_chunks(seq, budget, decodes, prefills):
                if seq.images and decodes:  # (its encode still starts, or goes on)
                    self.media_ready(seq, False, self._queued_images())
                break
            # its encode runs beside the steps (FCFS: the queue waits for it, the running ones do not); a step with
            # nothing else to run waits for it
            if seq.images and not self.media_ready(seq, not (decodes or prefills), self._queued_images()):
                break
            # more sequences want the engine than a batched verify step could give one draft each: this one would
            # not draft until most of them are done, and its prompt's drafter context (the DFlash taps) and its
            # verify blocks' KV grants would be pure cost, so it decodes plain to its end
            crowded = seq.speculative and self.drafts is not None and self.drafts.crowded(self.unfinished)
            seq.speculative = seq.speculative and not crowded
            cached = self.kv.admit(
                seq, seq.reuse_limit(), min(seq.prefill_target + self.step_tokens(seq), self.max_context)
            )
            if cached is None:
                seq.speculative = seq.speculative or crowded  # (decided again when it is admitted)
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.admitted(cached)
            self.running.append(seq)
            chunk = self._chunk(seq, budget)
            if chunk is not None:
                prefills.append(replace(chunk, admitted=True))
                budget -= chunk.end - chunk.start
        return Schedule(tuple(prefills), self._planned(decodes), tuple(preempted), tuple(exhausted), self.kv.take_ops())

    def _queued_images(self) -> list[Sequence]:
        """The sequences with images waiting behind the head of the queue (the next max_num_seqs): an encode for
        the head may take theirs along."""
        return [s for s in islice(self.waiting, 1, 1 + self.max_num_seqs) if s.images]

    def _planned(self, decodes: list[Sequence]) -> tuple[Sequence, ...]:
        """The decoders, each with its drafts for this step set (Sequence.drafts)."""
        if self.drafts is not None:
            for seq in decodes:
                self.drafts.plan(seq, len(decodes))
        return tuple(decodes)

    def _more_chunks(self, seq: Sequence, budget: int, decodes: list[Sequence], prefills: list[Prefill]) -> bool:
        """Whether a step that has `prefills` takes `seq`'s next chunk too: when the budget holds it whole
        (_fits_whole), and beside decoders only if neither it nor a chunk the step has runs in pieces there."""
        if decodes and (self.in_pieces(seq) or any(self.in_pieces(p.seq) for p in prefills)):
            return False
        return self._fits_whole(seq, budget)

    def _fits_whole(self, seq: Sequence, budget: int) -> bool:
        """Whether `budget` holds the sequence's next chunk whole (the rest of its prompt, or a full chunk). A
        chunked runner runs each chunk as a forward of its own, which costs about as much for a few rows as for a
        full chunk (all its launches; the grouped MoE reads every expert its rows touch), so a step's chunks after
        its first are taken only whole: a step's leftover budget no longer starts the next prompt with a sliver."""
        if self.prefill_chunk is None:
            return True
        return budget >= min(seq.prefill_target - seq.num_cached, self.prefill_chunk)

    def _chunk(self, seq: Sequence, budget: int) -> Prefill | None:
        start, target = seq.num_cached, seq.prefill_target
        if start >= target:
            return None
        if self.prefill_chunk is None:  # whole-prompt runner: only when the budget allows it all at once
            if target - start > budget and (self.running and self.running[0] is not seq):
                return None
            end = target
        else:
            end = min(target, start + min(budget, self.prefill_chunk))
        if seq.images and end < target:  # never end inside an image span: stop before it, or take it whole
            floor = span_floor(end, seq.images)
            end = floor if floor > start else next(s.end for s in seq.images if s.offset < end < s.end)
        return Prefill(seq, start, end, sample=end == target and not seq.output)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq, finished=False)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str, cacheable: bool = True) -> None:
        """`seq` is done; `cacheable`: its K/V may serve later sequences (not after a failure: it may be half
        written)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release(seq, finished=cacheable)
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.perf_counter()
