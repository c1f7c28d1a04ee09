"""Serve stage: the schema plumbing of the tool-call grammar (serve/tool_grammar.py): named Lark rules, local
`$ref`s into the tool's parameters, `allOf` folded into one schema, and the keywords the grammar reads or ignores."""

from __future__ import annotations

import json
from typing import Any

ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
}
HANDLED = {
    "type",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "nullable",
    "uniqueItems",
}


class SchemaError(ValueError):
    """A schema the grammar cannot enforce; the message names the keyword and where it is."""


class SchemaRules:
    """Named Lark rules (`rule`) and the `$ref` / `allOf` resolution over one root schema."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}
        self._n = 0
        self.root: dict = {}  # the schema `$ref`s point into

    def rule(self, body: str, token: bool = False) -> str:
        self._n += 1
        name = f"{'S' if token else 'r'}{self._n}"
        self.rules[name] = body
        return name

    def _target(self, ref: str, where: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: $ref {ref!r} is not a local reference ('#/$defs/...')")
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"{where}: $ref {ref!r} points at nothing")
            node = node[part]
        return node

    def _merged(self, schema: dict, where: str) -> dict:
        """allOf folded into one schema: properties and required united, any other keyword the same in each."""
        out = {k: v for k, v in schema.items() if k != "allOf"}
        for i, part in enumerate(schema["allOf"]):
            part = self._deref(part, f"{where}.allOf[{i}]")
            if "allOf" in part:
                part = self._merged(part, f"{where}.allOf[{i}]")
            for key, value in part.items():
                if key == "properties":
                    out["properties"] = {**out.get("properties", {}), **value}
                elif key == "required":
                    out["required"] = list(dict.fromkeys([*out.get("required", []), *value]))
                elif key in out and out[key] != value and key not in ANNOTATIONS:
                    raise SchemaError(f"{where}: allOf parts disagree on {key!r}")
                else:
                    out.setdefault(key, value)
        return out

    def _deref(self, schema: Any, where: str) -> dict:
        if schema is True or schema is None:
            return {}
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object (got {json.dumps(schema)})")
        if "$ref" in schema:
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            if set(siblings) - ANNOTATIONS:
                raise SchemaError(f"{where}: $ref beside {sorted(set(siblings) - ANNOTATIONS)} is not supported")
            return self._deref(self._target(schema["$ref"], where), where)
        return schema
