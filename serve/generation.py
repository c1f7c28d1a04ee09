"""Serve stage: a request's choices as engine jobs: submitting, reading their outputs through the one parser,
counting tokens and metrics, and noticing a client that went away."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request

from ..runtime.backend import ImageSpan
from ..runtime.client import (EngineBusy, EngineFailure, EngineUnavailable, GenerationResult, RequestOutput,
                              RequestRejected, RequestStream, SamplingParams)
from .logprobs import Logprobs
from .parser import Delta, Event, OutputParser
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
    stream: RequestStream | None = None
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


def submit(server: Any, job: Job) -> None:
    try:
        job.stream = server.client.submit(job.prompt_ids, job.max_tokens, job.sampling, job.stop_ids,
                                          speculative=job.speculative, images=job.images)
    except (EngineBusy, EngineUnavailable, RequestRejected) as exc:
        raise api_error(exc) from None


async def next_event(job: Job, request: Request | None) -> tuple[str, Any]:
    """("tokens", RequestOutput), ("done", GenerationResult) or ("error", APIError). Aborts the request and
    raises ClientGone if the client disconnects meanwhile; the connection is checked at least every POLL_S."""
    loop = asyncio.get_running_loop()
    while True:
        if request is not None and loop.time() - job.checked_at >= POLL_S:
            job.checked_at = loop.time()
            if await request.is_disconnected():
                job.abort()
                raise ClientGone()
        try:
            out: RequestOutput = await job.stream.next(POLL_S)
        except asyncio.TimeoutError:
            job.checked_at = 0.0  # nothing arrived for a while: check the connection now
            continue
        except Exception as exc:
            return "error", api_error(exc)
        if out.finished:
            return "done", out.result
        if job.first_at is None:
            job.first_at = time.perf_counter()
        return "tokens", out


class Generation:
    """One request's run: owns the parser, counts tokens, knows the finish reason."""

    def __init__(self, server: Any, job: Job, parser: OutputParser, kind: str, endpoint: str) -> None:
        self.server, self.job, self.parser, self.kind = server, job, parser, kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n_out = 0
        self.result: GenerationResult | None = None
        self.n_calls = 0
        self.token_ids: list[int] = []
        self.return_ids = False  # vLLM's return_token_ids
        self.endpoint = endpoint  # the route /metrics counts the request under
        self.recorded = False
        self.counts_request = True  # the HTTP request's count in /metrics (its first choice only)
        self.counts_prompt = True  # usage counts its prompt (the first choice of each prompt only)
        self.echo: str | None = None  # completions' echo: the prompt text, still to go ahead of the output
        self.score_only = False  # max_tokens 0 with echo: the one token the engine must make is dropped
        self.logprobs = (Logprobs(lambda t: server.tokenizer.decode([t]), kind == "chat")
                         if job.sampling.logprobs is not None else None)
        self.step_logprobs: dict | None = None  # the last fed step's logprobs object
        self.reports_prompt_logprobs = False  # vLLM's prompt_logprobs: the answer carries the prompt's entries
        self.prompt_scores: list | None = None  # the engine's prompt logprobs, once they arrive

    def record(self, status: int) -> None:
        """Count the request once in /metrics; 499 = the client went away (its tokens still count)."""
        if self.recorded:
            return
        self.recorded = True
        metrics = self.server.metrics
        if self.counts_request:
            metrics.request_done(self.endpoint, status)
        if status == 499:
            if self.counts_request:
                metrics.aborted(self.endpoint)
            if self.result is None:  # finish() never ran
                metrics.add(prompt_tokens=len(self.job.prompt_ids), generation_tokens=self.n_out)

    def feed(self, step: RequestOutput) -> Delta:
        metrics = self.server.metrics
        if self.n_out == 0 and step.token_ids:
            metrics.observe("ttft", time.perf_counter() - self.job.arrived)
        if self.job.speculative and step.accepted is not None:
            metrics.observe("accepted_per_step", step.accepted + 1)
        ids = () if self.score_only else step.token_ids
        if step.prompt_logprobs is not None:
            self.prompt_scores = step.prompt_logprobs
        self.n_out += len(ids)
        self.token_ids += ids
        if self.logprobs is not None:
            scored: list = []
            if step.prompt_logprobs is not None and not self.reports_prompt_logprobs:
                # echo: the prompt's entries go ahead of the first token's
                scored += zip(self.job.prompt_ids, step.prompt_logprobs)
            if ids and step.logprobs is not None:
                scored += zip(ids, step.logprobs)
            if scored:
                self.step_logprobs = self.logprobs.add(scored)
        delta = self._echoed(self.parser.feed(list(ids)))
        if self.parser.stopped:
            self.job.abort()  # a stop string ended the answer: free the engine now
        return delta

    def _echoed(self, delta: Delta) -> Delta:
        """The delta with the echoed prompt text ahead of it, the first time only."""
        if self.echo is not None:
            echoed = Delta.of([Event("content", self.echo)]) if self.echo else Delta()
            echoed.extend(delta)
            delta, self.echo = echoed, None
        return delta

    def finish(self, result: GenerationResult) -> Delta:
        """The engine is done: record the request's metrics and flush the parser."""
        self.result = result
        metrics, job = self.server.metrics, self.job
        if job.first_at is not None and self.n_out > 1:
            elapsed = time.perf_counter() - job.first_at
            if elapsed > 0:
                metrics.observe("tokens_per_s", (self.n_out - 1) / elapsed)
        metrics.add(prompt_tokens=len(job.prompt_ids), cached_prompt_tokens=result.cached_prompt_tokens,
                    generation_tokens=self.n_out)
        return self._echoed(self.parser.finish())

    def finish_reason(self) -> str:
        if self.score_only:
            return "length"  # OpenAI's answer to max_tokens 0
        reason = self.result.finish_reason if self.result else "stop"
        if self.parser.n_calls and (reason != "length" or self.parser.stopped):
            return "tool_calls"
        if self.parser.stopped:
            return "stop"
        return "length" if reason == "length" else "stop"

    async def first_event(self, request: Request) -> tuple[str, Any]:
        """Wait for the engine to start (so that an engine-side rejection can still become a 4xx)."""
        kind, payload = await next_event(self.job, request)
        if kind == "error":
            raise payload
        if kind == "tokens" and self.job.sampling.prompt_logprobs is not None and payload.prompt_logprobs is None:
            # a backend that ignored the field: better an error than an answer silently missing the entries
            raise APIError("the engine returned no prompt logprobs", status=500, type="server_error")
        return kind, payload


