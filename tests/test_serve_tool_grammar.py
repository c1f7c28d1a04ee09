"""Serve-stage tests: forced tool calls (tool_choice named / required) through an llguidance grammar in Gemma-4's
call syntax, on the tiny model's random weights (reference backend): every call is well formed and its arguments
validate against the tool's schema, streamed and not; the grammar text itself is checked for the syntax pieces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from thorgen.serve.tool_grammar import tool_call_lark  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402

WEATHER = {
    "type": "object",
    "required": ["city", "days"],
    "additionalProperties": False,
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer"},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "alerts": {"type": "boolean"},
    },
}
SEARCH = {
    "type": "object",
    "required": ["query"],
    "properties": {
        "query": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "limit": {"type": "number"},
    },
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "description": "Search", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MSGS = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 1024) as (url, _):
        yield openai_client(url)


def _calls(client, choice, seed: int, stream: bool):
    kw = dict(model="tiny", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=1.0, seed=seed)
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].finish_reason, [
            (c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or []
        ]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            calls[c.index] = (c.function.name, c.function.arguments)
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return finish, list(calls.values())


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_calls_are_valid_ten_of_ten(client, choice):
    tool_choice = {"type": "function", "function": {"name": "search"}} if choice == "named" else "required"
    for i in range(10):
        finish, calls = _calls(client, tool_choice, seed=100 + i, stream=i % 2 == 1)
        assert finish == "tool_calls" and len(calls) >= 1, (i, finish, calls)
        name, arguments = calls[0]
        assert choice == "required" or name == "search"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_grammar_text():
    text = tool_call_lark([TOOLS[0]], "named", "get_weather", quote=52, close=49)
    rules = dict(line.split(": ", 1) for line in text.splitlines())
    first = rules[rules["start"].split()[0]]  # the members, in schema order: the required city comes first
    assert first.startswith('"city:"') and rules["start"].endswith('"}" <[49]>')
    assert "/(?s:[^<]{1,12})/" in rules.values() and any("<[52]> S" in body for body in rules.values())
    assert '"metric"' in text and '("," "units:"' in text  # optional members may be left out
    either = tool_call_lark(TOOLS, "required", None, quote=52, close=49)
    assert '"get_weather{"' in either and '"search{"' in either
