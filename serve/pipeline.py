"""Serve stage: the one path of every generation request: a GenerationRequest -> its prompt ids (chat template or
raw prompts), grammar, sampling and token budget -> engine jobs (n choices per prompt), started and read to the
end; the APIs only translate their wire formats to and from it."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse

from ..runtime.backend import ImageSpan
from ..runtime.client import SamplingParams
from ..runtime.media.prompts import expand_image_tokens
from .generation import ClientGone, Generation, Job, choices, run_to_end, submit
from .guards import prompt_ids
from .media import check_count, load_images
from .parser import ControlIds, Delta, OutputParser
from .protocol import APIError
from .request import GenerationRequest, ImageSource, Prompt
from .sampling import max_new_tokens, sampling_params, speculation
from .structured import format_grammar
from .tool_grammar import tool_call_grammar
from .tool_schemas import template_tools
from .vllm_extras import kept_prompt


def _render(server: Any, req: GenerationRequest, prefill: str | None) -> Callable[[], str]:
    def render() -> str:
        prompt = server.template.render(req.messages, template_tools(req.tools) if req.tool_mode != "none" else None,
                                        add_generation_prompt=True, enable_thinking=req.thinking,
                                        **req.template_kwargs)
        # force a tool call by opening it in the prompt (its arguments then follow the tools' grammar)
        return prompt if prefill is None else prompt + "<|tool_call>" + prefill
    return render


async def _raw_prompt_ids(server: Any, prompt: Prompt) -> list[int]:
    where = prompt.where
    if prompt.text is not None:
        bos, text = server.template.bos_token, prompt.text
        ids = await prompt_ids(server, lambda: text if text.startswith(bos) else bos + text, param=where)
    else:
        ids = list(prompt.ids or ())
        vocab = server.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{where}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param=where)
    if not ids:
        raise APIError(f"{where} is empty", param=where)
    return ids


async def with_images(server: Any, images: list[ImageSource], budget: int | None, ids: list[int]
                      ) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image's one placeholder expanded into boi + its soft tokens + eoi, and the spans; the
    images are read and preprocessed once, after the placeholders are known to match them."""
    if images:
        check_count(server, images)
    vision = server.caps.vision
    if vision is None:
        return ids, []
    found = ids.count(vision.image_token_id)
    if found != len(images):
        token = server.tokenizer.id_to_token(vision.image_token_id)
        raise APIError(f"the prompt holds {found} image placeholder(s) but the request has {len(images)} "
                       f"image(s): message text must not contain the image token {token!r}", param="messages")
    if not images:
        return ids, []
    return expand_image_tokens(ids, await load_images(server, images, budget), vision)


def _budget(req: GenerationRequest, n_prompt: int, max_context: int, param: str) -> int:
    # max_tokens 0 (score only) still runs one token: the engine scores a prompt while it prefills for a first one
    requested = 1 if req.score_only else req.max_tokens
    limit = max_new_tokens(requested, n_prompt, max_context, param=param)
    return limit if requested is not None or req.default_max_tokens is None else min(req.default_max_tokens, limit)


def _stop_ids(server: Any, req: GenerationRequest) -> frozenset[int]:
    """The ids that end the answer: the checkpoint's (unless ignore_eos) and the request's stop_token_ids."""
    vocab = server.caps.vocab_size
    bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"stop_token_ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}", param="stop_token_ids")
    return (frozenset() if req.ignore_eos else server.stop_ids) | frozenset(req.stop_token_ids)


def _one_grammar(server: Any, req: GenerationRequest, tools_grammar: Any, forced_call: bool) -> Any:
    """The one grammar a request decodes under: a forced call's, or the guided-decoding field's, or the output
    format's, or an auto tool call's (the first three exclude one another)."""
    fmt, guided = req.output_format, req.guided
    forced = tools_grammar if forced_call else None
    if forced is not None and fmt is not None:
        raise APIError(f"{fmt.param} cannot be combined with a forced tool_choice", param=fmt.param)
    if guided is not None:
        if forced is not None or fmt is not None:
            raise APIError("guided decoding cannot be combined with response_format or a forced tool_choice",
                           param="structured_outputs")
        if not server.caps.constrained:
            raise APIError(f"{guided.param} needs grammar-constrained decoding, which this engine cannot run",
                           param=guided.param)
    grammar = (forced or format_grammar(guided, server, req.thinking) or format_grammar(fmt, server, req.thinking)
               or tools_grammar)
    if req.ignore_eos and grammar is not None and grammar.trigger is None:
        raise APIError("ignore_eos cannot be combined with a grammar (response_format, guided decoding or a forced "
                       "tool_choice): the grammar ends the answer", param="ignore_eos")
    return grammar


