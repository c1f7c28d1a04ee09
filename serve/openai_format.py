"""Serve stage: OpenAI's chat and completions answers: a request's generations as one JSON body or as SSE chunks,
with OpenAI's usage."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .generation import ClientGone, Generation, deltas, sse
from .parser import Delta
from .pipeline import client_gone, collect, start
from .protocol import APIError
from .vllm_extras import prompt_logprobs_json


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


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
        async for i, kind, payload, delta in deltas(gens, request, firsts):
            g = gens[i]
            if kind == "tokens":
                c = choice(i, delta, ids=() if g.score_only else payload.token_ids, logprobs=g.step_logprobs)
                g.step_logprobs = None
                if c:
                    yield chunk(c)
            elif kind == "done":
                c = choice(i, delta)
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
    firsts = await start(server, request, gens)
    if firsts is None:
        return client_gone()
    if stream:
        return StreamingResponse(stream_events(gens, request, firsts, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    totals = await collect(gens, request, firsts)
    if totals is None:
        return client_gone()
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
