"""Serve stage: a tool call's arguments held to its JSON schema by an llguidance grammar in Gemma-4's call syntax.

Gemma writes a call as `<|tool_call>call:NAME{key:value,...}<tool_call|>` (MODEL_FACTS §4.3, read by serve/parser.py):
bare keys, strings between `<|"|>` tokens (never escaped), bare numbers, booleans and null, `{...}` objects and
`[...]` arrays. That is not JSON, so the grammar is written here from the schema as Lark rules: numbers with bounds
embed llguidance's own JSON-schema number grammar (`%json{...}`: bare numbers are the same in both syntaxes);
strings are a lexeme of bounded length intersected with the schema's `pattern` / `format`; objects list their
properties in schema order, the required ones always and the optional ones possibly left out, then (where
`additionalProperties` is true or a schema: pydantic's `dict`, `dict[str, X]`) up to MAX_ITEMS pairs under other
bare keys; `uniqueItems` arrays (pydantic's `set[X]`) hold each value of a finite set (enum, const, boolean) at most
once, in its order, or else at most one item; `$ref`/`$defs`, `anyOf`/`oneOf`, `allOf` (merged), `enum`/`const`,
type lists and OpenAPI's `nullable` are followed. String `format`s are serve/string_formats.py's regexes. A keyword
the grammar cannot enforce is refused with a 400 that names it. Strings and arrays without an upper bound are
bounded (MAX_STRING characters / MAX_ITEMS items beyond their minimum) and numbers get at most six integer digits
and four decimals, so that a weak model still closes the call.

Forced calls (tool_choice required / named) start after the prompt's opening of the call; under tool_choice auto
the grammar is triggered by the `<|tool_call>` token the model picks itself and covers that call only.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..runtime.text.grammar import Grammar
from .context import ServerContext
from .protocol import APIError
from .schema_rules import ANNOTATIONS, HANDLED, SchemaError, SchemaRules
from .string_formats import FORMATS, lark_regex

MAX_STRING = 32
MAX_PATTERN_STRING = 256  # a pattern without maxLength: the pattern bounds the text, this only its run-away length
MAX_ITEMS = 4
NUMBER_SPAN = 10**6  # an unbounded side of a numeric range is cut here (a subset of the valid values)
FRACTION_STEP = 0.0001  # a bounded number's grammar writes at most four decimals
NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# an undeclared key (additionalProperties): bare, as Gemma writes keys (the call parser reads up to the ':')
_BARE_KEY = r"/[A-Za-z_][A-Za-z0-9_]{0,15}/"
_INTEGER = r"/-?(0|[1-9][0-9]{0,5})/"
_NUMBER = r"/-?(0|[1-9][0-9]{0,5})(\.[0-9]{1,4})?/"


def _unanchored(pattern: str) -> str:
    """A JSON-schema pattern as a whole-string regex: its text must match it entirely (a subset of what a
    search for it accepts), so leading '^' and trailing '$' anchors are dropped; '/' is escaped for Lark."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern.replace("/", "\\/")


def _allows_empty(pattern: str | None, fmt: str | None) -> bool:
    """Whether the empty string satisfies the pattern and format (as JSON Schema validators check: a search)."""
    if fmt is not None:
        return False
    try:
        return pattern is None or re.search(pattern, "") is not None
    except re.error:
        return False