async def run_to_end(gen: Generation, request: Request, first: tuple[str, Any]) -> Delta:
    total = Delta()
    kind, payload = first
    while True:
        if kind == "tokens":
            total.extend(gen.feed(payload))
        elif kind == "done":
            total.extend(gen.finish(payload))
            return total
        else:
            raise payload
        kind, payload = await next_event(gen.job, request)


def sse(obj: dict | str, event: str | None = None) -> bytes:
    """One server-sent event: `data: <JSON>` (OpenAI), with an `event:` line first when named (Anthropic)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {data}\n\n".encode()


async def events(gens: list[Generation], request: Request, firsts: list[tuple[str, Any]]
                  ) -> AsyncIterator[tuple[int, str, Any]]:
    """(choice index, kind, payload) of every generation until each is done or failed. One generation is read
    directly; several through one queue fed by a task each (their tokens interleave as the engine makes them)."""
    if len(gens) == 1:
        kind, payload = firsts[0]
        while True:
            yield 0, kind, payload
            if kind != "tokens":
                return
            kind, payload = await next_event(gens[0].job, request)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int) -> None:
        kind, payload = firsts[i]
        try:
            while True:
                await queue.put((i, kind, payload))
                if kind != "tokens":
                    return
                kind, payload = await next_event(gens[i].job, request)
        except ClientGone as exc:
            await queue.put((i, "gone", exc))
    tasks = [asyncio.create_task(pump(i)) for i in range(len(gens))]
    try:
        live = len(gens)
        while live:
            i, kind, payload = await queue.get()
            if kind == "gone":
                raise payload
            live -= kind != "tokens"
            yield i, kind, payload
    finally:
        for t in tasks:
            t.cancel()


async def deltas(gens: list[Generation], request: Request, firsts: list[tuple[str, Any]]
                 ) -> AsyncIterator[tuple[int, str, Any, Delta | None]]:
    """events() with each generation's output parsed as it comes: (choice index, kind, payload, its Delta). A failure
    while decoding one generation's output (detokenizing, parsing) is that generation's own 500, reported as an
    "error" event, so every API's stream ends it with its error event instead of a cut connection."""
    async for i, kind, payload in events(gens, request, firsts):
        delta = None
        if kind != "error":
            g = gens[i]
            try:
                delta = g.feed(payload) if kind == "tokens" else g.finish(payload)
            except Exception as exc:
                log.error("request %s: its output could not be decoded", g.id, exc_info=exc)
                kind, payload = "error", APIError(f"generation failed: {type(exc).__name__} while decoding the "
                                                  f"output: {exc}", status=500, type="server_error")
        yield i, kind, payload, delta


def choices(n: int, makers: list[Callable[[SamplingParams], Generation]], sampling: SamplingParams
            ) -> list[Generation]:
    """`n` generations of each prompt (one maker per prompt), prompt-major: choice p * n + j, as OpenAI numbers
    them. Choice j samples with seed + j (greedy choices are all alike, as in vLLM); each is its own engine
    sequence, and the engine's prefix cache may serve a shared prompt."""
    gens = []
    for make in makers:
        for j in range(n):
            g = make(sampling if j == 0 else replace(sampling, seed=(sampling.seed + j) % (1 << 63)))
            g.counts_request, g.counts_prompt = not gens, j == 0
            gens.append(g)
    return gens
