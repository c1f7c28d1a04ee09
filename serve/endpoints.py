"""Serve stage: the two OpenAI generation endpoints, /v1/chat/completions and /v1/completions: each request becomes
a GenerationRequest (serve/request.py), runs on serve/pipeline.py, and is answered by serve/answer.py in the shapes
of serve/openai_format.py."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from .answer import answer
from .context import ServerContext
from .media import media_kwargs
from .openai_format import OpenAIAdapter
from .pipeline import prepare
from .protocol import MAX_CHOICES, APIError, ChatCompletionRequest, CompletionRequest, check_unsupported, stop_list
from .conversation import template_messages, tool_choice_mode, validate_tools
from .request import GenerationRequest, ImageSource, Prompt, VideoSource
from .sampling import sampling_options, thinking_enabled
from .structured import output_format
from .vllm_extras import legacy_functions, vllm_fields

RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "enable_thinking")


def chat_request(req: ChatCompletionRequest) -> GenerationRequest:
    check_unsupported(req)
    legacy_functions(req)
    images: list[ImageSource] = []
    videos: list[VideoSource] = []
    messages = template_messages(req.messages, images, videos)
    budget, video_sampling = media_kwargs(req.mm_processor_kwargs)
    tools = validate_tools(req.tools)
    mode, forced = tool_choice_mode(req.tool_choice, tools)
    thinking = thinking_enabled(req)
    extra = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in RESERVED_TEMPLATE_KWARGS}
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return GenerationRequest(
        messages=messages,
        images=images,
        image_budget=budget,
        videos=videos,
        video_sampling=video_sampling,
        tools=tools,
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        thinking=thinking,
        template_kwargs=extra,
        sampling=sampling_options(req),
        output_format=output_format(req.response_format),
        stop=stop_list(req.stop),
        max_tokens=max_tokens,
        n=req.n or 1,
        return_token_ids=bool(req.return_token_ids),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        max_tokens_field="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
        **vllm_fields(req, max_tokens),
    )


def _prompts(prompt: str | list[Any]) -> list[Prompt]:
    """The request's prompts, each with the field its errors name: one text or token-id list, or a list of them."""

    def one(where: str, p: str | list[int]) -> Prompt:
        return Prompt(where, text=p) if isinstance(p, str) else Prompt(where, ids=tuple(p))

    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        return [one("prompt", prompt)]
    if not prompt:
        raise APIError("prompt must not be an empty list", param="prompt")
    return [one(f"prompt[{i}]", p) for i, p in enumerate(prompt)]


def completion_request(req: CompletionRequest) -> GenerationRequest:
    check_unsupported(req)
    if req.suffix:
        raise APIError("suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError("only best_of=1 is supported", param="best_of")
    if req.max_tokens == 0 and not req.echo:
        raise APIError("max_tokens 0 (score the prompt only) needs echo: true", param="max_tokens")
    prompts, n = _prompts(req.prompt), req.n or 1
    if len(prompts) * n > MAX_CHOICES:  # refused before any tokenizing
        raise APIError(
            f"{len(prompts)} prompts x n={n} = {len(prompts) * n} choices; at most {MAX_CHOICES} per request",
            param="prompt",
        )
    return GenerationRequest(
        prompts=prompts,
        sampling=sampling_options(req),
        output_format=output_format(req.response_format),
        stop=stop_list(req.stop),
        max_tokens=req.max_tokens,
        default_max_tokens=16,  # OpenAI's default
        n=n,
        parse_output=False,
        echo=bool(req.echo),
        score_only=req.max_tokens == 0,
        return_token_ids=bool(req.return_token_ids),
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        # max_tokens 0 still runs one token: the engine scores a prompt while it prefills for a first token
        **vllm_fields(req, 1 if req.max_tokens == 0 else req.max_tokens),
    )


async def chat_completions(ctx: ServerContext, req: ChatCompletionRequest, request: Request) -> Response:
    gen_req = chat_request(req)
    gens = await prepare(ctx, gen_req, "/v1/chat/completions")
    return await answer(ctx, request, OpenAIAdapter(ctx, gens, gen_req))


async def completions(ctx: ServerContext, req: CompletionRequest, request: Request) -> Response:
    gen_req = completion_request(req)
    gens = await prepare(ctx, gen_req, "/v1/completions")
    return await answer(ctx, request, OpenAIAdapter(ctx, gens, gen_req))
