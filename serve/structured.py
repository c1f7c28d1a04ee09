"""Serve stage: OpenAI's response_format -> the engine's grammar constraint (llguidance JSON), or a 400."""

from __future__ import annotations

from typing import Any

from .protocol import APIError


def response_grammar(fmt: Any, server: Any, thinking: bool) -> Any:
    """None for text (or no response_format); else a runtime.text.grammar.Grammar for json_object (any JSON
    object) or json_schema (valid against its `schema`; enforced whether or not `strict` is set). With thinking
    on, the grammar starts after the thought channel."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in ("json_object", "json_schema"):
        raise APIError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                       "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}", param="response_format")
    schema = None
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError("response_format.json_schema.schema must be a JSON schema object", param="response_format")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise APIError("response_format.json_schema.strict must be true or false", param="response_format")
        schema = spec["schema"]
    try:
        from ..runtime.text.grammar import Grammar, json_grammar, tokenizer
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise APIError("response_format needs the llguidance package (pip install 'thorgen[serve]')",
                       param="response_format") from None
    if server.tokenizer.path is None:
        raise APIError("response_format needs the checkpoint's tokenizer.json", param="response_format")
    tok = tokenizer(str(server.tokenizer.path), int(server.caps.vocab_size), tuple(sorted(server.stop_ids)))
    try:
        text = json_grammar(schema, tok)
    except ValueError as exc:
        raise APIError(f"response_format: {exc}", param="response_format") from None
    c = server.controls
    return Grammar(text, tok, (c.channel_open, c.channel_close) if thinking else None)
