"""String `format`s under grammars produce values that jsonschema's Draft 2020-12 format checker accepts: the date
regex against the calendar, random walks at temperature 1 through the tool-call grammar and the JSON grammar, and
samples at temperature 1 from the tiny model through forced tool calls, response_format, Messages tools and
Responses text.format (openai and anthropic clients)."""

from __future__ import annotations

import calendar
import datetime
import json
import re

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from thorgen.serve.parser import parse_tool_call  # noqa: E402
from thorgen.serve.string_formats import FORMATS, with_format_patterns  # noqa: E402
from thorgen.serve.tool_grammar import tool_call_lark  # noqa: E402

CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
# jsonschema checks time, date-time and uri only with these installed (the test extra has them)
STRICT = {"time": "rfc3339_validator", "date-time": "rfc3339_validator", "uri": "rfc3986_validator"}
WALKS = 40


def checked(fmt: str) -> None:
    if fmt in STRICT:
        pytest.importorskip(STRICT[fmt])
    assert fmt in CHECKER.checkers


def one_field(fmt: str) -> dict:
    props = {"v": {"type": "string", "format": fmt}}
    return {"type": "object", "properties": props, "required": ["v"], "additionalProperties": False}


def test_the_date_regex_is_the_calendar() -> None:
    for year in (1, 4, 100, 400, 1900, 1996, 2000, 2023, 2024, 2100, 9999):
        for month in range(1, 13):
            for day in range(1, 33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                valid = day <= calendar.monthrange(year, month)[1]
                assert bool(re.fullmatch(FORMATS["date"], text)) == valid, text
    assert not re.fullmatch(FORMATS["date"], "0000-01-01")  # Python's dates (and jsonschema's check) start at 1
    assert datetime.date.fromisoformat("2024-02-29") and not re.fullmatch(FORMATS["date"], "2023-02-29")
    assert not re.fullmatch(FORMATS["time"], "23:59:60Z")


def test_schemas_get_patterns_for_the_formats_only() -> None:
    schema = {
        "type": "object",
        "properties": {
            "format": {"type": "string", "format": "date"},  # a property named format
            "d": {"type": ["string", "null"], "format": "date", "pattern": "^2"},
            "h": {"type": "string", "format": "hostname"},
        },
        "$defs": {"T": {"type": "string", "format": "time"}},
        "examples": [{"format": "date"}],
    }
    out = with_format_patterns(schema)
    assert out["properties"]["format"] == {"type": "string", "pattern": f"^({FORMATS['date']})$"}
    assert out["properties"]["d"]["pattern"] == "^2" and "format" not in out["properties"]["d"]
    assert out["properties"]["d"]["allOf"] == [{"pattern": f"^({FORMATS['date']})$"}]
    assert out["properties"]["h"] is schema["properties"]["h"] and out["examples"] is schema["examples"]
    assert "format" not in out["$defs"]["T"] and schema["$defs"]["T"]["format"] == "time"  # (a copy)
    plain = {"type": "object", "properties": {"n": {"type": "integer"}}}
    assert with_format_patterns(plain) is plain


@pytest.fixture(scope="module")
def walker(tiny_checkpoint):
    from grammar_walk import Walker

    return Walker(tiny_checkpoint, seed=7)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_tool_call_grammar_walks_pass_the_checker(walker, fmt) -> None:
    import llguidance

    checked(fmt)
    schema = one_field(fmt)
    quote, close = walker.token('<|"|>'), walker.token("<tool_call|>")
    tools = [{"type": "function", "function": {"name": "act", "parameters": schema}}]
    grammar = llguidance.LLMatcher.grammar_from_lark(tool_call_lark(tools, "named", "act", quote, close))
    for _ in range(WALKS):
        text = walker.walk(grammar)
        _, args = parse_tool_call("call:act{" + text.removesuffix("<tool_call|>"))
        jsonschema.validate(args, schema, format_checker=CHECKER)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_json_grammar_walks_pass_the_checker(walker, fmt) -> None:
    from thorgen.runtime.text.grammar import json_grammar

    checked(fmt)
    schema = one_field(fmt)
    grammar = json_grammar(with_format_patterns(schema), walker.ll)
    for _ in range(WALKS):
        jsonschema.validate(json.loads(walker.walk(grammar)), schema, format_checker=CHECKER)


ALL = {
    "type": "object",
    "properties": {fmt.replace("-", "_"): {"type": "string", "format": fmt} for fmt in sorted(FORMATS)},
    "required": [fmt.replace("-", "_") for fmt in sorted(FORMATS)],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    from tiny_server import tiny_server

    with tiny_server(tiny_checkpoint, ctx=2048) as (url, _):
        yield url


def test_model_samples_at_temperature_1_pass_the_checker(served) -> None:
    """Three samples from each API that holds a string to a schema, every format in each."""
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    for fmt in FORMATS:
        checked(fmt)
    oai = openai.OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=300)
    claude = anthropic.Anthropic(base_url=served, api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Fill it in."}]
    tool = {"type": "function", "function": {"name": "fill", "description": "Fill", "parameters": ALL}}
    common = dict(model="tiny", temperature=1.0)
    for seed in range(3):
        got = []
        call = oai.chat.completions.create(
            messages=ask, tools=[tool], tool_choice="required", max_tokens=900, seed=seed, **common
        )
        got.append(json.loads(call.choices[0].message.tool_calls[0].function.arguments))
        fmt = {"type": "json_schema", "json_schema": {"name": "fill", "schema": ALL}}
        answer = oai.chat.completions.create(messages=ask, response_format=fmt, max_tokens=900, seed=seed, **common)
        got.append(json.loads(answer.choices[0].message.content))
        msg = claude.messages.create(
            messages=ask,
            max_tokens=900,
            tools=[{"name": "fill", "description": "Fill", "input_schema": ALL}],
            tool_choice={"type": "tool", "name": "fill"},
            model="tiny",
            extra_body={"temperature": 1.0},  # (this client no longer has the argument; the API still takes it)
        )
        got.append(next(b.input for b in msg.content if b.type == "tool_use"))
        text = {"format": {"type": "json_schema", "name": "fill", "schema": ALL}}
        r = oai.responses.create(input="Fill it in.", text=text, max_output_tokens=900, **common)
        got.append(json.loads(r.output_text))
        for value in got:
            jsonschema.validate(value, ALL, format_checker=CHECKER)
