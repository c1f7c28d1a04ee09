"""Serve stage: JSON Schema string `format`s as regular expressions that grammars enforce, exact where validators
are strict (days per month, leap years, no leap second, no year 0000, IPv4 without leading zeros) and a subset
where a format's full language is needlessly wide (URIs: scheme://host/path?query, no port or fragment).

Every value a regex matches passes jsonschema's Draft 2020-12 format checker (with rfc3339-validator and
rfc3986-validator installed, which check time, date-time and uri). llguidance's own `format` support lets
2023-02-29 and 23:59:60 through, so JSON grammars get these regexes as `pattern`s instead (`with_format_patterns`).
The regexes use only what both Python's `re` and llguidance's lexer read: groups, classes, alternation, repeats.
"""

from __future__ import annotations

from typing import Any

_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001..9999 (Python's date has no year 0)
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DAY_OF_MONTH = (
    "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])"  # 31-day months
    "|(0[469]|11)-(0[1-9]|[12][0-9]|30)"  # 30-day months
    "|02-(0[1-9]|1[0-9]|2[0-8]))"  # February, the 29th apart
)
DATE = f"({_YEAR}-{_DAY_OF_MONTH}|{_LEAP_YEAR}-02-29)"
_OFFSET = "(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
TIME = f"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{{1,6}})?{_OFFSET}"
_H16 = "[0-9a-fA-F]{1,4}"
IPV6 = (
    f"(({_H16}:){{7}}{_H16}"
    f"|({_H16}:){{1,7}}:"
    f"|({_H16}:){{1,6}}:{_H16}"
    f"|({_H16}:){{1,5}}(:{_H16}){{1,2}}"
    f"|({_H16}:){{1,4}}(:{_H16}){{1,3}}"
    f"|({_H16}:){{1,3}}(:{_H16}){{1,4}}"
    f"|({_H16}:){{1,2}}(:{_H16}){{1,5}}"
    f"|{_H16}:(:{_H16}){{1,6}}"
    f"|:((:{_H16}){{1,7}}|:))"
)
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_PCHAR = "([A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})"
FORMATS = {
    "date": DATE,
    "time": TIME,
    "date-time": f"{DATE}T{TIME}",
    "uuid": "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
    "email": "[A-Za-z0-9._%+-]{1,32}@[A-Za-z0-9-]{1,32}(\\.[A-Za-z0-9-]{1,16}){1,3}",
    "ipv4": f"({_OCTET}\\.){{3}}{_OCTET}",
    "ipv6": IPV6,
    "uri": f"[a-z][a-z0-9+.-]{{0,15}}://[A-Za-z0-9._~-]{{1,32}}(/{_PCHAR}{{0,32}}){{0,8}}(\\?({_PCHAR}|[/?]){{0,32}})?",
}
_DATA = {"enum", "const", "default", "examples"}  # values, not schemas: never rewritten


def lark_regex(fmt: str) -> str:
    """The format's regex as a Lark regex literal's body ('/' escaped)."""
    return FORMATS[fmt].replace("/", "\\/")


def _takes_strings(schema: dict) -> bool:
    kind = schema.get("type", "string")
    return kind == "string" or (isinstance(kind, list) and "string" in kind)


def with_format_patterns(schema: Any) -> Any:
    """`schema` with each `format` this module knows replaced by its regex as an anchored `pattern` (beside the
    schema's own pattern, if any, through allOf; a pattern constrains strings only, as the format did); the same
    object when there is nothing to replace."""
    if isinstance(schema, list):
        items = [with_format_patterns(item) for item in schema]
        return schema if all(a is b for a, b in zip(items, schema)) else items
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in _DATA else with_format_patterns(value) for key, value in schema.items()}
    fmt = out.get("format")
    if isinstance(fmt, str) and fmt in FORMATS and _takes_strings(out):
        del out["format"]
        pattern = f"^({FORMATS[fmt]})$"
        if "pattern" in out:
            out["allOf"] = [*out.get("allOf", []), {"pattern": pattern}]
        else:
            out["pattern"] = pattern
        return out
    return out if any(out[key] is not value for key, value in schema.items()) else schema
