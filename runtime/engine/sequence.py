"""Runtime stage (engine core): a request inside the engine, `Sequence`: its tokens, sampling, progress and what
the scheduler, the KV manager and the runners record on it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import ImageSpan, SamplingParams, TokenLogprob, check_token_ids, key_tokens


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
    lane: int | None = None  # its KV lane while it runs (the KV manager's)
    cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from a prefix cache (first admission)
    accepted_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    preemptions: int = 0
    arrived: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    admitted_at: float | None = None
    matcher: Any = None  # its grammar's runtime.text.grammar.Matcher (made by prepare(), in the runner's check)
    step_logprobs: list[TokenLogprob] | None = None  # the runner's logprob entry per token of the step just run
    # with sampling.prompt_logprobs, until the first token: None for token 0, then the runner's TokenLogprob of
    # each prompt token its prefill chunks predict (tokens start+1 .. end-1 of a chunk, and `end` inside the prompt)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    images: tuple[ImageSpan, ...] = ()  # its prompt's image spans (kept through preemption: recompute re-encodes)
    # the draft policy's (runtime/engine/speculation.py), set each step before the runner runs it: this step's drafts
    # (0: a plain step), whether speculation is on for it (off and drafting: a probe), and the next step's drafts
    # should this one accept none (what a runner that launches ahead may launch)
    drafts: int = 0
    drafts_on: bool = False
    drafts_next: int = 0
    acceptance: Any = None  # its speculation.Acceptance, once it decodes speculatively
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

    def admitted(self, cached: int) -> None:
        """It runs from now on, with its first `cached` positions' K/V served by the prefix cache: a prompt to score
        starts its logprobs (None for token 0), and a first admission records its cache hit."""
        self.status, self.admitted_at = Status.RUNNING, time.perf_counter()
        self.num_cached = cached
        self.prompt_logprobs = [None] if self.scores_prompt_from_start else None
        if self.preemptions == 0:
            self.cached_prompt_tokens = cached

    @property
    def scores_prompt_from_start(self) -> bool:
        """Its prompt's tokens get logprobs (asked for, and nothing decoded yet): every position's logits are needed,
        so no prefix-cache hit serves it."""
        return self.sampling.prompt_logprobs is not None and not self.output

    def reuse_limit(self) -> int:
        """Leading positions a prefix-cache hit may cover: a first token needs fresh logits, so the prompt's last
        token always runs; a resumed sequence (its output goes on) may find its whole prefill cached."""
        if self.scores_prompt_from_start:
            return 0
        return self.prefill_target if self.output else self.prefill_target - 1

    def prepare(self, vocab: int) -> None:
        """What every runner's check needs: BackendError for prompt or logit_bias ids outside the vocabulary, and
        the grammar's matcher made (once)."""
        check_token_ids(self.prompt, vocab)
        check_token_ids([t for t, _ in self.sampling.logit_bias], vocab, "logit_bias")
        if self.sampling.grammar is not None and self.matcher is None:
            self.matcher = self.sampling.grammar.matcher()

    def allowed(self, vocab: int, picked: int = 0, matcher: Any = None) -> Any:
        """The bool mask [vocab] of ids its next token may take, or None for all: the grammar's mask, with the stop
        ids off while fewer than min_tokens tokens are out (`picked`: tokens chosen earlier in this step; `matcher`:
        a fork of its matcher that took them, where they are drafts not yet committed)."""
        matcher = self.matcher if matcher is None else matcher
        mask = None if matcher is None else matcher.allowed(vocab)
        if len(self.output) + picked >= self.sampling.min_tokens or not self.stop_ids:
            return mask
        mask = np.ones(vocab, dtype=bool) if mask is None else mask.copy()
        mask[[t for t in self.stop_ids if 0 <= t < vocab]] = False
        return mask

    def unmasked(self) -> bool:
        """Whether its next token takes no logits processing at all although the request has some: no penalty,
        bias or logprobs, min_tokens met and its grammar free for now (before a tool call opens, inside the
        thought). A runner whose verify step cannot process logits may draft then, cutting its tokens where the
        grammar takes over again."""
        sp = self.sampling
        if sp.logprobs is not None or sp.logit_bias or sp.presence_penalty or sp.frequency_penalty:
            return False
        if sp.repetition_penalty != 1.0 or (self.stop_ids and len(self.output) < sp.min_tokens):
            return False
        return self.matcher is None or bool(self.matcher.free)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, its next tokens may be in turn (a speculative step's drafts): the
        grammar's, and no stop id while fewer than min_tokens tokens are out; the masks of `allowed` exactly."""
        n = len(tokens)
        early = self.sampling.min_tokens - len(self.output)  # drafts before this index may not be a stop id
        if early > 0 and self.stop_ids:
            n = next((i for i, t in enumerate(tokens[: min(n, early)]) if t in self.stop_ids), n)
        return n if self.matcher is None else self.matcher.valid_prefix(tokens[:n])

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
