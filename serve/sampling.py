"""Serve stage: generation fields -> engine values: OpenAI's sampling fields -> SamplingOptions, SamplingOptions ->
SamplingParams (sampler, penalties, logit_bias, logprobs, grammar), the token budget and the thinking switch; every
bad value a 400 that names its field."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from ..runtime.backend import MAX_TOP_LOGPROBS, SamplingParams
from ..runtime.text.grammar import Grammar
from .context import ServerContext
from .protocol import REASONING_EFFORTS, APIError, ChatCompletionRequest, _Sampling
from .request import SamplingOptions


def _int(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(f"{name} must be an integer in {low}..{high}", param=name)
    return value


def logprobs_count(req: _Sampling) -> int | None:
    """None: no logprobs; else how many top entries per token. Chat: `logprobs` true + `top_logprobs` 0..20;
    completions: `logprobs` 0..20 (OpenAI allows 5 there; vLLM, as here, 20)."""
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs not in (None, True, False):
            raise APIError("logprobs must be true or false", param="logprobs")
        if req.top_logprobs is not None:
            _int(req.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
            if not req.logprobs:
                raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None:
        raise APIError(
            "completions take the number of top logprobs in `logprobs`; top_logprobs is for chat", param="top_logprobs"
        )
    return None if req.logprobs is None else _int(req.logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)


def logit_bias(value: Any, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} -> sorted pairs; ids must lie in the vocabulary (biases are clamped to +-100)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise APIError("logit_bias must be an object mapping token ids to numbers", param="logit_bias")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise APIError(f"logit_bias key {key!r} is not a token id", param="logit_bias") from None
        if not 0 <= token < vocab:
            raise APIError(
                f"logit_bias token id {token} lies outside the vocabulary 0..{vocab - 1}", param="logit_bias"
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise APIError(f"logit_bias[{key!r}] must be a number", param="logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


def sampling_options(req: _Sampling) -> SamplingOptions:
    """The sampler fields of a chat or completions request (logprobs resolved to a count)."""
    return SamplingOptions(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=req.logit_bias,
        logprobs=logprobs_count(req),
        num_speculative_tokens=req.num_speculative_tokens,
        min_tokens=req.min_tokens or 0,
        prompt_logprobs=req.prompt_logprobs,
    )


def sampling_params(
    req: SamplingOptions, defaults: dict[str, float], vocab: int = 1 << 30, grammar: Grammar | None = None
) -> SamplingParams:
    """Request values over the checkpoint's generation_config defaults (as vLLM does)."""

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return defaults.get(name, fallback) if value is None else value

    top_k = int(pick("top_k", 0))
    seed = req.seed if req.seed is not None else random.getrandbits(63)
    try:
        return SamplingParams(
            temperature=float(pick("temperature", 1.0)),
            top_k=max(top_k, 0),
            top_p=float(pick("top_p", 1.0)),
            min_p=float(pick("min_p", 0.0)),
            seed=seed % (1 << 63),
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            repetition_penalty=float(1.0 if req.repetition_penalty is None else req.repetition_penalty),
            logit_bias=logit_bias(req.logit_bias, vocab),
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs,
            min_tokens=req.min_tokens,
            grammar=grammar,
        )
    except ValueError as exc:
        raise APIError(str(exc)) from None


def speculation(req: SamplingOptions, ctx: ServerContext, sampling: SamplingParams) -> tuple[bool, SamplingParams]:
    """(whether the request decodes speculatively, its sampling with the draft cap): the server's setting, or the
    request's num_speculative_tokens."""
    n = req.num_speculative_tokens
    if n is None:
        return ctx.speculative, replace(sampling, draft_tokens=ctx.draft_tokens)
    if n == 0:
        return False, sampling
    if not ctx.caps.speculative:
        raise APIError(
            "num_speculative_tokens > 0 needs speculative decoding, which this model cannot run (no "
            "drafter, or its kernels are missing)",
            param="num_speculative_tokens",
        )
    return True, replace(sampling, draft_tokens=n)


def thinking_enabled(req: ChatCompletionRequest) -> bool:
    kwargs = req.chat_template_kwargs or {}
    if "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        if not isinstance(value, bool):
            raise APIError("chat_template_kwargs.enable_thinking must be true or false", param="chat_template_kwargs")
        return value
    if req.reasoning_effort is not None:
        if req.reasoning_effort not in REASONING_EFFORTS:
            raise APIError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning_effort")
        return REASONING_EFFORTS[req.reasoning_effort]
    return False


def max_new_tokens(
    requested: int | None, prompt_len: int, max_context: int, param: str = "messages", budget: str = "max_tokens"
) -> int:
    """The token budget; `param` names the prompt's field (a prompt that fills the context is its fault), `budget`
    the field that asked for `requested`."""
    if prompt_len >= max_context:
        raise APIError(
            f"this model's maximum context length is {max_context} tokens, but the prompt has "
            f"{prompt_len} tokens; shorten the {param}",
            param=param,
            code="context_length_exceeded",
        )
    room = max_context - prompt_len
    if requested is None:
        return room
    if requested > room:
        raise APIError(
            f"{budget} {requested} + prompt {prompt_len} tokens exceeds the context of {max_context} "
            f"tokens; ask for at most {room} (the server's context is `thorgen serve --ctx`)",
            param=budget,
            code="context_length_exceeded",
        )
    return requested
