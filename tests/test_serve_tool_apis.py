"""Serve-stage tests: tool schemas are honoured on every API with tools, not only chat: a forced call through
Anthropic's /v1/messages (tool_choice {"type": "tool"}) and through /v1/responses (tool_choice {"type": "function"})
holds its arguments to `maximum` and `pattern`, and a schema the chat template cannot render as sent (pydantic's
nullable anyOf, a typeless enum) is normalized for it there too. The official anthropic and openai clients on the
tiny model (reference backend), sampling at temperature 1, so that only the grammar keeps the arguments valid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tiny_server import openai_client, tiny_server  # noqa: E402

BOUNDED = {
    "type": "object",
    "required": ["days", "code"],
    "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
    },
}
# what the template cannot render unnormalized: a nullable anyOf and an enum without a type
UNTYPED = {
    "type": "object",
    "required": ["unit", "days"],
    "properties": {
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 5}, {"type": "null"}]},
    },
}
RUNS = 10


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 1024) as (url, state):
        yield url, state


def _anthropic(url: str):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


def _messages_call(url: str, schema: dict, stream: bool) -> tuple[str, dict]:
    client = _anthropic(url)
    # temperature goes in the body: this client version dropped the argument
    kw = dict(
        model="tiny",
        max_tokens=160,
        extra_body={"temperature": 1.0},
        messages=[{"role": "user", "content": "Plan it."}],
        tools=[
            {"name": "act", "description": "act", "input_schema": schema},
            {"name": "other", "description": "other", "input_schema": {"type": "object"}},
        ],
        tool_choice={"type": "tool", "name": "act"},
    )
    if stream:
        with client.messages.stream(**kw) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**kw)
    assert message.stop_reason == "tool_use", message
    calls = [b for b in message.content if b.type == "tool_use"]
    assert calls, message
    return calls[0].name, calls[0].input


def _responses_call(url: str, schema: dict) -> tuple[str, dict]:
    r = openai_client(url).responses.create(
        model="tiny",
        input="Plan it.",
        max_output_tokens=160,
        temperature=1.0,
        tools=[
            {"type": "function", "name": "act", "description": "act", "parameters": schema},
            {"type": "function", "name": "other", "description": "other", "parameters": {"type": "object"}},
        ],
        tool_choice={"type": "function", "name": "act"},
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls, r.output
    return calls[0].name, json.loads(calls[0].arguments)


def test_messages_forced_call_honours_maximum_and_pattern(server):
    url, _ = server
    for i in range(RUNS):
        name, arguments = _messages_call(url, BOUNDED, stream=i % 2 == 1)
        assert name == "act"
        jsonschema.validate(arguments, BOUNDED)


def test_responses_forced_call_honours_maximum_and_pattern(server):
    url, _ = server
    for _ in range(RUNS):
        name, arguments = _responses_call(url, BOUNDED)
        assert name == "act"
        jsonschema.validate(arguments, BOUNDED)


def test_schemas_are_normalized_for_the_template_on_every_api(server):
    url, _ = server
    name, arguments = _messages_call(url, UNTYPED, stream=False)
    assert name == "act"
    jsonschema.validate(arguments, UNTYPED)
    name, arguments = _responses_call(url, UNTYPED)
    assert name == "act"
    jsonschema.validate(arguments, UNTYPED)
    # count_tokens renders the same normalized tools as the answer's prompt
    client = _anthropic(url)
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Plan it."}],
        tools=[{"name": "act", "description": "act", "input_schema": UNTYPED}],
    )
    counted = client.messages.count_tokens(**kw).input_tokens
    usage = client.messages.create(max_tokens=1, **kw).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens > 0  # a cache read counts apart
