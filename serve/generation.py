"""Serve stage: a request's choices as engine jobs: submitting them, reading their outputs through the one parser
into neutral events (serve/events.py), counting tokens and metrics, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from fastapi import Request

from ..runtime.backend import GenerationResult, ImageSpan, SamplingParams
from ..runtime.client import EngineBusy, EngineFailure, EngineUnavailable, OutputStream, RequestOutput, RequestRejected
from .context import Engine
from .events import Error, Event, Finish, FinishReason, OutputEvent, ScoredToken, TextDelta, Tokens, Usage
from .metrics import Metrics
from .parser import OutputParser
from .protocol import APIError

log = logging.getLogger("thorgen.serve")

POLL_S = 0.2  # how often a waiting handler checks whether its client is still connected


class ClientGone(Exception):
    pass


@dataclass
class Job:
    """One request as the server sees it: what goes to the engine, and its stream once submitted."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculative: bool = False
    images: tuple[ImageSpan, ...] = ()  # the prompt's image spans (its placeholders already expanded)
    stream: OutputStream | None = None
    arrived: float = field(default_factory=time.perf_counter)
    first_at: float | None = None
    checked_at: float = 0.0  # event-loop time of the last client-connection check

    def abort(self) -> None:
        if self.stream is not None:
            self.stream.abort()


def api_error(exc: BaseException) -> APIError:
    """The engine's error as the client should see it: its own mistakes 4xx, the engine's 5xx."""
    if isinstance(exc, RequestRejected):
        return APIError(str(exc))
    if isinstance(exc, EngineBusy):
        return APIError(str(exc), status=429, type="server_busy")
    if isinstance(exc, EngineUnavailable):
        return APIError(f"the engine is unavailable: {exc}", status=503, type="server_error")
    if isinstance(exc, EngineFailure):
        return APIError(str(exc), status=500, type="server_error")
    return APIError(f"generation failed: {type(exc).__name__}: {exc}", status=500, type="server_error")


def submit(client: Engine, job: Job) -> None:
    try:
        job.stream = client.submit(
            job.prompt_ids, job.max_tokens, job.sampling, job.stop_ids, speculative=job.speculative, images=job.images
        )
    except (EngineBusy, EngineUnavailable, RequestRejected) as exc:
        raise api_error(exc) from None


async def next_output(job: Job, request: Request | None) -> RequestOutput | APIError:
    """The job's next engine output, or its error. Aborts the request and raises ClientGone if the client
    disconnects meanwhile; the connection is checked at least every POLL_S."""
    assert job.stream is not None, "the job was not submitted"
    loop = asyncio.get_running_loop()
    while True:
        if request is not None and loop.time() - job.checked_at >= POLL_S:
            job.checked_at = loop.time()
            if await request.is_disconnected():
                job.abort()
                raise ClientGone()
        try:
            out = await job.stream.next(POLL_S)
        except asyncio.TimeoutError:
            job.checked_at = 0.0  # nothing arrived for a while: check the connection now
            continue
        except Exception as exc:
            return api_error(exc)
        if not out.finished and job.first_at is None:
            job.first_at = time.perf_counter()
        return out


