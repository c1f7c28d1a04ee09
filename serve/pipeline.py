"""Serve stage: the one path of every generation request: a GenerationRequest -> its prompt ids (chat template or
raw prompts), grammar, sampling and token budget -> engine jobs (n choices per prompt), ready to start; the APIs
only translate their wire formats to and from it."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from ..runtime.backend import ImageInput, ImageSpan, SamplingParams
from ..runtime.media.prompts import ImagePlaceholderError, expand_image_tokens, expand_video_text, video_frames
from ..runtime.media.video import VideoInput
from ..runtime.text.grammar import Grammar
from .context import ServerContext
from .generation import Generation, Job, choices
from .guards import prompt_ids
from .media import check_count
from .parser import ControlIds, OutputParser
from .protocol import APIError
from .request import GenerationRequest, ImageSource, Prompt
from .sampling import max_new_tokens, sampling_params, speculation
from .structured import format_grammar
from .tool_grammar import tool_call_grammar
from .tool_schemas import template_tools
from .vllm_extras import kept_prompt


def forced_call(req: GenerationRequest) -> str | None:
    """The opening of the call a forced tool_choice puts at the end of the prompt (its arguments then follow the
    tools' grammar), or None."""
    return {"required": "call:", "named": f"call:{req.forced_tool}{{"}.get(req.tool_mode)


def with_video_layout(ctx: ServerContext, text: str, videos: list[VideoInput], param: str = "messages") -> str:
    """The rendered prompt with each video's `<|video|>` replaced by its frames' layout (timestamps, one
    placeholder per frame); a 400 when the text holds more or fewer `<|video|>` than the request has videos."""
    vision = ctx.caps.vision
    if not videos or vision is None:
        return text
    try:
        return expand_video_text(text, videos, lambda i: ctx.tokenizer.id_to_token(i) or "", vision)
    except ImagePlaceholderError as exc:
        raise APIError(f"{exc}: message text must not contain the video token", param=param) from None


async def conversation_prompt(ctx: ServerContext, req: GenerationRequest) -> tuple[list[int], list[ImageSpan]]:
    """The prompt ids of a conversation request, exactly as it is generated from (the chat template with the tools,
    the thinking switch and a forced call's opening; each image's placeholder expanded, each video's frames laid
    out), and the image and frame spans."""
    messages = req.messages
    if messages is None:
        raise ValueError("a raw-prompt request has no conversation to render")
    forced = forced_call(req)
    ctx.images.prefetch(req.images, req.image_budget)  # decoding while the videos load and the prompt is rendered
    videos = await ctx.videos.load(req.videos, req.video_sampling)

    def render() -> str:
        prompt = ctx.template.render(
            messages,
            template_tools(req.tools) if req.tool_mode != "none" else None,
            add_generation_prompt=True,
            enable_thinking=req.thinking,
            **req.template_kwargs,
        )
        prompt = with_video_layout(ctx, prompt, videos, req.prompt_field)
        prompt += req.assistant_prefill or ""
        return prompt if forced is None else prompt + "<|tool_call>" + forced

    ids = await prompt_ids(ctx, render, param=req.prompt_field)
    return await with_images(ctx, req.images, req.image_budget, ids, req.prompt_field, video_frames(videos))


async def _raw_prompt_ids(ctx: ServerContext, prompt: Prompt) -> list[int]:
    where = prompt.where
    if prompt.text is not None:
        bos, text = ctx.template.bos_token, prompt.text
        ids = await prompt_ids(ctx, lambda: text if text.startswith(bos) else bos + text, param=where)
    else:
        ids = list(prompt.ids or ())
        vocab = ctx.tokenizer.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(f"{where}: token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}", param=where)
    if not ids:
        raise APIError(f"{where} is empty", param=where)
    return ids


async def with_images(
    ctx: ServerContext,
    images: list[ImageSource],
    budget: int | None,
    ids: list[int],
    param: str = "messages",
    frames: list[ImageInput] | None = None,
) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image's one placeholder expanded into boi + its soft tokens + eoi and each video
    frame's (with_video_layout) into its soft tokens, and the spans; the images are read and preprocessed once,
    after the placeholders are known to match them."""
    frames = frames or []
    vision = ctx.caps.vision
    if images:
        check_count(vision, ctx.media, images, "image")
    if vision is None:
        return ids, []
    found = ids.count(vision.image_token_id)
    if found != len(images):
        token = ctx.tokenizer.id_to_token(vision.image_token_id)
        raise APIError(
            f"the prompt holds {found} image placeholder(s) but the request has {len(images)} "
            f"image(s): message text must not contain the image token {token!r}",
            param=param,
        )
    found = ids.count(vision.video_token_id)
    if found != len(frames):
        token = ctx.tokenizer.id_to_token(vision.video_token_id)
        raise APIError(
            f"the prompt holds {found} video frame placeholder(s) but the request's videos have {len(frames)} "
            f"frame(s): message text must not contain the video token {token!r}",
            param=param,
        )
    if not images and not frames:
        return ids, []
    return expand_image_tokens(ids, await ctx.images.load(images, budget), vision, frames)


def _budget(req: GenerationRequest, n_prompt: int, max_context: int, param: str) -> int:
    # max_tokens 0 (score only) still runs one token: the engine scores a prompt while it prefills for a first one
    requested = 1 if req.score_only else req.max_tokens
    limit = max_new_tokens(requested, n_prompt, max_context, param=param, budget=req.max_tokens_field)
    return limit if requested is not None or req.default_max_tokens is None else min(req.default_max_tokens, limit)


def _stop_ids(ctx: ServerContext, req: GenerationRequest) -> frozenset[int]:
    """The ids that end the answer: the checkpoint's (unless ignore_eos) and the request's stop_token_ids."""
    vocab = ctx.caps.vocab_size
    bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
    if bad:
        raise APIError(f"stop_token_ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}", param="stop_token_ids")
    return (frozenset() if req.ignore_eos else ctx.stop_ids) | frozenset(req.stop_token_ids)


def _one_grammar(
    ctx: ServerContext, req: GenerationRequest, tools_grammar: Grammar | None, forced_call: bool
) -> Grammar | None:
    """The one grammar a request decodes under: a forced call's, or the guided-decoding field's, or the output
    format's, or an auto tool call's (the first three exclude one another)."""
    fmt, guided = req.output_format, req.guided
    forced = tools_grammar if forced_call else None
    if forced is not None and fmt is not None:
        raise APIError(f"{fmt.param} cannot be combined with a forced tool_choice", param=fmt.param)
    if guided is not None:
        if forced is not None or fmt is not None:
            raise APIError(
                "guided decoding cannot be combined with response_format or a forced tool_choice",
                param="structured_outputs",
            )
        if not ctx.caps.constrained:
            raise APIError(
                f"{guided.param} needs grammar-constrained decoding, which this engine cannot run", param=guided.param
            )
    grammar = (
        forced or format_grammar(guided, ctx, req.thinking) or format_grammar(fmt, ctx, req.thinking) or tools_grammar
    )
    if req.ignore_eos and grammar is not None and grammar.trigger is None:
        raise APIError(
            "ignore_eos cannot be combined with a grammar (response_format, guided decoding or a forced "
            "tool_choice): the grammar ends the answer",
            param="ignore_eos",
        )
    return grammar


async def prepare(ctx: ServerContext, req: GenerationRequest, endpoint: str) -> list[Generation]:
    """The request's generations (prompt-major, n per prompt), ready to start; every mistake a 400. The time it
    took (images decoded and preprocessed included) goes to the server's `prepare` histogram."""
    started = time.perf_counter()
    stop_ids = _stop_ids(ctx, req)
    keep = req.truncate_prompt_tokens
    keep = ctx.caps.max_context if keep == -1 else keep
    images: list[ImageSpan] = []
    prompts: list[tuple[str, list[int], str | None]] = []  # (the field errors name, prompt ids, echoed text)
    if req.messages is not None:
        if (req.images or req.videos) and keep is not None:
            raise APIError(
                "truncate_prompt_tokens cannot be combined with images or videos (it could cut their tokens)",
                param="truncate_prompt_tokens",
            )
        ids, images = await conversation_prompt(ctx, req)
        # the tools' grammar: None unless a call can happen and the backend can constrain it
        tools_grammar = tool_call_grammar(req.tools, req.tool_mode, req.forced_tool, ctx)
        grammar = _one_grammar(ctx, req, tools_grammar, forced_call=forced_call(req) is not None)
        prompts.append((req.prompt_field, kept_prompt(ids, keep), None))
    else:
        grammar = _one_grammar(ctx, req, None, forced_call=False)
        for p in req.prompts or ():
            sent = await _raw_prompt_ids(ctx, p)
            ids = kept_prompt(sent, keep)
            # echo: a text prompt as sent, token ids (or a truncated prompt) decoded (as vLLM does)
            echo = (p.text if p.text is not None and ids is sent else ctx.tokenizer.decode(ids)) if req.echo else None
            prompts.append((p.where, ids, echo))
    sampling = sampling_params(req.sampling, ctx.generation_defaults, ctx.caps.vocab_size, grammar)
    speculative, sampling = speculation(req.sampling, ctx, sampling)
    if req.echo and sampling.logprobs is not None:  # only then: scoring the prompt costs a full-logits prefill
        sampling = replace(sampling, prompt_logprobs=sampling.logprobs)
    if req.parse_output:
        controls = replace(ctx.controls, stops=ctx.controls.stops | stop_ids)
    else:  # raw text: every special token is hidden, nothing is parsed out
        controls = ControlIds(
            channel_open=-1,
            channel_close=-1,
            tool_call_open=-1,
            tool_call_close=-1,
            string_delim=-1,
            stops=ctx.stop_ids | stop_ids,
            hidden=ctx.tokenizer.special_ids,
        )

    def maker(where: str, ids: list[int], echo: str | None) -> Callable[[SamplingParams], Generation]:
        limit = _budget(req, len(ids), ctx.caps.max_context, where)

        def make(sampling: SamplingParams) -> Generation:
            parser = OutputParser(
                ctx.decode,
                controls,
                parse_tools=req.parse_output and req.tool_mode != "none",
                stop=req.stop,
                prefill_tool=forced_call(req),
                max_calls=None if req.parallel_tool_calls else 1,
            )
            job = Job(ids, limit, sampling, stop_ids, speculative=speculative, images=tuple(images))
            return Generation(
                ctx.metrics,
                job,
                parser,
                endpoint,
                echo=echo,
                score_only=req.score_only,
                prompt_scores_apart=req.sampling.prompt_logprobs is not None,
            )

        return make

    gens = choices(req.n, [maker(*p) for p in prompts], sampling)
    ctx.metrics.observe("prepare", time.perf_counter() - started)
    return gens
