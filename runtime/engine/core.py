"""Runtime stage: the engine core: `step()` = schedule -> run (a backend's ModelRunner) -> postprocess.

The stop, length and cancel rules live here once, for plain and speculative decoding and for every backend:
a runner only computes tokens. Its decode step returns, per sequence, the tokens the step commits (one, or the
accepted drafts plus the bonus token), and postprocess cuts them after a stop id and at the room left
(max_tokens, context). Outputs are `RequestOutput` values; a finished request's last one carries its result.

Faults stay with their sequence: an error in one sequence's prefill, or a decode row the runner reports as failed
(runtime.backend.SequenceFailed), finishes that sequence alone with its error while the rest of the step goes on.
A batched decode that raises as a whole is re-run without the sequence it names, or else one sequence at a time,
so that the culprit fails and every other row commits what it would have alone. Only EngineStateLost (or a fault
no sequence reproduces alone) leaves step() and fails the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, NamedTuple

from ..backend import (
    BackendError,
    EngineStateLost,
    GenerationResult,
    ImageSpan,
    SamplingParams,
    SequenceFailed,
    TokenLogprob,
)
from ..options import DraftOptions
from .interface import DecodeResult, ModelRunner, Pending
from .kv_manager import KVManager
from .scheduler import KVExhausted, Prefill, Scheduler
from .sequence import Sequence, Status
from .speculation import DraftPlanner

log = logging.getLogger("thorgen.engine")


class RequestOutput(NamedTuple):
    """Tokens committed by one engine step; the last output of a request has `finished` and its `result`.
    A NamedTuple: an immutable value, and cheap enough to make one per sequence per step."""

    request_id: str
    token_ids: tuple[int, ...] = ()
    accepted: int | None = None  # drafts accepted by a speculative step
    finished: bool = False
    result: GenerationResult | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token in token_ids, when the request asked
    # on the request's first token output, with sampling.prompt_logprobs: one per prompt token (None first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    error: SequenceFailed | None = None  # on a finished output: the request failed with it (its own fault or not)


class _Once:
    """Calls `fn` on the first call only."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


def default_step_tokens(runner: ModelRunner) -> int:
    """A step's token budget: a chunked-prefill runner gets one whole prefill chunk beside every running sequence's
    decode (or verify block). Its prefill and decode are separate forwards, so the chunk's rows are bounded by the
    engine, not by the decodes; a budget of 512 split a 512-token prompt into 480 + 32 rows beside 32 decodes, and
    the 32-row remainder cost a second prefill forward (all its launches, and every expert its rows touch read
    again). A whole-prompt runner keeps 512 (a prompt waits for a step whose budget holds it)."""
    if runner.prefill_chunk is None:
        return 512
    return runner.prefill_chunk + runner.max_num_seqs * runner.verify_block


