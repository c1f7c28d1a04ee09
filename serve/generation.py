"""Serve stage: /v1/chat/completions and /v1/completions: request -> prompt ids -> engine job -> OpenAI JSON/SSE."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.api import (EngineBusy, EngineFailure, EngineUnavailable, GenerationResult, RequestOutput,
                           RequestRejected, RequestStream, SamplingParams)
from .guards import prompt_ids
from .logprobs import Logprobs
from .parser import ControlIds, Delta, OutputParser
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_unsupported, stop_list,
                       template_messages, tool_choice_mode, validate_tools)
from .sampling import max_new_tokens, sampling_params, thinking_enabled
from .structured import response_grammar
from .tool_grammar import tool_call_grammar

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
        self.logprobs = (Logprobs(lambda t: server.tokenizer.decode([t]), kind == "chat")
                         if job.sampling.logprobs is not None else None)
        self.step_logprobs: dict | None = None  # the last fed step's logprobs object

    def record(self, status: int) -> None:
        """Count the request once in /metrics; 499 = the client went away (its tokens still count)."""
        if self.recorded:
            return
        self.recorded = True
        metrics = self.server.metrics
        metrics.request_done(self.endpoint, status)
        if status == 499:
            metrics.aborted(self.endpoint)
            if self.result is None:  # finish() never ran
                metrics.add(prompt_tokens=len(self.job.prompt_ids), generation_tokens=self.n_out)

    def feed(self, step: RequestOutput) -> Delta:
        metrics = self.server.metrics
        if self.n_out == 0 and step.token_ids:
            metrics.observe("ttft", time.perf_counter() - self.job.arrived)
        if self.job.speculative and step.accepted is not None:
            metrics.observe("accepted_per_step", step.accepted + 1)
        self.n_out += len(step.token_ids)
        self.token_ids += step.token_ids
        if self.logprobs is not None and step.logprobs is not None:
            self.step_logprobs = self.logprobs.add(step.token_ids, step.logprobs)
        delta = self.parser.feed(list(step.token_ids))
        if self.parser.stopped:
            self.job.abort()  # a stop string ended the answer: free the engine now
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
        return self.parser.finish()

    def finish_reason(self) -> str:
        reason = self.result.finish_reason if self.result else "stop"
        if self.parser.n_calls and (reason != "length" or self.parser.stopped):
            return "tool_calls"
        if self.parser.stopped:
            return "stop"
        return "length" if reason == "length" else "stop"

    def usage(self) -> dict:
        cached = self.result.cached_prompt_tokens if self.result else 0
        return usage(len(self.job.prompt_ids), self.n_out, cached)

    async def first_event(self, request: Request) -> tuple[str, Any]:
        """Wait for the engine to start (so that an engine-side rejection can still become a 4xx)."""
        kind, payload = await next_event(self.job, request)
        if kind == "error":
            raise payload
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


async def stream_events(gen: Generation, request: Request, first: tuple[str, Any],
                        include_usage: bool) -> AsyncIterator[bytes]:
    model = gen.server.model_id
    chat = gen.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict, **extra: Any) -> bytes:
        body = {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": [choice]}
        if include_usage:
            body["usage"] = None
        body.update(extra)
        return sse(body)

    def choice(delta: Delta, finish: str | None = None, ids: tuple[int, ...] = (),
               logprobs: dict | None = None) -> dict | None:
        extra = (gen.return_ids and ids) or logprobs is not None  # a chunk even without text
        if chat:
            d = _delta_json(delta, gen)
            if not d and finish is None and not extra:
                return None
            out = {"index": 0, "delta": d, "logprobs": logprobs, "finish_reason": finish}
        else:
            if not delta.content and finish is None and not extra:
                return None
            out = {"index": 0, "text": delta.content, "logprobs": logprobs, "finish_reason": finish}
        if gen.return_ids:
            out["token_ids"] = list(ids)
        return out

    try:
        if chat:
            yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None})
        kind, payload = first
        while True:
            if kind == "tokens":
                delta = gen.feed(payload)
                c = choice(delta, ids=payload.token_ids, logprobs=gen.step_logprobs)
                gen.step_logprobs = None
                if c:
                    yield chunk(c)
            elif kind == "done":
                tail = gen.finish(payload)
                c = choice(tail)
                if c:
                    yield chunk(c)
                yield chunk(choice(Delta(), gen.finish_reason()))
                if include_usage:
                    body = {"id": gen.id, "object": obj, "created": gen.created, "model": model, "choices": [],
                            "usage": gen.usage()}
                    yield sse(body)
                gen.record(200)
                break
            else:
                err: APIError = payload
                yield sse(err.body())
                gen.record(err.status)
                break
            kind, payload = await next_event(gen.job, request)
        yield sse("[DONE]")
    except ClientGone:
        pass
    finally:
        # Also reached when the server cancels this generator (the client disconnected while a chunk was being
        # sent, or shutdown): the request then still counts as aborted.
        gen.record(499)
        gen.job.abort()  # no-op after a normal end; stops the engine when the client went away


async def serve_generation(server: Any, request: Request, gen: Generation, stream: bool,
                           include_usage: bool) -> Any:
    submit(server, gen.job)
    try:
        first = await gen.first_event(request)
    except ClientGone:
        gen.record(499)
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    except BaseException:
        gen.job.abort()
        raise
    if stream:
        return StreamingResponse(stream_events(gen, request, first, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        total = await run_to_end(gen, request, first)
    except ClientGone:
        gen.record(499)
        return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)
    finally:
        gen.job.abort()
    base = {"id": gen.id, "created": gen.created, "model": server.model_id, "usage": gen.usage()}
    logprobs = gen.logprobs.total() if gen.logprobs is not None else None
    if gen.kind == "chat":
        body = {"object": "chat.completion", **base, "choices": [
            {"index": 0, "message": chat_message(total), "logprobs": logprobs, "finish_reason": gen.finish_reason()}]}
    else:
        body = {"object": "text_completion", **base, "choices": [
            {"index": 0, "text": total.content, "logprobs": logprobs, "finish_reason": gen.finish_reason()}]}
    if gen.return_ids:
        body["choices"][0].update(token_ids=gen.token_ids, prompt_token_ids=list(gen.job.prompt_ids))
    gen.record(200)
    return JSONResponse(body)


async def chat_completions(server: Any, req: ChatCompletionRequest, request: Request) -> Any:
    check_unsupported(req)
    messages = template_messages(req.messages)
    tools = validate_tools(req.tools)
    mode, forced = tool_choice_mode(req.tool_choice, tools)
    thinking = thinking_enabled(req)
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items()
             if k not in ("messages", "tools", "add_generation_prompt", "bos_token", "enable_thinking")}
    prefill = {"required": "call:", "named": f"call:{forced}{{"}.get(mode)

    def render() -> str:
        prompt = server.template.render(messages, tools if mode != "none" else None, add_generation_prompt=True,
                                        enable_thinking=thinking, **extra)
        # force a tool call by opening it in the prompt (no constrained decoding needed)
        return prompt if prefill is None else prompt + "<|tool_call>" + prefill
    ids = await prompt_ids(server, render)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    parser = OutputParser(server.decode, server.controls, parse_tools=mode != "none",
                          stop=stop_list(req.stop), prefill_tool=prefill,
                          max_calls=1 if req.parallel_tool_calls is False else None)
    grammar = tool_call_grammar(tools, mode, forced, server)  # None unless a call is forced and can be constrained
    if grammar is not None and req.response_format not in (None, {"type": "text"}):
        raise APIError("response_format cannot be combined with a forced tool_choice", param="response_format")
    job = Job(ids, max_new_tokens(requested, len(ids), server.caps.max_context),
              sampling_params(req, server.generation_defaults, server.caps.vocab_size,
                              grammar or response_grammar(req.response_format, server, thinking)),
              server.stop_ids, speculative=server.speculative)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    gen = Generation(server, job, parser, "chat")
    gen.return_ids = bool(req.return_token_ids)
    return await serve_generation(server, request, gen, bool(req.stream), include_usage)


async def completions(server: Any, req: CompletionRequest, request: Request) -> Any:
    check_unsupported(req)
    if req.echo:
        raise APIError("echo is not supported", param="echo")
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError("only best_of=1 is supported", param="best_of")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        bos = server.template.bos_token
        ids = await prompt_ids(server, lambda: prompt if prompt.startswith(bos) else bos + prompt, param="prompt")
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < server.tokenizer.vocab_size]
        if bad:
            raise APIError(f"prompt token ids {bad[:5]} are outside the vocabulary", param="prompt")
    if not ids:
        raise APIError("the prompt is empty", param="prompt")
    controls = ControlIds(channel_open=-1, channel_close=-1, tool_call_open=-1, tool_call_close=-1, string_delim=-1,
                          stops=server.stop_ids, hidden=server.tokenizer.special_ids)
    parser = OutputParser(server.decode, controls, parse_tools=False, stop=stop_list(req.stop))
    limit = max_new_tokens(req.max_tokens, len(ids), server.caps.max_context)
    job = Job(ids, limit if req.max_tokens is not None else min(16, limit),  # OpenAI's default for completions
              sampling_params(req, server.generation_defaults, server.caps.vocab_size,
                              response_grammar(req.response_format, server, False)),
              server.stop_ids, speculative=server.speculative)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    gen = Generation(server, job, parser, "completion")
    gen.return_ids = bool(req.return_token_ids)
    return await serve_generation(server, request, gen, bool(req.stream), include_usage)
