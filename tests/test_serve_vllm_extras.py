"""Serve-stage tests: vLLM's request extras change the answer as vLLM specifies, or get a 400 naming the field.
Through HTTP with the official openai client (`extra_body`) on the tiny model (reference backend); the engine side
of min_tokens on both backends is tests/test_min_tokens.py."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

from tiny_server import openai_client, tiny_server  # noqa: E402

MSGS = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 1024) as (url, state):
        yield openai_client(url), state


def _chat(client, **kw):
    extra = kw.pop("extra_body", {})
    return client.chat.completions.create(model="tiny", messages=MSGS, extra_body=extra, **kw)


def _end_of_turn(state) -> int:
    return state.context.tokenizer.token_to_id("<turn|>")


def test_ignore_eos_runs_to_max_tokens(server):
    client, state = server
    bias = {str(_end_of_turn(state)): 100}  # the answer ends at once
    short = _chat(client, max_tokens=12, logit_bias=bias, temperature=0)
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    full = _chat(client, max_tokens=12, logit_bias=bias, temperature=0, extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 12 and full.choices[0].finish_reason == "length"


def test_min_tokens_holds_the_end_back(server):
    client, state = server
    bias = {str(_end_of_turn(state)): 100}
    r = _chat(
        client, max_tokens=12, logit_bias=bias, temperature=0, extra_body={"min_tokens": 5, "return_token_ids": True}
    )
    ids = r.model_extra["choices"][0]["token_ids"] if r.model_extra.get("choices") else r.choices[0].token_ids
    assert r.usage.completion_tokens == 6 and _end_of_turn(state) not in ids[:5] and ids[5] == _end_of_turn(state)


def test_stop_token_ids_stop_and_leave_their_text_out(server):
    client, _ = server
    plain = client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=10, temperature=0, extra_body={"return_token_ids": True}
    )
    ids = plain.choices[0].token_ids
    stop = ids[3]
    r = client.completions.create(
        model="tiny",
        prompt="Once upon",
        max_tokens=10,
        temperature=0,
        extra_body={"return_token_ids": True, "stop_token_ids": [stop]},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].token_ids == ids[: ids.index(stop) + 1]
    assert len(r.choices[0].text) <= len(plain.choices[0].text)


def test_prompt_logprobs_match_echo_scoring(server):
    client, _ = server
    r = client.completions.create(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 2, "return_token_ids": True},
    )
    entries, prompt_ids = r.choices[0].prompt_logprobs, r.choices[0].prompt_token_ids
    assert entries[0] is None and len(entries) == len(prompt_ids)
    echo = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=0, echo=True, logprobs=2)
    scored = echo.choices[0].logprobs.token_logprobs
    for token, entry, want in zip(prompt_ids[1:], entries[1:], scored[1:]):
        assert abs(entry[str(token)]["logprob"] - want) < 1e-6
        assert len(entry) in (2, 3)
    chat = _chat(client, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 5
    with pytest.raises(openai.BadRequestError):
        _chat(client, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})


@pytest.mark.parametrize(
    "body, check",
    [
        ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"guided_regex": "[a-c]{3}-[0-9]"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]", t)),
        ({"structured_outputs": {"regex": "x[0-9]{2}"}}, lambda t: re.fullmatch("x[0-9]{2}", t)),
        (
            {
                "guided_json": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                }
            },
            lambda t: isinstance(json.loads(t)["ok"], bool),
        ),
        (
            {
                "structured_outputs": {
                    "json": {
                        "type": "object",
                        "properties": {"n": {"enum": [1, 2]}},
                        "required": ["n"],
                        "additionalProperties": False,
                    }
                }
            },
            lambda t: json.loads(t)["n"] in (1, 2),
        ),
        ({"guided_grammar": 'start: "a" "b"+ "c"\n'}, lambda t: re.fullmatch("ab{1,}c", t)),
    ],
)
def test_guided_decoding(server, body, check):
    client, _ = server
    for seed in range(3):
        r = _chat(client, max_tokens=40, temperature=1.0, seed=seed, extra_body=body)
        text = r.choices[0].message.content
        assert check(text), (body, text)
        c = client.completions.create(model="tiny", prompt="Say", max_tokens=40, seed=seed, extra_body=body)
        assert check(c.choices[0].text), (body, c.choices[0].text)


def test_truncate_prompt_tokens_keeps_the_last_ones(server):
    client, _ = server
    prompt = [2] + list(range(200, 230))
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=2,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 7, "return_token_ids": True},
    )
    assert r.usage.prompt_tokens == 7 and r.choices[0].prompt_token_ids == prompt[-7:]
    chat = _chat(client, max_tokens=1, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5


def test_legacy_functions_become_tools(server):
    client, _ = server
    fn = {
        "name": "lookup",
        "description": "Find",
        "parameters": {
            "type": "object",
            "required": ["id"],
            "properties": {"id": {"type": "integer", "minimum": 3, "maximum": 9}},
        },
    }
    r = _chat(
        client,
        max_tokens=40,
        temperature=1.0,
        seed=1,
        extra_body={"functions": [fn], "function_call": {"name": "lookup"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and 3 <= json.loads(call.function.arguments)["id"] <= 9
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=4, tools=[{"type": "function", "function": fn}], extra_body={"functions": [fn]})
    assert err.value.body["param"] == "functions"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_regex": "(?=a)b"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
        ({"ignore_eos": True, "response_format": {"type": "json_object"}}, "ignore_eos"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"function_call": "sometimes"}, "function_call"),
    ],
)
def test_bad_extras_are_refused(server, body, param):
    client, _ = server
    body = {"max_tokens": 4, **body}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MSGS, extra_body=body)
    assert err.value.body["param"] == param, err.value.body
