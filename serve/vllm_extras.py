"""Serve stage: vLLM's request extras turned into engine values, or a 400 naming the field.

ignore_eos (no stop on the checkpoint's EOS / end-of-turn ids), stop_token_ids (more stop ids, whose text is left
out as a stop id's is), min_tokens (the stop ids are masked off until that many tokens are out), prompt_logprobs
(the engine's prompt scoring, as completions' echo uses it), the guided decoding fields (`structured_outputs`
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`: llguidance grammars like
response_format's), truncate_prompt_tokens (the prompt's last N tokens) and the legacy `functions` /
`function_call` (as tools / tool_choice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .protocol import APIError, ChatCompletionRequest, Tool, _Sampling

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class VllmExtras:
    """What the extras change: the engine's stop ids, the sampling's min_tokens and prompt_logprobs, the guided
    grammar (a runtime.text.grammar.Grammar or None) and how many prompt tokens to keep (None: all)."""

    stop_ids: frozenset[int]
    min_tokens: int = 0
    prompt_logprobs: int | None = None
    grammar: Any = None
    keep_prompt_tokens: int | None = None

    def sampling_fields(self) -> dict:
        return {"min_tokens": self.min_tokens, "prompt_logprobs": self.prompt_logprobs}


def _guided_spec(req: _Sampling) -> tuple[str, Any, str] | None:
    """(kind, value, the field that asked) of the one guided-decoding request, or None."""
    asked = []
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise APIError("structured_outputs must be an object", param="structured_outputs")
        unknown = sorted(k for k, v in so.items() if v is not None and k not in STRUCTURED_KINDS
                         and k not in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"))
        if unknown:
            raise APIError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                           f"{', '.join(STRUCTURED_KINDS)})", param="structured_outputs")
        asked += [(k, so[k], f"structured_outputs.{k}") for k in STRUCTURED_KINDS if so.get(k) not in (None, False)]
    asked += [(name[len("guided_"):], getattr(req, name), name) for name in GUIDED if getattr(req, name) is not None]
    if req.guided_whitespace_pattern is not None:
        raise APIError("guided_whitespace_pattern is not supported (JSON is written compactly)",
                       param="guided_whitespace_pattern")
    if len(asked) > 1:
        raise APIError(f"give one guided-decoding constraint, not {', '.join(a[2] for a in asked)}",
                       param=asked[1][2])
    return asked[0] if asked else None


def guided_lark(kind: str, value: Any, field: str) -> tuple[str, str]:
    """('json' | 'lark', the schema JSON or Lark text) of one guided-decoding request."""
    if kind == "json_object":
        return "json", json.dumps({"type": "object"})
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, dict):
            raise APIError(f"{field} must be a JSON schema object", param=field)
        return "json", json.dumps(schema)
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise APIError(f"{field} must be a non-empty regular expression", param=field)
        return "lark", "start: /" + value.replace("/", "\\/") + "/"
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(f"{field} must be a non-empty list of non-empty strings", param=field)
        return "lark", "start: " + " | ".join(json.dumps(c) for c in value)
    if not isinstance(value, str) or not value.strip():  # grammar: llguidance's Lark
        raise APIError(f"{field} must be a Lark grammar (llguidance's dialect)", param=field)
    return "lark", value


def guided_grammar(req: _Sampling, server: Any, thinking: bool) -> Any:
    """The grammar of the request's guided-decoding field, or None; a 400 when it is invalid or unsupported."""
    spec = _guided_spec(req)
    if spec is None:
        return None
    kind, value, field = spec
    if not server.caps.constrained or server.tokenizer.path is None:
        raise APIError(f"{field} needs grammar-constrained decoding, which this engine cannot run", param=field)
    try:
        import llguidance

        from ..runtime.text.grammar import Grammar, json_grammar, tokenizer
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise APIError(f"{field} needs the llguidance package (pip install 'thorgen[serve]')", param=field) from None
    tok = tokenizer(str(server.tokenizer.path), int(server.caps.vocab_size), tuple(sorted(server.stop_ids)))
    form, text = guided_lark(kind, value, field)
    if form == "json":
        try:
            grammar = json_grammar(json.loads(text), tok)
        except ValueError as exc:
            raise APIError(f"{field}: {exc}", param=field) from None
    else:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as exc:
            raise APIError(f"{field}: {exc}", param=field) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error and not error.startswith("WARNING"):
            raise APIError(f"{field} is invalid or unsupported: {error.splitlines()[0]}", param=field)
    c = server.controls
    return Grammar(grammar, tok, (c.channel_open, c.channel_close) if thinking else None)


def vllm_extras(req: _Sampling, server: Any, thinking: bool, max_tokens: int | None) -> VllmExtras:
    """The request's vLLM fields as engine values (`max_tokens`: the request's own token limit, if it gave one)."""
    vocab = server.caps.vocab_size
    extra = frozenset(req.stop_token_ids or ())
    bad = sorted(t for t in extra if not 0 <= t < vocab)
    if bad:
        raise APIError(f"stop_token_ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}", param="stop_token_ids")
    if len(extra) > 64:
        raise APIError("at most 64 stop_token_ids", param="stop_token_ids")
    stop_ids = (frozenset() if req.ignore_eos else server.stop_ids) | extra
    min_tokens = req.min_tokens or 0
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(f"min_tokens {min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
    if req.prompt_logprobs is not None:
        if req.stream:
            raise APIError("prompt_logprobs come with non-streamed responses only", param="prompt_logprobs")
        if getattr(req, "echo", False) and req.logprobs is not None:
            raise APIError("prompt_logprobs cannot be combined with echo and logprobs (which score the prompt "
                           "already)", param="prompt_logprobs")
    keep = req.truncate_prompt_tokens
    if keep == 0:
        raise APIError("truncate_prompt_tokens must be at least 1 (or -1: the model's context length)",
                       param="truncate_prompt_tokens")
    if keep is not None:
        keep = server.caps.max_context if keep == -1 else keep
    return VllmExtras(stop_ids, min_tokens, req.prompt_logprobs, guided_grammar(req, server, thinking), keep)


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


def prompt_logprobs_json(prompt_ids: list[int], entries: list | None, decode: Any) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    holding the prompt's own token and the top entries asked for (rank: 1-based among the model's choices, None
    when the token lies outside the top entries reported)."""
    if entries is None:
        return None
    out: list = []
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

