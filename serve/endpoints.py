"""Serve stage: the two generation endpoints, /v1/chat/completions and /v1/completions: a request -> its prompt ids,
parser and sampling -> its choices (n per prompt; completions take several prompts, and echo them), run by
serve/generation.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from fastapi import Request

from ..runtime.client import SamplingParams
from .generation import Generation, Job, choices, serve_generation
from .guards import prompt_ids
from .parser import ControlIds, OutputParser
from .protocol import (MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest, check_unsupported,
                       stop_list, template_messages, tool_choice_mode, validate_tools)
from .sampling import max_new_tokens, sampling_params, speculation, thinking_enabled
from .structured import response_grammar
from .tool_grammar import tool_call_grammar
from .tool_schemas import template_tools
from .vllm_extras import VllmExtras, kept_prompt, legacy_functions, vllm_extras


async def chat_completions(server: Any, req: ChatCompletionRequest, request: Request) -> Any:
    check_unsupported(req)
    legacy_functions(req)
    messages = template_messages(req.messages)
    tools = validate_tools(req.tools)
    mode, forced = tool_choice_mode(req.tool_choice, tools)
    thinking = thinking_enabled(req)
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items()
             if k not in ("messages", "tools", "add_generation_prompt", "bos_token", "enable_thinking")}
    prefill = {"required": "call:", "named": f"call:{forced}{{"}.get(mode)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    extras = vllm_extras(req, server, thinking, requested)
    shown_tools = template_tools(tools) if mode != "none" else None

    def render() -> str:
        prompt = server.template.render(messages, shown_tools, add_generation_prompt=True,
                                        enable_thinking=thinking, **extra)
        # force a tool call by opening it in the prompt (no constrained decoding needed)
        return prompt if prefill is None else prompt + "<|tool_call>" + prefill
    ids = kept_prompt(await prompt_ids(server, render), extras.keep_prompt_tokens)
    # the tools' grammar: None unless a call can happen and the backend can constrain it
    grammar = tool_call_grammar(tools, mode, forced, server)
    grammar = _one_grammar(req, server, thinking, extras, grammar, forced_call=prefill is not None)
    limit = max_new_tokens(requested, len(ids), server.caps.max_context)

    def make(sampling: SamplingParams) -> Generation:
        controls = replace(server.controls, stops=server.controls.stops | extras.stop_ids)
        parser = OutputParser(server.decode, controls, parse_tools=mode != "none",
                              stop=stop_list(req.stop), prefill_tool=prefill,
                              max_calls=1 if req.parallel_tool_calls is False else None)
        gen = Generation(server, Job(ids, limit, sampling, extras.stop_ids, speculative=speculative),
                         parser, "chat")
        gen.return_ids, gen.reports_prompt_logprobs = bool(req.return_token_ids), extras.prompt_logprobs is not None
        return gen
    sampling = replace(sampling_params(req, server.generation_defaults, server.caps.vocab_size, grammar),
                       **extras.sampling_fields())
    speculative, sampling = speculation(req, server, sampling)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await serve_generation(server, request, choices(req.n or 1, [make], sampling), bool(req.stream),
                                  include_usage)


def _one_grammar(req: Any, server: Any, thinking: bool, extras: VllmExtras, tools_grammar: Any,
                 forced_call: bool) -> Any:
    """The one grammar a request decodes under: a forced call's, or the guided-decoding field's, or
    response_format's, or an auto tool call's (the first two or three together are refused)."""
    formatted = req.response_format not in (None, {"type": "text"})
    forced = tools_grammar if forced_call else None
    if forced is not None and formatted:
        raise APIError("response_format cannot be combined with a forced tool_choice", param="response_format")
    if extras.grammar is not None and (forced is not None or formatted):
        raise APIError("guided decoding cannot be combined with response_format or a forced tool_choice",
                       param="structured_outputs")
    grammar = forced or extras.grammar or response_grammar(req.response_format, server, thinking) or tools_grammar
    if req.ignore_eos and grammar is not None and grammar.trigger is None:
        raise APIError("ignore_eos cannot be combined with a grammar (response_format, guided decoding or a forced "
                       "tool_choice): the grammar ends the answer", param="ignore_eos")
    return grammar


def _prompts(prompt: str | list) -> list[tuple[str, str | list[int]]]:
    """The request's prompts, each with the field its errors name: one text or token-id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [("prompt", prompt)]
    if not prompt:
        raise APIError("prompt must not be an empty list", param="prompt")
    return [(f"prompt[{i}]", p) for i, p in enumerate(prompt)]


async def _prompt_ids(server: Any, where: str, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        bos = server.template.bos_token
        ids = await prompt_ids(server, lambda: prompt if prompt.startswith(bos) else bos + prompt, param=where)
    else:
        ids = list(prompt)
        vocab = server.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{where}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param=where)
    if not ids:
        raise APIError(f"{where} is empty", param=where)
    return ids


async def completions(server: Any, req: CompletionRequest, request: Request) -> Any:
    check_unsupported(req)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError("only best_of=1 is supported", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens 0 (score the prompt only) needs echo: true", param="max_tokens")
    prompts, n = _prompts(req.prompt), req.n or 1
    if len(prompts) * n > MAX_CHOICES:  # refused before any tokenizing
        raise APIError(f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most {MAX_CHOICES} per "
                       "request", param="prompt")
    # max_tokens 0 still runs one token: the engine scores a prompt while it prefills for a first token
    requested = 1 if req.max_tokens == 0 else req.max_tokens
    extras = vllm_extras(req, server, False, requested)
    controls = ControlIds(channel_open=-1, channel_close=-1, tool_call_open=-1, tool_call_close=-1, string_delim=-1,
                          stops=server.stop_ids | extras.stop_ids, hidden=server.tokenizer.special_ids)
    grammar = _one_grammar(req, server, False, extras, None, forced_call=False)
    sampling = replace(sampling_params(req, server.generation_defaults, server.caps.vocab_size, grammar),
                       **extras.sampling_fields())
    speculative, sampling = speculation(req, server, sampling)
    if req.echo and sampling.logprobs is not None:  # only then: scoring the prompt costs a full-logits prefill
        sampling = replace(sampling, prompt_logprobs=sampling.logprobs)

    def maker(where: str, ids: list[int], echo: str | None) -> Callable[[SamplingParams], Generation]:
        limit = max_new_tokens(requested, len(ids), server.caps.max_context, param=where)
        limit = limit if requested is not None else min(16, limit)  # OpenAI's default for completions

        def make(sampling: SamplingParams) -> Generation:
            parser = OutputParser(server.decode, controls, parse_tools=False, stop=stop_list(req.stop))
            gen = Generation(server, Job(ids, limit, sampling, extras.stop_ids, speculative=speculative),
                             parser, "completion")
            gen.return_ids, gen.echo, gen.score_only = bool(req.return_token_ids), echo, req.max_tokens == 0
            gen.reports_prompt_logprobs = extras.prompt_logprobs is not None
            return gen
        return make
    makers = []
    for where, prompt in prompts:
        sent = await _prompt_ids(server, where, prompt)
        ids = kept_prompt(sent, extras.keep_prompt_tokens)
        # echo: a text prompt as sent, token ids (or a truncated prompt) decoded (as vLLM does)
        echo = (prompt if isinstance(prompt, str) and ids is sent else server.tokenizer.decode(ids)) if req.echo \
            else None
        makers.append(maker(where, ids, echo))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return await serve_generation(server, request, choices(n, makers, sampling), bool(req.stream), include_usage)
