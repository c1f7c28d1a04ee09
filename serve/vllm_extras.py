"""Serve stage: vLLM's request extras checked and turned into GenerationRequest fields, or a 400 naming the field.

ignore_eos (no stop on the checkpoint's EOS / end-of-turn ids), stop_token_ids (more stop ids, whose text is left
out as a stop id's is), min_tokens (the stop ids are masked off until that many tokens are out), prompt_logprobs
(the engine's prompt scoring, as completions' echo uses it), the guided decoding fields (`structured_outputs`
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: llguidance grammars like
response_format's), truncate_prompt_tokens (the prompt's last N tokens) and the legacy `functions` /
`function_call` (as tools / tool_choice). serve/pipeline.py turns the fields into engine values; vLLM's
`prompt_logprobs` answer is written here too.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from ..runtime.backend import TokenLogprob
from .protocol import APIError, ChatCompletionRequest, Tool, _Sampling
from .request import OutputFormat

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_STOP_TOKEN_IDS = 64


def _guided_spec(req: _Sampling) -> tuple[str, Any, str] | None:
    """(kind, value, the field that asked) of the one guided-decoding request, or None."""
    asked = []
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(
            k
            for k, v in so.items()
            if v is not None
            and k not in STRUCTURED_KINDS
            and k not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties")
        )
        if unknown:
            raise APIError(
                f"structured_outputs.{unknown[0]} is not supported (supported: {', '.join(STRUCTURED_KINDS)})",
                param="structured_outputs",
            )
        asked += [(k, so[k], f"structured_outputs.{k}") for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
    asked += [(name[len("guided_") :], getattr(req, name), name) for name in GUIDED if getattr(req, name) is not None]
    if req.guided_whitespace_pattern is not None:
        raise APIError(
            "guided_whitespace_pattern is not supported (JSON is written compactly)", param="guided_whitespace_pattern"
        )
    if len(asked) > 1:
        raise APIError(f"give one guided-decoding constraint, not {', '.join(a[2] for a in asked)}", param=asked[1][2])
    return asked[0] if asked else None


def guided_format(req: _Sampling) -> OutputFormat | None:
    """The request's one guided-decoding field as an OutputFormat (a JSON schema or a Lark grammar), or None."""
    spec = _guided_spec(req)
    if spec is None:
        return None
    kind, value, field = spec
    if kind == "json_object":
        return OutputFormat("json_object", param=field)
    if kind == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            raise APIError(f"{field} is not valid JSON", param=field) from None
        if not isinstance(schema, dict):
            raise APIError(f"{field} must be a JSON schema object", param=field)
        return OutputFormat("json_schema", schema, field)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise APIError(f"{field} must be a non-empty regular expression", param=field)
        return OutputFormat("lark", param=field, grammar="start: /" + value.replace("/", "\\/") + "/")
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(f"{field} must be a non-empty list of non-empty strings", param=field)
        return OutputFormat("lark", param=field, grammar="start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str) or not value.strip():  # grammar: llguidance's Lark
        raise APIError(f"{field} must be a Lark grammar (llguidance's dialect)", param=field)
    return OutputFormat("lark", param=field, grammar=value)


def vllm_fields(req: _Sampling, max_tokens: int | None) -> dict[str, Any]:
    """The GenerationRequest fields of the request's vLLM extras (`max_tokens`: its own token limit, if it gave
    one); the checks that need the server (token ids in the vocabulary) are the pipeline's."""
    stop_ids = tuple(sorted(set(req.stop_token_ids or ())))
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise APIError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    if max_tokens is not None and (req.min_tokens or 0) > max_tokens:
        raise APIError(f"min_tokens {req.min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
    if req.prompt_logprobs is not None:
        if req.stream:
            raise APIError("prompt_logprobs come with non-streamed responses only", param="prompt_logprobs")
        if getattr(req, "echo", False) and req.logprobs is not None:
            raise APIError(
                "prompt_logprobs cannot be combined with echo and logprobs (which score the prompt already)",
                param="prompt_logprobs",
            )
    if req.truncate_prompt_tokens == 0:
        raise APIError(
            "truncate_prompt_tokens must be at least 1 (or -1: the model's context length)",
            param="truncate_prompt_tokens",
        )
    return {
        "stop_token_ids": stop_ids,
        "ignore_eos": bool(req.ignore_eos),
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "guided": guided_format(req),
    }


def kept_prompt(ids: list[int], keep: int | None) -> list[int]:
    """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens); all of them when `keep` is None."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def legacy_functions(req: ChatCompletionRequest) -> None:
    """OpenAI's deprecated `functions` / `function_call` moved onto `tools` / `tool_choice` in place."""
    if req.functions is None and req.function_call is None:
        return
    if req.tools is not None or req.tool_choice is not None:
        raise APIError("give tools/tool_choice or the legacy functions/function_call, not both", param="functions")
    if req.functions is not None:
        req.tools = [Tool(type="function", function=f) for f in req.functions]
    call = req.function_call
    if isinstance(call, dict):
        if not isinstance(call.get("name"), str):
            raise APIError("function_call is 'none', 'auto' or {'name': ...}", param="function_call")
        req.tool_choice = {"type": "function", "function": {"name": call["name"]}}
    elif call is not None:
        if call not in ("none", "auto"):
            raise APIError("function_call is 'none', 'auto' or {'name': ...}", param="function_call")
        req.tool_choice = call


def prompt_logprobs_json(
    prompt_ids: list[int], entries: Sequence[TokenLogprob | None] | None, decode: Callable[[list[int]], str]
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token and the top entries asked for (rank: 1-based among the model's choices, None
    when the token lies outside the top entries reported)."""
    if entries is None:
        return None
    out: list[dict[str, Any] | None] = []
    for token, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        logprob, top = entry
        ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
        item = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": decode([t])} for i, (t, lp) in enumerate(top)}
        item.setdefault(str(token), {"logprob": logprob, "rank": ranks.get(token), "decoded_token": decode([token])})
        out.append(item)
    return out
