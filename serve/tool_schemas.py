"""Serve stage: tool parameter schemas normalized into the shapes Gemma's chat template can render.

Google's template reads each property's `type` (its first entry when a list) and fails on a property without
one: what pydantic writes for `Optional[...]` (`anyOf` with a null branch), an `enum` without `type`, and a `$ref`
into `$defs`. Only such properties are rewritten, for the prompt alone (the grammar of serve/tool_grammar.py reads
the schema as sent): a `$ref` is replaced by its target (the reference's own description kept), a nullable
`anyOf`/`oneOf` becomes its non-null branch with `nullable: true`, other alternatives become a type list, a typeless
`enum`/`const` gets the type of its values, and a property with nothing to go by is typed by its shape. A
property that has a `type` is left exactly as it is (its nested properties still normalized), so a schema the
template rendered before renders byte-identically.
"""

from __future__ import annotations

import copy
from typing import Any

from .protocol import APIError

MAX_DEPTH = 8  # a recursive $ref is unrolled this deep, then left an OBJECT without properties
_SCHEMA_WORDS = {"description", "type", "properties", "required", "nullable"}  # the template's; others are props


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if value is None:
        return "null"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "string")


class _Normalizer:
    def __init__(self, root: dict) -> None:
        self.root = root

    def _target(self, ref: Any) -> dict | None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            return None
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node if isinstance(node, dict) else None

    def typed(self, spec: Any, depth: int) -> Any:
        """A property's schema with a `type` the template can read (unchanged when it already has one)."""
        if not isinstance(spec, dict):
            return {"type": "string"} if spec is True or spec == {} else spec
        if "type" in spec:
            return self.nested(self._object_shape(spec), depth)
        out = dict(spec)
        if "$ref" in out:
            target = self._target(out.pop("$ref"))
            if target is None or depth >= MAX_DEPTH:
                return {**out, "type": "object"}
            merged = {**copy.deepcopy(target), **out}  # the reference's own description wins over the target's
            return self.typed(merged, depth + 1)
        for word in ("anyOf", "oneOf"):
            alts = out.get(word)
            if isinstance(alts, list) and alts:
                branches = [self.typed(a, depth + 1) for a in alts]
                real = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
                if len(real) == 1 and len(real) < len(branches):
                    out.pop(word)
                    base = {k: v for k, v in real[0].items() if k not in out or k == "type"}
                    return {**base, **{k: v for k, v in out.items()}, "nullable": True}
                types = list(dict.fromkeys(b.get("type") for b in real if isinstance(b, dict) and "type" in b))
                if types and all(isinstance(t, str) for t in types):
                    out[word] = branches
                    out["type"] = types[0] if len(types) == 1 else types
                    if len(real) < len(branches):
                        out["nullable"] = True
                    return out
        if "allOf" in out and isinstance(out["allOf"], list) and len(out["allOf"]) == 1:
            inner = self.typed(out.pop("allOf")[0], depth + 1)
            return {**inner, **out} if isinstance(inner, dict) else out
        values = out.get("enum") if isinstance(out.get("enum"), list) else [out["const"]] if "const" in out else None
        if values:
            types = list(dict.fromkeys(_json_type(v) for v in values if v is not None))
            if None in values:
                out["nullable"] = True
            out["type"] = (types[0] if len(types) == 1 else types) if types else "string"
            return out
        shaped = "properties" in out or "additionalProperties" in out
        out["type"] = "object" if shaped else "array" if "items" in out else "string"
        return self.nested(self._object_shape(out), depth)

    @staticmethod
    def _object_shape(spec: dict) -> dict:
        """An object property without `properties` gets an empty one: the template otherwise renders the schema's
        own keys as properties (pydantic's `dict[str, int]`: additionalProperties, title) and fails on them."""
        kind = spec.get("type")
        kind = kind[0] if isinstance(kind, list) and kind else kind
        if kind != "object" or isinstance(spec.get("properties"), dict) or not set(spec) - _SCHEMA_WORDS:
            return spec
        return {**spec, "properties": {}}

    def nested(self, spec: dict, depth: int) -> dict:
        """`spec` with the properties inside it (directly, or in its items) typed; the same object if none needed
        a change."""
        out = spec
        props = spec.get("properties")
        if isinstance(props, dict):
            fixed = self.properties(props, depth + 1)
            if fixed is not props:
                out = {**out, "properties": fixed}
        items = spec.get("items")
        if isinstance(items, dict):
            fixed_items = self.nested(items, depth + 1)
            if fixed_items is not items:
                out = {**out, "items": fixed_items}
        return out

    def properties(self, props: dict, depth: int) -> dict:
        # a `false` property can never be given: the template is not told of it
        fixed = {name: self.typed(spec, depth) for name, spec in props.items() if spec is not False}
        return props if len(fixed) == len(props) and all(fixed[k] is props[k] for k in props) else fixed


_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def check_shapes(schema: Any, where: str) -> None:
    """APIError unless every subschema (under properties, items, anyOf, $defs, ...) is a schema: an object or a
    boolean. Named by its place, e.g. `tools[0].function.parameters.properties.o`."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise APIError(
            f"{where}: a JSON schema must be an object or a boolean (got {type(schema).__name__})", param="tools"
        )
    for word in _SUBSCHEMA:
        if word in schema and not (word == "items" and isinstance(schema[word], list)):
            check_shapes(schema[word], f"{where}.{word}")
    for word in (*_SUBSCHEMA_LISTS, *(("items",) if isinstance(schema.get("items"), list) else ())):
        if word in schema:
            if not isinstance(schema[word], list):
                raise APIError(f"{where}.{word} must be a list of schemas", param="tools")
            for i, sub in enumerate(schema[word]):
                check_shapes(sub, f"{where}.{word}[{i}]")
    for word in _SUBSCHEMA_MAPS:
        if word in schema:
            if not isinstance(schema[word], dict):
                raise APIError(f"{where}.{word} must be an object of schemas", param="tools")
            for name, sub in schema[word].items():
                check_shapes(sub, f"{where}.{word}.{name}")


def normalize_parameters(params: dict | None) -> dict | None:
    """A tool's `parameters` as the chat template should see them (the same object when nothing needs a change)."""
    if not isinstance(params, dict):
        return params
    return _Normalizer(params).nested(params, 0)


def template_tools(tools: list[dict] | None) -> list[dict] | None:
    """The validated tools with each one's parameters normalized for the chat template."""
    if not tools:
        return tools
    out = []
    for tool in tools:
        fn = tool["function"]
        params = normalize_parameters(fn.get("parameters"))
        out.append(tool if params is fn.get("parameters") else {**tool, "function": {**fn, "parameters": params}})
    return out
