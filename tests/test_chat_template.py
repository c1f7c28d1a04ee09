"""Serve stage tests: our Gemma-4 chat template renders exactly what Google's template renders."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from thorgen.serve.chat_template import ChatTemplate
from thorgen.serve.protocol import APIError, Message
from thorgen.serve.conversation import template_messages

REPO = Path(__file__).resolve().parent.parent
OURS = REPO / "model_spec" / "synth" / "chat_template.jinja"
GOOGLE = REPO.parent / "shared" / "seed_data" / "reference" / "gemma4_chat_template.jinja"


@pytest.fixture(scope="module")
def templates() -> tuple[ChatTemplate, ChatTemplate]:
    if not GOOGLE.exists():
        pytest.skip(f"{GOOGLE} not present")
    return ChatTemplate(GOOGLE.read_text()), ChatTemplate(OURS.read_text())


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "nullable": True},
                "days": {"type": "integer"},
                "where": {
                    "type": "object",
                    "description": "Area",
                    "required": ["lat"],
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                },
                "tags": {"type": "array", "items": {"type": "string"}},
                "stops": {
                    "type": "array",
                    "items": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                },
                "either": {"type": ["string", "null"], "description": "x"},
            },
        },
    },
}
NOARGS = {"type": "function", "function": {"name": "now", "description": "The time"}}
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "c1",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": {
                    "city": "Paris",
                    "days": 2,
                    "ok": True,
                    "where": {"lat": 48.85, "lon": 2.35},
                    "tags": ["a", "b"],
                },
            },
        },
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}},
    ],
}
ANSWERED = dict(
    CALL,
    tool_responses=[
        {"name": "get_weather", "response": {"temp": 21, "sky": "clear"}},
        {"name": "now", "response": "12:00"},
    ],
)

CONVERSATIONS = {
    "user": dict(messages=[USER]),
    "system": dict(messages=[{"role": "system", "content": "  Be brief.  "}, USER]),
    "developer": dict(messages=[{"role": "developer", "content": "Dev rules"}, USER]),
    "thinking": dict(messages=[{"role": "system", "content": "S"}, USER], enable_thinking=True),
    "tools": dict(messages=[{"role": "system", "content": "S"}, USER], tools=[WEATHER, NOARGS]),
    "tools+thinking": dict(messages=[USER], tools=[WEATHER], enable_thinking=True),
    "tool call": dict(messages=[USER, CALL], tools=[WEATHER, NOARGS]),
    "tool results": dict(messages=[USER, ANSWERED], tools=[WEATHER, NOARGS]),
    "tool results+thinking": dict(messages=[USER, ANSWERED], tools=[WEATHER, NOARGS], enable_thinking=True),
    "multi-turn": dict(
        messages=[
            USER,
            ANSWERED,
            {"role": "assistant", "content": "It is 21 C."},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER, NOARGS],
    ),
    "reasoning in history": dict(
        messages=[
            USER,
            {"role": "assistant", "content": "<|channel>thought\nhmm<channel|> Sunny. "},
            {"role": "user", "content": "thanks"},
        ],
        enable_thinking=True,
    ),
    "text parts": dict(
        messages=[{"role": "user", "content": [{"type": "text", "text": " a "}, {"type": "text", "text": "b"}]}]
    ),
    "no generation prompt": dict(messages=[USER, {"role": "assistant", "content": "Hi"}], add_generation_prompt=False),
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_same_prompt_as_google(templates, name):
    google, ours = templates
    kwargs = dict(CONVERSATIONS[name])
    add = kwargs.pop("add_generation_prompt", True)
    expected = google.render(add_generation_prompt=add, **kwargs)
    assert ours.render(add_generation_prompt=add, **kwargs) == expected
    assert expected.startswith("<bos>")


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "array", "object"] if depth < 2 else ["string"])
    out: dict = {"type": kind if rng.random() < 0.8 else [kind, "null"]}
    if rng.random() < 0.6:
        out["description"] = rng.choice(["a value", "ünïcode ✓", "with, comma: and {braces}"])
    if rng.random() < 0.2:
        out["nullable"] = True
    if kind == "string" and rng.random() < 0.3:
        out["enum"] = rng.sample(["x", "y", "z", "w"], 2)
    if kind == "object":
        out["properties"] = {f"k{i}": _random_schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        if out["properties"] and rng.random() < 0.5:
            out["required"] = sorted(out["properties"])[:1]
    if kind == "array" and rng.random() < 0.8:
        out["items"] = _random_schema(rng, depth + 1)
    return out


def _random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "bool", "list", "dict"] if depth < 2 else ["str", "int"]
    kind = rng.choice(kinds)
    return {
        "str": lambda: rng.choice(["Paris", "a,b}", "∑ ü", ""]),
        "int": lambda: rng.randint(-5, 500),
        "float": lambda: rng.choice([0.5, -1.25, 3e-05]),
        "bool": lambda: rng.random() < 0.5,
        "list": lambda: [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
        "dict": lambda: {f"f{i}": _random_value(rng, depth + 1) for i in range(rng.randint(0, 3))},
    }[kind]()


def test_randomized_conversations_match_google(templates):
    google, ours = templates
    rng = random.Random(1234)
    for _ in range(150):
        tools = [
            {
                "type": "function",
                "function": {
                    "name": f"tool_{j}",
                    "description": "does things",
                    "parameters": {"type": "object", "properties": {f"p{i}": _random_schema(rng) for i in range(3)}},
                },
            }
            for j in range(rng.randint(0, 2))
        ]
        msgs: list[dict] = []
        if rng.random() < 0.5:
            msgs.append({"role": rng.choice(["system", "developer"]), "content": " sys "})
        for _turn in range(rng.randint(1, 3)):
            msgs.append({"role": "user", "content": rng.choice(["hi", " spaced ", "ünï"])})
            if rng.random() < 0.5 and tools:
                call = {
                    "role": "assistant",
                    "content": rng.choice([None, "", "text"]),
                    "tool_calls": [
                        {
                            "id": "i",
                            "type": "function",
                            "function": {"name": "tool_0", "arguments": _random_value(rng, 1) or {}},
                        }
                    ],
                }
                if rng.random() < 0.7:
                    call["tool_responses"] = [{"name": "tool_0", "response": _random_value(rng)}]
                msgs.append(call)
            else:
                msgs.append({"role": "assistant", "content": "<|channel>thought\nx<channel|>ok"})
        if rng.random() < 0.5:
            msgs = msgs[:-1]
        kw = dict(messages=msgs, tools=tools or None, add_generation_prompt=rng.random() < 0.8)
        if rng.random() < 0.7:
            kw["enable_thinking"] = rng.random() < 0.5
        assert ours.render(**kw) == google.render(**kw), kw


def test_openai_tool_messages_fold_into_google_form(templates):
    """OpenAI `role: "tool"` results: the server folds them into `tool_responses`, which Google's template renders
    inside the model turn; our template renders the raw OpenAI form the same way."""
    google, ours = templates
    raw = [
        Message(role="user", content="weather?"),
        Message(
            role="assistant",
            content=None,
            tool_calls=[
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ],
        ),
        Message(role="tool", tool_call_id="c2", content="12:00"),
        Message(role="tool", tool_call_id="c1", content='{"temp": 21}'),
    ]
    folded = template_messages(raw)
    assert [m["role"] for m in folded] == ["user", "assistant"]
    assert folded[1]["tool_responses"] == [
        {"name": "now", "response": "12:00"},
        {"name": "get_weather", "response": '{"temp": 21}'},
    ]
    raw_dicts = [m.model_dump(exclude_none=True) for m in raw]
    for m in raw_dicts:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = {"city": "Paris"} if call["id"] == "c1" else {}
    for thinking in (False, True):
        expected = google.render(folded, [WEATHER, NOARGS], enable_thinking=thinking)
        assert ours.render(raw_dicts, [WEATHER, NOARGS], enable_thinking=thinking) == expected
        assert '<|tool_response>response:now{value:<|"|>12:00<|"|>}<tool_response|>' in expected
        assert expected.count("<|turn>model") == 1  # the model continues its own turn after the results


def test_bad_conversations_are_client_errors():
    with pytest.raises(APIError):
        template_messages([Message(role="tool", content="orphan result")])
    with pytest.raises(APIError):
        template_messages([Message(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])])
    with pytest.raises(APIError):
        template_messages(
            [
                Message(
                    role="assistant",
                    content=None,
                    tool_calls=[{"type": "function", "function": {"name": "f", "arguments": "{not json"}}],
                )
            ]
        )
    ours = ChatTemplate(OURS.read_text())
    bad_schema = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"o": {"type": "object", "additionalProperties": False}},
                },
            },
        }
    ]
    with pytest.raises(APIError):
        ours.render([{"role": "user", "content": "x"}], bad_schema)