class _Lark(SchemaRules):
    """Collects the rules of one grammar over one tool's parameters (the root of its `$ref`s)."""

    def __init__(self, quote: int) -> None:
        super().__init__()
        self.quote = quote
        self._refs: dict[tuple[int, str], str] = {}

    # --- values --------------------------------------------------------------------------------------------
    def _quoted(self, body: str) -> str:
        return f"<[{self.quote}]> {body} <[{self.quote}]>"

    def _literal(self, v: Any) -> str:
        """A constant in Gemma's syntax as Lark."""
        if isinstance(v, str):
            return self._quoted(json.dumps(v)) if v else f"<[{self.quote}]> <[{self.quote}]>"
        if isinstance(v, bool):
            return '"true"' if v else '"false"'
        if v is None:
            return '"null"'
        if isinstance(v, (int, float)):
            return json.dumps(json.dumps(v))
        if isinstance(v, list):
            return " ".join(['"["', ' "," '.join(self._literal(x) for x in v), '"]"']) if v else '"[" "]"'
        if isinstance(v, dict):
            pairs = ' "," '.join(f"{json.dumps(k + ':')} {self._literal(x)}" for k, x in v.items())
            return f'"{{" {pairs} "}}"' if v else '"{" "}"'
        raise SchemaError(f"cannot write the constant {v!r}")

    def _string(self, schema: dict, where: str) -> str:
        lo = int(schema.get("minLength", 0))
        pattern, fmt = schema.get("pattern"), schema.get("format")
        if fmt is not None and fmt not in FORMATS:
            raise SchemaError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(sorted(FORMATS))})")
        default_hi = lo + (MAX_PATTERN_STRING if pattern or fmt else MAX_STRING)
        hi = int(schema.get("maxLength", default_hi))
        if hi < lo:
            raise SchemaError(f"{where}: maxLength {hi} is below minLength {lo}")
        # no '<' inside: the closing delimiter is a token of its own, and the parser ends the string at it
        parts = [f"/(?s:[^<]{{{max(lo, 1)},{hi}}})/"]
        if isinstance(pattern, str):
            parts.append(f"/{_unanchored(pattern)}/")
        elif pattern is not None:
            raise SchemaError(f"{where}: pattern must be a string")
        if fmt is not None:
            parts.append(f"/{lark_regex(fmt)}/")
        if hi == 0:
            return self.rule(f"<[{self.quote}]> <[{self.quote}]>")
        text = self.rule(" & ".join(parts), token=True)
        if lo == 0 and _allows_empty(pattern, fmt):  # the empty string: a lexeme never matches nothing
            return self.rule(f"{self._quoted(text)} | <[{self.quote}]> <[{self.quote}]>")
        return self.rule(self._quoted(text))

    def _number(self, schema: dict, kind: str) -> str:
        bounds = {k: schema[k] for k in NUMERIC if k in schema}
        if not bounds:
            return self.rule(_INTEGER if kind == "integer" else _NUMBER)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in bounds and (isinstance(bounds[key], bool) or not isinstance(bounds[key], (int, float))):
                raise SchemaError(f"{key} must be a number")
        low = next((bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds), None)
        high = next((bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds), None)
        if low is None:
            bounds["minimum"] = (0 if high is None else high) - NUMBER_SPAN
        if high is None:
            bounds["maximum"] = (0 if low is None else low) + NUMBER_SPAN
        if kind == "number" and "multipleOf" not in bounds:
            bounds["multipleOf"] = FRACTION_STEP  # at most four decimals, so that the number ends
        return self.rule("%json" + json.dumps({"type": kind, **bounds}, separators=(",", ":")))

    def _array(self, schema: dict, where: str) -> str:
        lo = int(schema.get("minItems", 0))
        hi = int(schema.get("maxItems", lo + MAX_ITEMS))
        if hi < lo:
            raise SchemaError(f"{where}: maxItems {hi} is below minItems {lo}")
        if schema.get("uniqueItems") is True:
            return self._unique_array(schema, lo, hi, where)
        item = self.value(schema.get("items", {}), f"{where}.items")
        if hi == 0:
            return self.rule('"[" "]"')
        more = f' ("," {item}){{{max(lo - 1, 0)},{hi - 1}}}' if hi > 1 else ""
        body = f"{item}{more}"
        return self.rule(f'"[" {body} "]"' if lo > 0 else f'"[" ({body})? "]"')

    def _unique_array(self, schema: dict, lo: int, hi: int, where: str) -> str:
        """uniqueItems: items from a finite set (enum, const, boolean) each at most once, in the set's order; other
        items (which a grammar cannot keep apart) at most one."""
        items = self._deref(schema.get("items", {}), f"{where}.items")
        choices = items.get("enum") if isinstance(items.get("enum"), list) else None
        if choices is None and "const" in items:
            choices = [items["const"]]
        if choices is None and items.get("type") == "boolean":
            choices = [True, False]
        if choices is not None and set(items) - ANNOTATIONS <= {"enum", "const", "type"}:
            values = list({json.dumps(v, sort_keys=True): v for v in choices}.values())
            if lo > len(values):
                raise SchemaError(f"{where}: uniqueItems with minItems {lo} but only {len(values)} distinct values")
            return self._subsets([self.rule(self._literal(v)) for v in values], lo, min(hi, len(values)))
        if lo > 1:
            raise SchemaError(f"{where}: uniqueItems with minItems {lo} cannot be enforced for these items")
        item = self.value(items, f"{where}.items")
        if hi == 0:
            return self.rule('"[" "]"')
        return self.rule(f'"[" {item} "]"' if lo == 1 else f'"[" ({item})? "]"')

    def _subsets(self, values: list[str], lo: int, hi: int) -> str:
        """'[' + lo..hi of `values` (rule names) in their order, each at most once, comma-separated + ']'."""
        # rest[k][c]: the rule for what may follow from values[k:] once c items are written (None: nothing can)
        rest: list[dict[int, str | None]] = [{} for _ in range(len(values) + 1)]
        for c in range(hi + 1):
            rest[len(values)][c] = '""' if c >= lo else None
        for k in range(len(values) - 1, -1, -1):
            for c in range(hi + 1):
                alts = []
                taken = rest[k + 1].get(c + 1) if c < hi else None
                if taken is not None:
                    comma = '"," ' if c else ""
                    alts.append(f"{comma}{values[k]} {taken}")
                if rest[k + 1][c] is not None:
                    alts.append(str(rest[k + 1][c]))
                rest[k][c] = self.rule(" | ".join(alts)) if alts else None
        return self.rule(f'"[" {rest[0][0]} "]"')

    def value(self, schema: Any, where: str) -> str:
        """The name of a rule matching a value valid against `schema`."""
        if isinstance(schema, dict) and "$ref" in schema and not set(schema) - ANNOTATIONS - {"$ref"}:
            key = (id(self.root), schema["$ref"])
            if key not in self._refs:  # named before its body is built: recursive schemas refer to it
                self._refs[key] = name = self.rule('""')
                self.rules[name] = self.rules.pop(self.value(self._deref(schema, where), where))
            return self._refs[key]
        schema = self._deref(schema, where)
        if "allOf" in schema:
            schema = self._merged(schema, where)
        unknown = sorted(set(schema) - HANDLED - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{where}: the keyword {unknown[0]!r} is not supported in tool parameters")
        if schema.get("nullable") is True:
            rest = {k: v for k, v in schema.items() if k != "nullable"}
            return self.rule(f'{self.value(rest, where)} | "null"')
        if "enum" in schema:
            if not isinstance(schema["enum"], list) or not schema["enum"]:
                raise SchemaError(f"{where}: enum must be a non-empty list")
            return self.rule(" | ".join(self._literal(v) for v in schema["enum"]))
        if "const" in schema:
            return self.rule(self._literal(schema["const"]))
        for word in ("anyOf", "oneOf"):
            if word in schema:
                rest = {k: v for k, v in schema.items() if k != word and k not in ANNOTATIONS}
                alts = schema[word]
                if not isinstance(alts, list) or not alts:
                    raise SchemaError(f"{where}: {word} must be a non-empty list")
                if rest:  # shared keywords beside the alternatives apply to each of them
                    alts = [{"allOf": [rest, a]} for a in alts]
                return self.rule(" | ".join(self.value(a, f"{where}.{word}[{i}]") for i, a in enumerate(alts)))
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                raise SchemaError(f"{where}: type must not be an empty list")
            return self.rule(" | ".join(self.value({**schema, "type": k}, where) for k in kind))
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind == "string":
            return self._string(schema, where)
        if kind in ("integer", "number"):
            return self._number(schema, kind)
        if kind == "boolean":
            return self.rule('"true" | "false"')
        if kind == "null":
            return self.rule('"null"')
        if kind == "object":
            inside = self.members(schema, where)
            return self.rule(f'"{{" {inside} "}}"' if inside else '"{" "}"')
        if kind == "array":
            return self._array(schema, where)
        if kind is not None:
            raise SchemaError(f"{where}: type {kind!r} is not a JSON schema type")
        string, number = self._string({}, where), self.rule(_NUMBER)
        return self.rule(f'{string} | {number} | "true" | "false" | "null"')

    def members(self, schema: dict, where: str) -> str:
        """The Lark expression for an object's `key:value` pairs, in schema order: required ones always, optional
        ones possibly left out, then (where additionalProperties is true or a schema) up to MAX_ITEMS pairs under
        other keys, commas only between pairs; "" when the object is empty."""
        props = schema.get("properties") or {}
        if not isinstance(props, dict):
            raise SchemaError(f"{where}.properties must be an object")
        required = schema.get("required") or []
        extra = schema.get("additionalProperties", True)
        undeclared = [k for k in required if k not in props]
        if undeclared and extra is False:
            raise SchemaError(
                f"{where}: required {undeclared[0]!r} is neither a property nor allowed as an additional one"
            )
        keys = [*props, *undeclared]
        schemas = {**{k: extra if isinstance(extra, dict) else {} for k in undeclared}, **props}
        # the rest once some pair has been written (each then starts with ','), and while none has been
        after_pair, first = self._extra_pairs(schema.get("additionalProperties"), keys, where)
        for key in reversed(keys):
            pair = f"{json.dumps(key + ':')} {self.value(schemas[key], f'{where}.properties.{key}')}"
            tail = f" {after_pair}" if after_pair else ""
            if key in required:
                after_pair = self.rule(f'"," {pair}{tail}')
                first = self.rule(f"{pair}{tail}")
            else:
                after_pair = self.rule(f'("," {pair})?{tail}')
                alt = f"({pair}{tail})?" if first is None else f"{pair}{tail} | {first}"
                first = self.rule(alt)
        return first or ""

    def _extra_pairs(self, extra: Any, declared: list[str], where: str) -> tuple[str | None, str | None]:
        """For an explicit additionalProperties (true or a schema, as pydantic writes `dict` and `dict[str, X]`):
        (the rule for up to MAX_ITEMS pairs under undeclared keys after some pair, the rule for them when they come
        first); else (None, None): no key beyond the declared ones is written."""
        if extra is None or extra is False:
            return None, None
        if extra is not True and not isinstance(extra, dict):
            raise SchemaError(f"{where}: additionalProperties must be a schema, true or false")
        value = self.value({} if extra is True else extra, f"{where}.additionalProperties")
        clash = [k for k in declared if re.fullmatch(_BARE_KEY[1:-1], k)]  # keys the bare-key lexeme could spell
        key = self.rule(_BARE_KEY + (f" & ~/({'|'.join(clash)})/" if clash else ""), token=True)
        pair = self.rule(f'{key} ":" {value}')
        after = self.rule(f'("," {pair}){{0,{MAX_ITEMS}}}')
        more = self.rule(f'("," {pair}){{0,{MAX_ITEMS - 1}}}')
        return after, self.rule(f"({pair} {more})?")


def tool_call_lark(tools: list[dict], mode: str, forced: str | None, quote: int, close: int) -> str:
    """The Lark text for a call's rest: after the prompt's `<|tool_call>call:NAME{` (named), after its
    `<|tool_call>call:` (required), or after the model's own `<|tool_call>` (auto). SchemaError names what a
    tool's parameters ask that the grammar cannot enforce."""
    g = _Lark(quote)
    by_name = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}

    def call(name: str, params: dict, opened: bool) -> str:
        g.root = params
        where = f"tools[{list(by_name).index(name)}].function.parameters"
        schema = g._deref(params, where)
        if "allOf" in schema:
            schema = g._merged(schema, where)
        inside = g.members(schema, where)
        head = "" if opened else json.dumps(name + "{") + " "
        return f'{head}{inside} "}}" <[{close}]>' if inside else f'{head}"}}" <[{close}]>'

    if mode == "named":
        start = call(forced, by_name[forced], True)
    else:
        start = " | ".join(call(name, params, False) for name, params in by_name.items())
        if mode == "auto":
            start = f'"call:" ({start})'
    return "\n".join([f"start: {start}"] + [f"{name}: {body}" for name, body in g.rules.items()])


def tool_call_grammar(tools: list[dict] | None, mode: str, forced: str | None, ctx: ServerContext) -> Grammar | None:
    """A runtime.text.grammar.Grammar holding a call's arguments to its tool's schema (forced calls from the start,
    auto calls from the model's `<|tool_call>`), or None where no call can happen or the backend cannot
    constrain its decoding (there a forced call stays opened in the prompt, unconstrained)."""
    if mode not in ("required", "named", "auto") or not tools or not ctx.caps.constrained or ctx.tokenizer.path is None:
        return None
    import llguidance

    from ..runtime.text.grammar import tokenizer

    c = ctx.controls
    tok = tokenizer(str(ctx.tokenizer.path), int(ctx.caps.vocab_size), tuple(sorted(ctx.stop_ids)))
    try:
        lark = tool_call_lark(tools, mode, forced, c.string_delim, c.tool_call_close)
    except SchemaError as exc:
        raise APIError(f"tools: cannot constrain a call to this parameter schema: {exc}", param="tools") from None
    text = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(text, tok)
    if error and not error.startswith("WARNING"):
        raise APIError(f"tools: cannot constrain a call to these parameter schemas: {error}", param="tools")
    return Grammar(text, tok, None, c.tool_call_open if mode == "auto" else None)