class EngineCore:
    """Sequences in, RequestOutput values out. Not thread-safe: one thread calls everything."""

    def __init__(
        self, runner: ModelRunner, max_step_tokens: int | None = None, drafts: DraftOptions | None = None
    ) -> None:
        """`drafts`: the draft policy's options (default: adaptive draft counts)."""
        self.runner = runner
        if max_step_tokens is None:
            max_step_tokens = default_step_tokens(runner)
        self.kv = KVManager(runner.kv_geometry, runner.draft_context)
        self.drafts = DraftPlanner(runner.speculative_cost, runner.verify_block - 1, runner.max_context, drafts)
        self.scheduler = Scheduler(
            self.kv,
            runner.max_num_seqs,
            max_step_tokens,
            runner.max_context,
            runner.verify_block,
            runner.prefill_chunk,
            runner.lookahead,
            runner.media_ready,
            self.drafts,
            runner.chunks_in_pieces,
        )
        # speculative decoding's totals (health(); /metrics): verify steps, drafts they verified, drafts accepted
        self.speculation = {"speculative_steps": 0, "draft_tokens": 0, "accepted_tokens": 0}
        self._seqs: dict[str, Sequence] = {}
        self._cancelled: list[Sequence] = []  # aborted since the last step

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        images: tuple[ImageSpan, ...] = (),
    ) -> Sequence:
        """Queue a request; BackendError when it cannot be served as asked (checked now, before any work)."""
        if request_id in self._seqs:
            raise BackendError(f"request id {request_id!r} is already in the engine")
        if not prompt:
            raise BackendError("the prompt is empty: at least one token (e.g. <bos>) is needed")
        if len(prompt) >= self.runner.max_context:
            raise BackendError(
                f"the prompt has {len(prompt)} tokens but the context (--ctx) holds "
                f"{self.runner.max_context}; shorten the prompt or raise --ctx above {len(prompt)}"
            )
        if max_tokens < 1:
            raise BackendError(f"max_tokens {max_tokens} must be >= 1")
        drafts = sampling.draft_tokens
        if speculative and drafts is not None and drafts > self.runner.verify_block - 1:
            raise BackendError(
                f"draft_tokens {drafts}: the drafter proposes at most {self.runner.verify_block - 1} tokens a step"
            )
        seq = Sequence(
            request_id,
            [int(t) for t in prompt],
            sampling,
            int(max_tokens),
            frozenset(stop_ids),
            speculative,
            images=tuple(images),
        )
        self.runner.check(seq)
        try:
            self.scheduler.add(seq)
        except KVExhausted as exc:
            raise BackendError(str(exc)) from None
        self._seqs[request_id] = seq
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        self._cancelled.append(seq)  # finished at the start of the next step, between steps
        return True

    @property
    def unfinished(self) -> int:
        return self.scheduler.unfinished

    def health(self) -> dict[str, Any]:
        """What a health report shows of the core: the KV manager's pages and the positions whose drafter context a
        catch-up prefill restored, the device memory in use when the runner last sampled it (None without a
        device), the host bytes of its bounded caches (the encoded images' rows, the prefix index), the speculation
        counters (with K under emulated acceptance). Plain ints, safe to read between steps or during one."""
        kv = self.kv
        speculation: dict[str, int] = dict(self.speculation)
        if self.drafts.options.emulate_acceptance is not None:  # (the counts are then not the model's)
            speculation["emulated_acceptance"] = self.drafts.options.emulate_acceptance
        return {
            "kv": {"blocks": kv.total_pages, "used": kv.used_pages, "block_tokens": kv.geometry.page},
            "catch_up_tokens": self.runner.caught_up_tokens,
            "speculation": speculation,
            "gpu_memory_used": self.runner.device_memory_used,
            "caches": {
                "image_rows_bytes": self.runner.image_rows_bytes,
                "prefix_index_bytes": kv.pool.index_bytes if kv.pool is not None else 0,
            },
        }

    def step(self, launched: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One engine step. `launched()` runs once, as soon as the step's first device work is enqueued (or at
        the end of a step without any): the client streams the previous step's outputs there, beside the GPU."""
        once = _Once(launched)
        outputs = []
        if self._cancelled:
            cancelled, self._cancelled = self._cancelled, []
            outputs = [self._finish(s, "cancelled") for s in cancelled if s.request_id in self._seqs]
        schedule = self.scheduler.schedule()
        for seq in schedule.preempted:
            self.runner.release(seq, finished=False)
        if schedule.kv_ops:
            self.runner.apply(schedule.kv_ops)
        outputs += [self._finish(seq, "length") for seq in schedule.exhausted]
        new: list[tuple[Sequence, list[int], bool]] = []
        for n, p in enumerate(schedule.prefills):
            try:
                token = self._prefill(p, once, rebind=n > 0, beside=bool(schedule.decodes))
            except Exception as exc:
                if isinstance(exc, EngineStateLost):
                    raise
                outputs.append(self._fail(p.seq, exc))
                continue
            if token is not None:
                new.append((p.seq, [int(token)], False))
        if schedule.decodes:
            seqs = [s for s in schedule.decodes if s.status is Status.RUNNING]
            for seq, res in zip(seqs, self._decode(seqs, once)):
                if isinstance(res, BaseException):
                    outputs.append(self._fail(seq, res))
                    continue
                chain, drafted = res
                seq.num_cached = seq.num_tokens - 1 + len(chain)  # its input token plus all but the last new
                self._count_drafts(seq, drafted, len(chain) - 1 if drafted else 0)
                new.append((seq, [int(t) for t in chain], drafted > 0))
        for seq, tokens, verified in new:
            outputs += self._commit(seq, tokens, verified)
        once()
        return outputs

    def _prefill(self, p: Prefill, once: _Once, rebind: bool, beside: bool) -> int | None:
        """One scheduled prefill chunk (it starts where the sequence's K/V ends: a prefix-cache hit made at
        admission counts); the first token when it samples one. `rebind`: prefills ran before it in this step,
        so a sequence admitted in it may find more of its prefix cached now (KVManager.rebind). `beside`: other
        sequences decode in this step (the runner may then run the chunk in pieces: until its last, the chunk
        stays uncomputed and is scheduled again)."""
        start = p.start
        if p.admitted and rebind:
            start = self.kv.rebind(p.seq, p.seq.reuse_limit())
            ops = self.kv.take_ops()
            if ops:
                self.runner.apply(ops)
            if start >= p.end:  # (never a sampling chunk: the prompt's last token always runs)
                return None
        token = self.runner.prefill(p.seq, start, p.end, p.sample, once, beside)
        if isinstance(token, Pending):
            return None
        p.seq.num_cached = p.end
        self.kv.prefilled(p.seq, p.end)
        return token if p.sample else None

    def _decode(self, seqs: list[Sequence], once: _Once) -> list[DecodeResult | BaseException]:
        """The runner's decode of `seqs`, each row its result or its error. A step that fails as a whole runs
        again without the sequence its SequenceFailed names, else each sequence alone (a sequence's tokens do not
        depend on its batch); when no sequence runs alone either, the fault is the engine's and is raised."""
        if not seqs:
            return []
        try:
            return list(self.runner.decode(seqs, once))
        except Exception as exc:
            if isinstance(exc, EngineStateLost):
                raise
            failure = exc
        culprit = next(
            (s for s in seqs if isinstance(failure, SequenceFailed) and s.request_id == failure.request_id), None
        )
        if culprit is not None:
            rest = iter(self._decode([s for s in seqs if s is not culprit], once))
            return [failure if s is culprit else next(rest) for s in seqs]
        if len(seqs) == 1:
            return [failure]
        log.warning(
            "a batched step of %d sequences failed (%s: %s); running each alone",
            len(seqs),
            type(failure).__name__,
            failure,
        )
        alone = [self._decode([s], once)[0] for s in seqs]
        if all(isinstance(r, BaseException) for r in alone):
            raise failure
        return alone

    def _count_drafts(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A decode row ran `drafted` drafts (0: plain) and accepted `accepted`: the policy's estimate and the
        totals."""
        self.drafts.record(seq, drafted, accepted)
        if drafted:
            spec = self.speculation
            spec["speculative_steps"] += 1
            spec["draft_tokens"] += drafted
            spec["accepted_tokens"] += accepted

    def _fail(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        """Finish `seq` alone with its error (an error that is not a SequenceFailed is the engine's fault)."""
        if not isinstance(exc, SequenceFailed):
            log.error("request %s failed", seq.request_id, exc_info=exc)
            exc = SequenceFailed(seq.request_id, f"{type(exc).__name__}: {exc}")
        return self._finish(seq, "error", exc)

    def _commit(self, seq: Sequence, tokens: list[int], verified: bool) -> list[RequestOutput]:
        """The stop / length rules: keep tokens up to a stop id and within the room; finish when done."""
        if seq.first_token_at is None:
            seq.first_token_at = time.perf_counter()
        room = seq.room(self.runner.max_context)
        if len(tokens) > room:
            tokens = tokens[: max(room, 0)]
        stop_at = None
        for i, t in enumerate(tokens):
            if t in seq.stop_ids:
                stop_at = i
                tokens = tokens[: i + 1]
                break
        seq.output += tokens
        accepted = None
        if verified:
            accepted = len(tokens) - 1
            seq.accepted_lengths.append(len(tokens))
        step_lps, seq.step_logprobs = seq.step_logprobs, None
        logprobs = None if step_lps is None else tuple(step_lps[: len(tokens)])
        prompt_lps = None
        if seq.prompt_logprobs is not None:  # delivered once, with the first token
            prompt_lps, seq.prompt_logprobs = tuple(seq.prompt_logprobs), None
            assert len(prompt_lps) == len(seq.prompt), (len(prompt_lps), len(seq.prompt))
        out = [RequestOutput(seq.request_id, tuple(tokens), accepted, logprobs=logprobs, prompt_logprobs=prompt_lps)]
        if stop_at is not None:
            out.append(self._finish(seq, "stop"))
        elif room - len(tokens) <= 0:
            out.append(self._finish(seq, "length"))
        return out

    def _finish(self, seq: Sequence, reason: str, error: SequenceFailed | None = None) -> RequestOutput:
        was_running = seq.status is Status.RUNNING
        # a failed sequence's K/V may be half written: it never serves a prefix-cache hit
        self.scheduler.finish(seq, reason, cacheable=error is None)
        if was_running:
            self.runner.release(seq, finished=error is None)
        self._seqs.pop(seq.request_id, None)
        assert seq.finished_at is not None  # (scheduler.finish set it)
        first = seq.first_token_at or seq.finished_at
        result = GenerationResult(
            token_ids=list(seq.output),
            accepted_lengths=list(seq.accepted_lengths),
            finish_reason=reason,
            prompt_tokens=len(seq.prompt),
            cached_prompt_tokens=seq.cached_prompt_tokens,
            prefill_s=first - (seq.admitted_at or seq.arrived),
            decode_s=seq.finished_at - first,
        )
        return RequestOutput(seq.request_id, finished=True, result=result, error=error)
