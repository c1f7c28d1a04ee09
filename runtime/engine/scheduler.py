"""Runtime stage: the engine core's `Sequence`, its KV-block accounting and the `Scheduler` (nano-vllm's shape).

A sequence's K/V covers `num_cached` of its tokens. While it decodes, that is every token but the last sampled
one, which is the next step's input. Each step the scheduler first gives every running decoder its step (one
token, or a verify block when speculative), then fills the rest of the per-step token budget with prefill
chunks: of sequences already admitted, then of new ones (FCFS), each admitted only when its KV blocks fit.
When a decoder needs a block and none is free, the most recently admitted other sequence is preempted by
recompute: its blocks are freed and it re-queues at the front, keeping its output. On readmission it prefills
its prompt plus all its output but the last token, and continues, with the tokens it would have produced anyway
(seeded sampling depends only on seed and position).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple
from typing import Any

from ...model_spec.conventions import KV_PAGE
from ..backend import ImageSpan, SamplingParams, check_token_ids, key_tokens, span_floor


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request inside the engine core. `output` grows as steps commit tokens."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()
    speculative: bool = False
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0  # tokens whose K/V the runner holds for this sequence
    blocks: int = 0  # KV blocks charged to it
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from a prefix cache (first admission)
    accepted_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    preemptions: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    admitted_at: float | None = None
    matcher: Any = None  # its grammar's runtime.text.grammar.Matcher (made by prepare(), in the runner's check)
    step_logprobs: list | None = None  # the runner's TokenLogprob per token of the step just run
    # with sampling.prompt_logprobs, until the first token: None for token 0, then the runner's TokenLogprob of
    # each prompt token its prefill chunks predict (tokens start+1 .. end-1 of a chunk, and `end` inside the prompt)
    prompt_logprobs: list | None = None
    images: tuple[ImageSpan, ...] = ()  # its prompt's image spans (kept through preemption: recompute re-encodes)
    _keys: list[int] | None = None

    @property
    def prompt_keys(self) -> list[int]:
        """The prompt as prefix caches key it: image placeholders as ids of (image hash, index) (key_tokens)."""
        if self._keys is None:
            self._keys = key_tokens(self.prompt, self.images) if self.images else self.prompt
        return self._keys

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:  # len(tokens) without building the list (the decode path asks every step)
        return len(self.prompt) + len(self.output)

    @property
    def prefill_target(self) -> int:
        """Tokens the K/V must cover before decoding: all of them, except a resumed sequence's last output."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    def prepare(self, vocab: int) -> None:
        """What every runner's check needs: BackendError for prompt or logit_bias ids outside the vocabulary, and
        the grammar's matcher made (once)."""
        check_token_ids(self.prompt, vocab)
        check_token_ids([t for t, _ in self.sampling.logit_bias], vocab, "logit_bias")
        if self.sampling.grammar is not None and self.matcher is None:
            self.matcher = self.sampling.grammar.matcher()

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill must also score the prompt tokens (asked for, and not yet delivered)."""
        return self.prompt_logprobs is not None and not self.output

    def scored_upto(self, start: int, end: int) -> int:
        """The prompt tokens a prefill chunk [start, end) predicts are start+1 .. this - 1 (none past the prompt)."""
        return min(end, len(self.prompt) - 1) + 1

    def room(self, max_context: int) -> int:
        """Tokens it may still commit: bounded by max_tokens and by the context."""
        n = len(self.output)
        return min(self.max_tokens - n, max_context - len(self.prompt) - n)


@dataclass(frozen=True)
class Prefill:
    seq: Sequence
    start: int
    end: int
    sample: bool  # the chunk ends the prompt of a sequence with no output yet: sample its first token


class Schedule(NamedTuple):  # a tuple: built every step, and cheap to build
    prefills: tuple[Prefill, ...] = ()
    decodes: tuple[Sequence, ...] = ()
    preempted: tuple[Sequence, ...] = ()
    exhausted: tuple[Sequence, ...] = ()  # alone, it outgrew the whole KV cache: it ends at its length


class KVExhausted(Exception):
    """A single sequence needs more KV blocks than the whole cache has."""


@dataclass
class BlockPool:
    """Counts KV blocks of `block_size` tokens; `num_blocks` of them exist (the cuda runner's pages: KV_PAGE)."""

    num_blocks: int
    block_size: int = KV_PAGE
    used: int = 0

    @property
    def free(self) -> int:
        return self.num_blocks - self.used

    def needed(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, seq: Sequence, tokens: int) -> bool:
        """Charge `seq` enough blocks to hold `tokens` K/V entries; False (nothing charged) if they are not free."""
        extra = self.needed(tokens) - seq.blocks
        if extra <= 0:
            return True
        if extra > self.free:
            return False
        self.used += extra
        seq.blocks += extra
        return True

    def release(self, seq: Sequence) -> None:
        self.used -= seq.blocks
        seq.blocks = 0


class Scheduler:
    """FCFS admission under a KV budget and `max_num_seqs`; chunked prefill under `max_step_tokens` per step (a
    step's first chunk may be cut by the budget, later ones only whole: _fits_whole)."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_step_tokens: int, max_context: int,
                 verify_block: int = 1, prefill_chunk: int | None = None, lookahead: int = 0) -> None:
        self.pool, self.max_num_seqs, self.max_step_tokens = pool, max_num_seqs, max_step_tokens
        self.max_context, self.verify_block = max_context, verify_block
        # K/V positions a runner may write past a step's own before the step's tokens are known (ModelRunner)
        self.lookahead = lookahead
        self.prefill_chunk = prefill_chunk  # None: a runner that prefills a whole prompt in one call
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order

    def add(self, seq: Sequence) -> None:
        need = self.pool.needed(len(seq.prompt) + 1)
        if need > self.pool.num_blocks:
            raise KVExhausted(f"the prompt has {len(seq.prompt)} tokens and needs {need} KV blocks of "
                              f"{self.pool.block_size} tokens, but the whole KV cache holds {self.pool.num_blocks} "
                              f"blocks ({self.pool.num_blocks * self.pool.block_size} tokens)")
        self.waiting.append(seq)

    @property
    def unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def step_tokens(self, seq: Sequence) -> int:
        """K/V positions a decode step of `seq` may write: its verify block when speculative, else one; plus the
        runner's lookahead."""
        return (self.verify_block if seq.speculative else 1) + self.lookahead

    def schedule(self) -> Schedule:
        if not self.waiting and all(s.num_cached >= s.prefill_target and s.blocks * self.pool.block_size >= min(
                s.num_cached + self.step_tokens(s), self.max_context) for s in self.running):
            return Schedule(decodes=tuple(self.running))  # the steady state: everyone decodes in blocks it has
        budget = self.max_step_tokens
        decodes: list[Sequence] = []
        preempted: list[Sequence] = []
        exhausted: list[Sequence] = []
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or seq.num_cached < seq.prefill_target:  # preempted / prefilling
                continue
            tokens = min(seq.num_cached + self.step_tokens(seq), self.max_context)
            while not self.pool.grow(seq, tokens):
                victim = next((s for s in reversed(self.running) if s is not seq), None)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim in decodes:  # it was given this step already: it gives its budget back
                    decodes.remove(victim)
                    budget += 1
            if seq.blocks < self.pool.needed(tokens):
                exhausted.append(seq)
                continue
            decodes.append(seq)
            budget -= 1
        prefills: list[Prefill] = []
        for seq in [s for s in self.running if s.num_cached < s.prefill_target]:  # admitted, prompt not done
            if budget <= 0 or (prefills and not self._fits_whole(seq, budget)):
                break
            chunk = self._chunk(seq, budget)
            if chunk is not None:
                prefills.append(chunk)
                budget -= chunk.end - chunk.start
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if prefills and not self._fits_whole(seq, budget):
                break
            if not self.pool.grow(seq, min(seq.prefill_target + self.step_tokens(seq), self.max_context)):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status, seq.admitted_at = Status.RUNNING, time.perf_counter()
            self.running.append(seq)
            chunk = self._chunk(seq, budget)
            if chunk is not None:
                prefills.append(chunk)
                budget -= chunk.end - chunk.start
        return Schedule(tuple(prefills), tuple(decodes), tuple(preempted), tuple(exhausted))

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
        self.pool.release(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.pool.release(seq)
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.perf_counter()
