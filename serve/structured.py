"""Serve stage: structured output: OpenAI's response_format -> an OutputFormat, and an OutputFormat -> the engine's
grammar constraint (llguidance JSON or Lark), or a 400."""

from __future__ import annotations

from typing import Any

from ..runtime.text.grammar import Grammar
from .context import ServerContext
from .protocol import APIError
from .request import OutputFormat
from .string_formats import with_format_patterns


def output_format(fmt: Any, param: str = "response_format") -> OutputFormat | None:
    """None for text (or no format); else json_object, or json_schema with its `schema` (enforced whether or not
    `strict` is set). `fmt` is chat's response_format: {"type": ..., "json_schema": {"schema": ...}}."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("json_object", "json_schema"):
        raise APIError(
            f"{param} must be {{'type': 'text'}}, {{'type': 'json_object'}} or "
            "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}",
            param=param,
        )
    if kind == "json_object":
        return OutputFormat("json_object", param=param)
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(f"{param}.json_schema.schema must be a JSON schema object", param=param)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise APIError(f"{param}.json_schema.strict must be true or false", param=param)
    return OutputFormat("json_schema", spec["schema"], param)


def format_grammar(fmt: OutputFormat | None, ctx: ServerContext, thinking: bool) -> Grammar | None:
    """None for free text; else a runtime.text.grammar.Grammar for the format (a JSON schema, or a Lark grammar
    checked by llguidance). With thinking on, the grammar starts after the thought channel."""
    if fmt is None:
        return None
    param = fmt.param
    try:
        import llguidance

        from ..runtime.text.grammar import json_grammar, tokenizer
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise APIError(f"{param} needs the llguidance package (pip install 'thorgen[serve]')", param=param) from None
    if ctx.tokenizer.path is None:
        raise APIError(f"{param} needs the checkpoint's tokenizer.json", param=param)
    tok = tokenizer(str(ctx.tokenizer.path), int(ctx.caps.vocab_size), tuple(sorted(ctx.stop_ids)))
    try:
        if fmt.kind == "lark":
            assert fmt.grammar is not None  # (a lark format always carries its grammar)
            text = llguidance.LLMatcher.grammar_from_lark(fmt.grammar)
        else:
            text = json_grammar(with_format_patterns(fmt.schema), tok)
    except ValueError as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
    error = llguidance.LLMatcher.validate_grammar(text, tok) if fmt.kind == "lark" else None
    if error and not error.startswith("WARNING"):
        raise APIError(f"{param} is invalid or unsupported: {error.splitlines()[0]}", param=param)
    c = ctx.controls
    return Grammar(text, tok, (c.channel_open, c.channel_close) if thinking else None)