async def prepare(server: Any, req: GenerationRequest, endpoint: str) -> list[Generation]:
    """The request's generations (prompt-major, n per prompt), ready to start; every mistake a 400."""
    stop_ids = _stop_ids(server, req)
    keep = req.truncate_prompt_tokens
    keep = server.caps.max_context if keep == -1 else keep
    prefill, images = None, []
    if req.messages is not None:
        if req.images and keep is not None:
            raise APIError("truncate_prompt_tokens cannot be combined with images (it could cut an image's tokens)",
                           param="truncate_prompt_tokens")
        prefill = {"required": "call:", "named": f"call:{req.forced_tool}{{"}.get(req.tool_mode)
        ids, images = await with_images(server, req.images, req.image_budget,
                                        await prompt_ids(server, _render(server, req, prefill)))
        ids = kept_prompt(ids, keep)
        # the tools' grammar: None unless a call can happen and the backend can constrain it
        tools_grammar = tool_call_grammar(req.tools, req.tool_mode, req.forced_tool, server)
        grammar = _one_grammar(server, req, tools_grammar, forced_call=prefill is not None)
        prompts = [("messages", ids, None)]
    else:
        grammar = _one_grammar(server, req, None, forced_call=False)
        prompts = []
        for p in req.prompts:
            sent = await _raw_prompt_ids(server, p)
            ids = kept_prompt(sent, keep)
            # echo: a text prompt as sent, token ids (or a truncated prompt) decoded (as vLLM does)
            echo = (p.text if p.text is not None and ids is sent else server.tokenizer.decode(ids)) if req.echo \
                else None
            prompts.append((p.where, ids, echo))
    sampling = sampling_params(req.sampling, server.generation_defaults, server.caps.vocab_size, grammar)
    speculative, sampling = speculation(req.sampling, server, sampling)
    if req.echo and sampling.logprobs is not None:  # only then: scoring the prompt costs a full-logits prefill
        sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
    if req.parse_output:
        controls = replace(server.controls, stops=server.controls.stops | stop_ids)
    else:  # raw text: every special token is hidden, nothing is parsed out
        controls = ControlIds(channel_open=-1, channel_close=-1, tool_call_open=-1, tool_call_close=-1,
                              string_delim=-1, stops=server.stop_ids | stop_ids, hidden=server.tokenizer.special_ids)
    kind = "chat" if req.messages is not None else "completion"

    def maker(where: str, ids: list[int], echo: str | None) -> Callable[[SamplingParams], Generation]:
        limit = _budget(req, len(ids), server.caps.max_context, where)

        def make(sampling: SamplingParams) -> Generation:
            parser = OutputParser(server.decode, controls, parse_tools=req.parse_output and req.tool_mode != "none",
                                  stop=req.stop, prefill_tool=prefill,
                                  max_calls=None if req.parallel_tool_calls else 1)
            job = Job(ids, limit, sampling, stop_ids, speculative=speculative, images=tuple(images))
            gen = Generation(server, job, parser, kind, endpoint)
            gen.return_ids, gen.echo, gen.score_only = req.return_token_ids, echo, req.score_only
            gen.reports_prompt_logprobs = req.sampling.prompt_logprobs is not None
            return gen
        return make
    return choices(req.n, [maker(*p) for p in prompts], sampling)


def client_gone() -> JSONResponse:
    return JSONResponse({"error": {"message": "client disconnected"}}, status_code=499)


async def start(server: Any, request: Request, gens: list[Generation]) -> list[tuple[str, Any]] | None:
    """Submit every generation and wait for each one's first event (so that an engine-side rejection can still
    become a 4xx); None when the client left meanwhile (recorded as 499)."""
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
        return None
    except BaseException:
        for g in gens:
            g.job.abort()
        raise
    return firsts


async def collect(gens: list[Generation], request: Request, firsts: list[tuple[str, Any]]) -> list[Delta] | None:
    """Every generation's whole answer (non-streamed); None when the client left (recorded as 499)."""
    try:
        return list(await asyncio.gather(*(run_to_end(g, request, f) for g, f in zip(gens, firsts))))
    except ClientGone:
        for g in gens:
            g.record(499)
        return None
    finally:
        for g in gens:
            g.job.abort()
