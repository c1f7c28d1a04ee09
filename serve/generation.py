"""Serve stage: runs a request's choices as engine jobs and answers with OpenAI JSON or SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.client import (EngineBusy, EngineFailure, EngineUnavailable, GenerationResult, RequestOutput,
                              RequestRejected, RequestStream, SamplingParams)
from .logprobs import Logprobs
from .parser import Delta, OutputParser
from .protocol import APIError
from .vllm_extras import prompt_logprobs_json

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
                                          speculative=job.speculative)
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


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Generation:
    """One request's run: owns the parser, counts tokens, knows the finish reason."""

    def __init__(self, server: Any, job: Job, parser: OutputParser, kind: str) -> None:
        self.server, self.job, self.parser, self.kind = server, job, parser, kind
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.n_out = 0
        self.result: GenerationResult | None = None
        self.n_calls = 0
        self.token_ids: list[int] = []
        self.return_ids = False  # vLLM's return_token_ids
        self.endpoint = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
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
            if step.prompt_logprobs is not None and not self.reports_prompt_logprobs:  # echo: the prompt's
                # entries go ahead of the first token's
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
            delta.content, self.echo = self.echo + delta.content, None
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


def _merge(into: Delta, more: Delta) -> None:
    into.content += more.content
    into.reasoning += more.reasoning
    into.tool_calls += more.tool_calls


async def run_to_end(gen: Generation, request: Request, first: tuple[str, Any]) -> Delta:
    total = Delta()
    kind, payload = first
    while True:
        if kind == "tokens":
            _merge(total, gen.feed(payload))
        elif kind == "done":
            _merge(total, gen.finish(payload))
            return total
        else:
            raise payload
        kind, payload = await next_event(gen.job, request)


def chat_message(delta: Delta) -> dict:
    msg: dict = {"role": "assistant", "content": delta.content if (delta.content or not delta.tool_calls) else None}
    msg["reasoning_content"] = msg["reasoning"] = delta.reasoning or None
    if delta.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in delta.tool_calls]
    return msg


def _delta_json(delta: Delta, gen: Generation) -> dict:
    out: dict = {}
    if delta.reasoning:
        out["reasoning_content"] = out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        out["tool_calls"] = []
        for call in delta.tool_calls:  # every delta carries index, id, type and name (strict clients need them)
            out["tool_calls"].append(call.to_openai(index=gen.n_calls))
            gen.n_calls += 1
    return out


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _events(gens: list[Generation], request: Request, firsts: list[tuple[str, Any]]
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


def total_usage(gens: list[Generation]) -> dict:
    """Each prompt once, the completions of every choice (OpenAI's usage for n > 1 and for several prompts)."""
    firsts = [g for g in gens if g.counts_prompt]
    return usage(sum(len(g.job.prompt_ids) for g in firsts), sum(g.n_out for g in gens),
                 sum(g.result.cached_prompt_tokens for g in firsts if g.result))


async def stream_events(gens: list[Generation], request: Request, firsts: list[tuple[str, Any]],
                        include_usage: bool) -> AsyncIterator[bytes]:
    gen = gens[0]
    model = gen.server.model_id
    chat = gen.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, **extra: Any) -> bytes:
        body = {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        body.update(extra)
        return sse(body)

    def choice(i: int, delta: Delta, finish: str | None = None, ids: tuple[int, ...] = (),
               logprobs: dict | None = None) -> dict | None:
        g = gens[i]
        extra = (g.return_ids and ids) or logprobs is not None  # a chunk even without text
        if chat:
            d = _delta_json(delta, g)
            if not d and finish is None and not extra:
                return None
            out = {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        else:
            if not delta.content and finish is None and not extra:
                return None
            out = {"index": i, "text": delta.content, "logprobs": logprobs, "finish_reason": finish}
        if g.return_ids:
            out["token_ids"] = list(ids)
        return out

    try:
        if chat:
            for i in range(len(gens)):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        failed = False
        async for i, kind, payload in _events(gens, request, firsts):
            g = gens[i]
            if kind == "tokens":
                delta = g.feed(payload)
                c = choice(i, delta, ids=() if g.score_only else payload.token_ids, logprobs=g.step_logprobs)
                g.step_logprobs = None
                if c:
                    yield chunk(c)
            elif kind == "done":
                tail = g.finish(payload)
                c = choice(i, tail)
                if c:
                    yield chunk(c)
                yield chunk(choice(i, Delta(), g.finish_reason()))
            else:
                err: APIError = payload
                yield sse(err.body())
                for other in gens:
                    other.record(err.status)
                failed = True
                break
        if not failed:
            if include_usage:
                yield sse({"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": [],
                           "usage": total_usage(gens)})
            for g in gens:
                g.record(200)
        yield sse("[DONE]")
    except ClientGone:
        pass
    finally:
        # Also reached when the server cancels this generator (the client disconnected while a chunk was being
        # sent, or shutdown): the request then still counts as aborted.
        for g in gens:
            g.record(499)
            g.job.abort()  # no-op after a normal end; stops the engine when the client went away


async def serve_generation(server: Any, request: Request, gens: list[Generation], stream: bool,
                           include_usage: bool) -> Any:
    """Run the request's choices (n of them, each its own engine sequence) and answer, streamed or not."""
    firsts = []
    try:
        for g in gens:
            submit(server, g.job)
        for g in gens:
            firsts.append(await g.first_event(request))
    except ClientGone:
        for g in gens:
            g.job.abort()
            g.record(499)
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    except BaseException:
        for g in gens:
            g.job.abort()
        raise
    if stream:
        return StreamingResponse(stream_events(gens, request, firsts, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        totals = await asyncio.gather(*(run_to_end(g, request, f) for g, f in zip(gens, firsts)))
    except ClientGone:
        for g in gens:
            g.record(499)
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    finally:
        for g in gens:
            g.job.abort()
    gen = gens[0]
    base = {"id": gen.id, "created": gen.created, "model": server.model_id, "usage": total_usage(gens)}
    choices = []
    for i, (g, total) in enumerate(zip(gens, totals)):
        logprobs = g.logprobs.total() if g.logprobs is not None else None
        c = {"index": i, "message": chat_message(total)} if g.kind == "chat" else {"index": i, "text": total.content}
        c.update(logprobs=logprobs, finish_reason=g.finish_reason())
        if g.return_ids:
            c.update(token_ids=g.token_ids, prompt_token_ids=list(g.job.prompt_ids))
        if g.reports_prompt_logprobs and g.kind != "chat":
            c["prompt_logprobs"] = prompt_logprobs_json(g.job.prompt_ids, g.prompt_scores, server.decode)
        choices.append(c)
    body = {"object": "chat.completion" if gen.kind == "chat" else "text_completion", **base, "choices": choices}
    if gen.reports_prompt_logprobs and gen.kind == "chat":  # vLLM's chat answer carries them once, at the top
        body["prompt_logprobs"] = prompt_logprobs_json(gen.job.prompt_ids, gen.prompt_scores, server.decode)
    for g in gens:
        g.record(200)
    return JSONResponse(body)


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
