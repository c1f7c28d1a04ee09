"""Serve-stage tests: tool calls honour their parameter schemas, and schemas the chat template cannot render are
normalized first. Through HTTP with the official openai client on the tiny model's random weights (reference
backend): for each constraint keyword, 10 of 10 forced calls (named and required, streamed and not) validate with
`jsonschema`; a call the model opens itself under tool_choice auto validates too; pydantic-written schemas
(Optional, Enum, nested models by $ref) render and are called; unsupported keywords are a 400 naming them; and
every schema the templates rendered before normalization renders byte-identically after it."""

from __future__ import annotations

import copy
import enum
import json
import sys
from pathlib import Path
from typing import Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from thorgen.serve.protocol import APIError  # noqa: E402
from thorgen.serve.tool_schemas import normalize_parameters, template_tools  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OURS = REPO / "model_spec" / "synth" / "chat_template.jinja"
GOOGLE = REPO.parent / "shared" / "seed_data" / "reference" / "gemma4_chat_template.jinja"
MSGS = [{"role": "user", "content": "Plan it."}]


def obj(required: list[str], **props) -> dict:
    return {"type": "object", "required": required, "properties": props}


# one schema per constraint keyword (each property required, so that the keyword is exercised every time)
KEYWORDS = {
    "maximum": obj(["days"], days={"type": "integer", "minimum": 1, "maximum": 7}),
    "exclusive": obj(["ratio"], ratio={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}),
    "pattern": obj(["code"], code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "minLength": obj(["text"], text={"type": "string", "minLength": 40, "maxLength": 48}),
    "items": obj(
        ["tags"], tags={"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 2, "maxItems": 3}
    ),
    "enum": obj(["mode"], mode={"enum": ["fast", "slow", 3]}),
    "anyOf": obj(["x"], x={"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, {"type": "null"}]}),
    "oneOf": obj(["y"], y={"oneOf": [{"type": "boolean"}, {"type": "string", "pattern": "^z+$", "maxLength": 4}]}),
    "ref": {
        "type": "object",
        "required": ["who"],
        "properties": {"who": {"$ref": "#/$defs/Person"}},
        "$defs": {
            "Person": obj(
                ["name", "age"],
                name={"type": "string", "maxLength": 8},
                age={"type": "integer", "minimum": 0, "maximum": 120},
            )
        },
    },
    "nullable": obj(["n"], n={"type": "string", "maxLength": 3, "nullable": True}),
    "format": obj(["when"], when={"type": "string", "format": "date"}),
    "additionalProperties": obj(
        ["m"], m={"type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9}}
    ),
    "uniqueItems": obj(
        ["s", "t"],
        s={"type": "array", "items": {"enum": ["a", "b", 3]}, "uniqueItems": True, "minItems": 1},
        t={"type": "array", "items": {"type": "string", "maxLength": 3}, "uniqueItems": True},
    ),
}
# what jsonschema checks: OpenAPI's `nullable` is not JSON Schema's, so its schema is written as a type list there
VALIDATE = {**KEYWORDS, "nullable": obj(["n"], n={"type": ["string", "null"], "maxLength": 3})}


def tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 1024) as (url, state):
        yield openai_client(url), state


def _calls(client, tools, choice, seed: int, stream: bool, **extra):
    kw = dict(
        model="tiny",
        messages=MSGS,
        tools=tools,
        tool_choice=choice,
        max_tokens=extra.pop("max_tokens", 160),
        temperature=1.0,
        seed=seed,
        **extra,
    )
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


@pytest.mark.parametrize("keyword", sorted(KEYWORDS))
def test_forced_calls_satisfy_each_keyword(server, keyword):
    client, _ = server
    schema = KEYWORDS[keyword]
    tools = [tool("act", schema), tool("other", obj([]))]
    for i in range(10):
        choice = {"type": "function", "function": {"name": "act"}} if i % 4 < 2 else "required"
        finish, calls = _calls(client, tools, choice, seed=300 + i, stream=i % 2 == 1)
        assert finish == "tool_calls" and calls, (keyword, i, finish, calls)
        name, arguments = calls[0]
        jsonschema.validate(json.loads(arguments), VALIDATE[keyword] if name == "act" else obj([]))


def test_a_call_opened_under_auto_satisfies_its_schema(server):
    """A strong bias makes the model open calls on its own; the arguments of each are held to the schema."""
    client, state = server
    schema = KEYWORDS["maximum"]
    opener = state.context.controls.tool_call_open
    for i in range(6):
        finish, calls = _calls(
            client,
            [tool("act", schema)],
            "auto",
            seed=500 + i,
            stream=i % 2 == 1,
            logit_bias={str(opener): 100},
            parallel_tool_calls=False,
        )
        assert finish == "tool_calls" and calls, (i, finish, calls)
        jsonschema.validate(json.loads(calls[0][1]), schema)


def _pydantic_schema() -> dict:
    pydantic = pytest.importorskip("pydantic")

    class Unit(str, enum.Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Place(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        country: Optional[str] = pydantic.Field(default=None, max_length=4)

    class Query(pydantic.BaseModel):
        place: Place
        unit: Unit
        days: Optional[int] = pydantic.Field(default=None, ge=1, le=5)

    return Query.model_json_schema()


def test_pydantic_schemas_render_and_are_called(server):
    client, _ = server
    schema = _pydantic_schema()
    assert "$defs" in schema and any("anyOf" in p for p in schema["properties"].values())
    tools = [tool("weather", schema)]
    for i in range(6):
        choice = {"type": "function", "function": {"name": "weather"}} if i % 2 else "required"
        finish, calls = _calls(client, tools, choice, seed=700 + i, stream=i % 3 == 0)
        assert finish == "tool_calls" and calls, (i, finish, calls)
        jsonschema.validate(json.loads(calls[0][1]), schema)
    r = client.chat.completions.create(model="tiny", messages=MSGS, tools=tools, max_tokens=4)  # auto renders
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _pydantic_newcomer_schema() -> tuple[dict, object]:
    """What a newcomer's pydantic tool writes: dict[str, int] and plain dict (additionalProperties), set[str]
    (uniqueItems), nested models in $defs, Optional (anyOf with null), Literal of mixed types and a const."""
    pydantic = pytest.importorskip("pydantic")
    from typing import Literal

    class Address(pydantic.BaseModel):
        street: str = pydantic.Field(max_length=12)
        zip: Optional[str] = pydantic.Field(default=None, max_length=5)

    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=8)
        home: Address

    class Order(pydantic.BaseModel):
        counts: dict[str, int]
        labels: set[str]
        notes: dict = pydantic.Field(default_factory=dict)
        owner: Person
        by_city: dict[str, Address] = pydantic.Field(default_factory=dict)
        kind: Literal["box", 1, True]
        version: Literal["v1"]
        priority: Optional[int] = None

    return Order.model_json_schema(), Order


def test_pydantic_dicts_sets_and_literals_render_and_are_called(server):
    client, _ = server
    schema, model = _pydantic_newcomer_schema()
    for template in _templates():
        assert "declaration:order{" in template.render(MSGS, template_tools([tool("order", copy.deepcopy(schema))]))
    tools = [tool("order", schema)]
    for i in range(6):
        choice = {"type": "function", "function": {"name": "order"}} if i % 2 else "required"
        finish, calls = _calls(client, tools, choice, seed=900 + i, stream=i % 3 == 0, max_tokens=440)
        assert finish == "tool_calls" and calls, (i, finish, calls)
        arguments = json.loads(calls[0][1])
        jsonschema.validate(arguments, schema)
        model.model_validate(arguments)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "schema, word",
    [
        (
            obj(["s"], s={"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2}),
            "uniqueItems",
        ),
        (obj(["s"], s={"type": "object", "patternProperties": {"^a": {"type": "integer"}}}), "patternProperties"),
        (obj(["s"], s={"not": {"type": "string"}}), "not"),
        (obj(["s"], s={"type": "string", "format": "hostname-idn"}), "format"),
        (obj(["s"], s={"$ref": "https://example.com/x.json"}), "$ref"),
    ],
)
def test_unenforceable_keywords_are_refused(server, schema, word):
    client, _ = server
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=MSGS, tools=[tool("act", schema)], tool_choice="required", max_tokens=8
        )
    assert word in err.value.body["message"] and err.value.body["param"] == "tools"


# --- normalization for the template -----------------------------------------------------------------------------
RENDERED_BEFORE = [
    obj(["a"], a={"type": "string", "description": "A", "enum": ["x", "y"]}, b={"type": ["integer", "null"]}),
    obj([], deep={"type": "object", "properties": {"k": {"type": "array", "items": {"type": "string"}}}}),
    obj([], arr={"type": "array", "items": {"$ref": "#/$defs/X"}}, n={"type": "number", "nullable": True}),
    {"type": "object", "properties": {}},
    KEYWORDS["pattern"],
    KEYWORDS["items"],
    KEYWORDS["maximum"],
]
FAILED_BEFORE = [
    KEYWORDS["enum"],
    KEYWORDS["anyOf"],
    KEYWORDS["oneOf"],
    KEYWORDS["ref"],
    obj(["c"], c={"type": "object", "title": "Counts", "additionalProperties": {"type": "integer"}}),
    obj([], x={"type": "object", "additionalProperties": True, "title": "X"}),
]


def _templates() -> list[ChatTemplate]:
    found = [ChatTemplate(OURS.read_text())]
    if GOOGLE.exists():
        found.append(ChatTemplate(GOOGLE.read_text()))
    return found


def _render(template: ChatTemplate, params: dict) -> str:
    return template.render(MSGS, [tool("t", params)])


@pytest.mark.parametrize("params", RENDERED_BEFORE + FAILED_BEFORE)
def test_what_rendered_before_renders_byte_identically(params):
    for template in _templates():
        try:
            before = _render(template, copy.deepcopy(params))
        except APIError:
            continue
        assert normalize_parameters(params) is params
        assert _render(template, normalize_parameters(copy.deepcopy(params))) == before


@pytest.mark.parametrize("params", FAILED_BEFORE + ["pydantic"])
def test_what_failed_renders_after_normalization(params):
    params = _pydantic_schema() if params == "pydantic" else params
    for template in _templates():
        with pytest.raises(APIError):
            _render(template, copy.deepcopy(params))
        text = template.render(MSGS, template_tools([tool("t", copy.deepcopy(params))]))
        assert "declaration:t{" in text


def test_normalized_forms():
    n = normalize_parameters(_pydantic_schema())
    props = n["properties"]
    assert props["days"]["type"] == "integer" and props["days"]["nullable"] is True
    assert props["unit"]["type"] == "string" and props["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["place"]["type"] == "object" and props["place"]["properties"]["country"]["nullable"] is True
    assert normalize_parameters(KEYWORDS["enum"])["properties"]["mode"]["type"] == ["string", "integer"]


@pytest.mark.parametrize(
    "params, place",
    [
        (obj([], o=5), "parameters.properties.o"),
        (obj([], a={"type": "array", "items": "x"}), "properties.a.items"),
        (obj([], u={"anyOf": {"type": "string"}}), "properties.u.anyOf"),
        ({**obj([]), "$defs": {"D": []}}, "parameters.$defs.D"),
    ],
)
def test_what_is_no_schema_is_refused_by_its_place(params, place):
    from thorgen.serve.conversation import validate_tools
    from thorgen.serve.protocol import FunctionDef, Tool

    with pytest.raises(APIError) as err:
        validate_tools([Tool(function=FunctionDef(name="t", parameters=params))])
    assert place in err.value.message and err.value.param == "tools"


def test_a_false_property_is_left_out_of_the_prompt():
    params = obj([], never=False, city={"type": "string"})
    for template in _templates():
        text = template.render(MSGS, template_tools([tool("t", params)]))
        assert "city:" in text and "never" not in text