class Generation:
    """One choice's run: its engine job and parser; turns each engine output into neutral events and counts the
    request in /metrics (`endpoint`: the route it counts under)."""

    def __init__(
        self,
        metrics: Metrics,
        job: Job,
        parser: OutputParser,
        endpoint: str,
        *,
        echo: str | None = None,
        score_only: bool = False,
        prompt_scores_apart: bool = False,
    ) -> None:
        self.metrics, self.job, self.parser, self.endpoint = metrics, job, parser, endpoint
        self.echo = echo  # completions' echo: the prompt text, still to go ahead of the output
        self.score_only = score_only  # max_tokens 0 with echo: the one token the engine must make is dropped
        # vLLM's prompt_logprobs: the prompt's entries are reported apart, not ahead of the output's logprobs
        self.prompt_scores_apart = prompt_scores_apart
        self.n_out = 0
        self.result: GenerationResult | None = None
        self.recorded = False
        self.counts_request = True  # the HTTP request's count in /metrics (its first choice only)
        self.counts_prompt = True  # usage counts its prompt (the first choice of each prompt only)

    def record(self, status: int) -> None:
        """Count the request once in /metrics; 499 = the client went away (its tokens still count)."""
        if self.recorded:
            return
        self.recorded = True
        if self.counts_request:
            self.metrics.request_done(self.endpoint, status)
        if status == 499:
            if self.counts_request:
                self.metrics.aborted(self.endpoint)
            if self.result is None:  # _finish() never ran
                self.metrics.add(prompt_tokens=len(self.job.prompt_ids), generation_tokens=self.n_out)

    def to_events(self, out: RequestOutput) -> list[Event]:
        """The events of one engine output: a step's, or (finished) the flushed end of the answer."""
        if not out.finished:
            return self._feed(out)
        if out.result is None:
            raise ValueError("the engine finished the request without its result")
        return self._finish(out.result)

    def _feed(self, step: RequestOutput) -> list[Event]:
        if self.n_out == 0 and step.token_ids:
            self.metrics.observe("ttft", time.perf_counter() - self.job.arrived)
        if self.job.speculative and step.accepted is not None:
            self.metrics.observe("accepted_per_step", step.accepted + 1)
        ids = () if self.score_only else step.token_ids
        self.n_out += len(ids)
        scored: list[ScoredToken] = []
        if self.job.sampling.logprobs is not None:
            if step.prompt_logprobs is not None and not self.prompt_scores_apart:
                scored += zip(self.job.prompt_ids, step.prompt_logprobs)  # echo: ahead of the first token's
            if ids and step.logprobs is not None:
                scored += zip(ids, step.logprobs)
        events: list[Event] = [*self._echoed(self.parser.feed(list(ids)))]
        if self.parser.stopped:
            self.job.abort()  # a stop string ended the answer: free the engine now
        return events + [Tokens(tuple(ids), tuple(scored), step.prompt_logprobs)]

    def _echoed(self, events: list[OutputEvent]) -> list[OutputEvent]:
        """The events with the echoed prompt text ahead of them, the first time only."""
        echo, self.echo = self.echo, None
        return [TextDelta(echo), *events] if echo else events

    def _finish(self, result: GenerationResult) -> list[Event]:
        """The engine is done: record the request's metrics, flush the parser, report usage and the finish."""
        self.result = result
        job = self.job
        if job.first_at is not None and self.n_out > 1:
            elapsed = time.perf_counter() - job.first_at
            if elapsed > 0:
                self.metrics.observe("tokens_per_s", (self.n_out - 1) / elapsed)
        self.metrics.observe("e2e", time.perf_counter() - job.arrived)
        self.metrics.add(
            prompt_tokens=len(job.prompt_ids),
            cached_prompt_tokens=result.cached_prompt_tokens,
            generation_tokens=self.n_out,
        )
        reason = self._finish_reason(result.finish_reason)
        matched = self.parser.stop_sequence if reason is FinishReason.STOP_SEQUENCE else None
        return [
            *self._echoed(self.parser.finish()),
            Usage(len(job.prompt_ids), result.cached_prompt_tokens, self.n_out, self.parser.n_reasoning_tokens),
            Finish(reason, matched),
        ]

    def _finish_reason(self, engine_reason: str) -> FinishReason:
        if self.score_only:
            return FinishReason.LENGTH  # nothing was generated: max_tokens 0 was reached
        parser = self.parser
        if parser.n_calls and (engine_reason != "length" or parser.stopped):
            return FinishReason.TOOL_CALLS
        if parser.stop_sequence is not None:
            return FinishReason.STOP_SEQUENCE
        if engine_reason == "length":
            return FinishReason.LENGTH
        # the parser's own stop (parallel_tool_calls false) always comes with a call: TOOL_CALLS above
        return FinishReason.CANCELLED if engine_reason == "cancelled" else FinishReason.STOP

    async def first_output(self, request: Request) -> RequestOutput:
        """Wait for the engine to start (so that an engine-side rejection can still become a 4xx)."""
        out = await next_output(self.job, request)
        if isinstance(out, APIError):
            raise out
        if not out.finished and self.job.sampling.prompt_logprobs is not None and out.prompt_logprobs is None:
            # a backend that ignored the field: better an error than an answer silently missing the entries
            raise APIError("the engine returned no prompt logprobs", status=500, type="server_error")
        return out


async def _outputs(
    gens: list[Generation], request: Request, firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, RequestOutput | APIError]]:
    """(choice index, engine output or error) of every generation until each is done or failed. One generation is
    read directly; several through one queue fed by a task each (their tokens interleave as the engine makes them)."""

    def last(item: RequestOutput | APIError) -> bool:
        return isinstance(item, APIError) or item.finished

    if len(gens) == 1:
        item: RequestOutput | APIError = firsts[0]
        while True:
            yield 0, item
            if last(item):
                return
            item = await next_output(gens[0].job, request)
    queue: asyncio.Queue[tuple[int, RequestOutput | APIError | ClientGone]] = asyncio.Queue()

    async def pump(i: int) -> None:
        item: RequestOutput | APIError = firsts[i]
        try:
            while True:
                await queue.put((i, item))
                if last(item):
                    return
                item = await next_output(gens[i].job, request)
        except ClientGone as exc:
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    try:
        live = len(gens)
        while live:
            i, got = await queue.get()
            if isinstance(got, ClientGone):
                raise got
            live -= last(got)
            yield i, got
    finally:
        for t in tasks:
            t.cancel()


async def events(
    gens: list[Generation], request: Request, firsts: list[RequestOutput]
) -> AsyncIterator[tuple[int, Event]]:
    """(choice index, event) of every generation, each generation's output parsed as it comes. A failure while
    decoding one generation's output (detokenizing, parsing) is that generation's own 500 `Error`, so every API's
    stream ends it with its error event instead of a cut connection."""
    async for i, out in _outputs(gens, request, firsts):
        if isinstance(out, APIError):
            yield i, Error(out)
            continue
        try:
            taken = gens[i].to_events(out)
        except Exception as exc:
            log.error("request %s: its output could not be decoded", out.request_id, exc_info=exc)
            taken = [
                Error(
                    APIError(
                        f"generation failed: {type(exc).__name__} while decoding the output: {exc}",
                        status=500,
                        type="server_error",
                    )
                )
            ]
        for event in taken:
            yield i, event


def choices(n: int, makers: list[Callable[[SamplingParams], Generation]], sampling: SamplingParams) -> list[Generation]:
    """`n` generations of each prompt (one maker per prompt), prompt-major: choice p * n + j, as OpenAI numbers
    them. Choice j samples with seed + j (greedy choices are all alike, as in vLLM); each is its own engine
    sequence, and the engine's prefix cache may serve a shared prompt."""
    gens: list[Generation] = []
    for make in makers:
        for j in range(n):
            g = make(sampling if j == 0 else replace(sampling, seed=(sampling.seed + j) % (1 << 63)))
            g.counts_request, g.counts_prompt = not gens, j == 0
            gens.append(g)
    return gens
