"""Serve stage: a forced tool call (tool_choice required / named) -> an llguidance grammar in Gemma-4's call syntax.

The prompt already opens the call (`<|tool_call>call:` or `<|tool_call>call:NAME{`); the grammar makes the rest
a well-formed call whose arguments are valid against the tool's JSON schema, in the syntax serve/parser.py reads
(MODEL_FACTS §4.3): `NAME{key:value,...}<tool_call|>` with bare keys, strings between `<|"|>` tokens, bare numbers
and booleans, `{...}` objects and `[...]` arrays. Required properties come in schema order, then the optional
ones, each of which may be left out. Strings and arrays are bounded (the schema's maxLength / maxItems, else 32
characters / 4 items) so that a weak model still closes the call.
"""

from __future__ import annotations

import json
from typing import Any

MAX_STRING = 32
MAX_ITEMS = 4


class _Lark:
    """Collects the rules of one grammar; `value(schema)` returns the name of a rule matching that value."""

    def __init__(self, quote: int) -> None:
        self.quote, self.rules, self._n = quote, {}, 0

    def rule(self, body: str) -> str:
        self._n += 1
        name = f"r{self._n}"
        self.rules[name] = body
        return name

    def _string(self, schema: dict) -> str:
        hi = int(schema.get("maxLength", MAX_STRING))
        lo = min(int(schema.get("minLength", 0)), hi)
        # no '<' inside: the closing delimiter is a token of its own, and the parser ends the string at it
        return f'<[{self.quote}]> /[^<]{{{lo},{hi}}}/ <[{self.quote}]>'

    def _literal(self, v: Any) -> str:
        if isinstance(v, str):
            return f"<[{self.quote}]> {json.dumps(v)} <[{self.quote}]>"
        if isinstance(v, bool):
            return '"true"' if v else '"false"'
        if v is None:
            return '"null"'
        return json.dumps(json.dumps(v))  # a number, written bare

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            schema = {}
        if "enum" in schema:
            return self.rule(" | ".join(self._literal(v) for v in schema["enum"]))
        if "const" in schema:
            return self.rule(self._literal(schema["const"]))
        alts = schema.get("anyOf") or schema.get("oneOf")
        if alts:
            return self.rule(" | ".join(self.value(a) for a in alts))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**schema, "type": k}) for k in kind))
        if kind == "string":
            return self.rule(self._string(schema))
        if kind == "integer":
            return self.rule(r'/-?(0|[1-9][0-9]{0,5})/')
        if kind == "number":
            return self.rule(r'/-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,4})?/')
        if kind == "boolean":
            return self.rule('"true" | "false"')
        if kind == "null":
            return self.rule('"null"')
        if kind == "object":
            return self.rule(f'"{{" {self.members(schema)} "}}"')
        if kind == "array":
            item = self.value(schema.get("items", {}))
            n = max(1, int(schema.get("maxItems", MAX_ITEMS)))
            tail = ""
            for _ in range(n - 1):  # nested optionals: at most n items
                tail = f'("," {item} {tail})?'
            body = f'{item} {tail}'
            return self.rule(f'"[" {body} "]"' if int(schema.get("minItems", 0)) > 0 else f'"[" ({body})? "]"')
        return self.rule(f'{self._string({})} | {self.value({"type": "number"})} | "true" | "false"')

    def members(self, schema: dict) -> str:
        """`key:value` pairs of an object schema: the required ones, then optional ones that may be left out."""
        props = schema.get("properties") or {}
        required = [k for k in schema.get("required", []) if k in props]
        optional = [k for k in props if k not in required]
        pair = {k: f'{json.dumps(k + ":")} {self.value(props[k])}' for k in props}
        if required:
            return " ".join([' "," '.join(pair[k] for k in required)] + [f'("," {pair[k]})?' for k in optional])
        if optional:  # no required key: none, or the first optional one
            return f"({pair[optional[0]]})?"
        return '""'


def tool_call_lark(tools: list[dict], mode: str, forced: str | None, quote: int, close: int) -> str:
    """The Lark text for what follows the prompt's opening of a forced call (see the module docstring)."""
    g = _Lark(quote)
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if mode == "named":
        start = f'{g.members(by_name[forced])} "}}" <[{close}]>'
    else:
        start = " | ".join(f'{json.dumps(name + "{")} {g.members(params)} "}}" <[{close}]>'
                           for name, params in by_name.items())
    return "\n".join([f"start: {start}"] + [f"{name}: {body}" for name, body in g.rules.items()])


def tool_call_grammar(tools: list[dict] | None, mode: str, forced: str | None, server: Any) -> Any:
    """A runtime.text.grammar.Grammar forcing the call, or None where nothing is forced or the backend cannot
    constrain its decoding (there the call stays opened in the prompt, unconstrained)."""
    if mode not in ("required", "named") or not tools or not server.caps.constrained \
            or server.tokenizer.path is None:
        return None
    import llguidance

    from ..runtime.text.grammar import Grammar, tokenizer

    c = server.controls
    tok = tokenizer(str(server.tokenizer.path), int(server.caps.vocab_size), tuple(sorted(server.stop_ids)))
    text = llguidance.LLMatcher.grammar_from_lark(tool_call_lark(tools, mode, forced, c.string_delim,
                                                                 c.tool_call_close))
    error = llguidance.LLMatcher.validate_grammar(text, tok)
    if error and not error.startswith("WARNING"):
        from .protocol import APIError

        raise APIError(f"tools: cannot constrain a call to these parameter schemas: {error}", param="tools")
    return Grammar(text, tok, None)
