"""Serve stage tests: the official `openai` client against the tiny model on the reference backend:
response_format json_schema / json_object make random weights write schema-valid JSON (streamed and not),
logprobs match the reference backend's own softmax (chat and completions, streamed equals whole), and
penalties and logit_bias reach the sampler."""

from __future__ import annotations

import json

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

from tiny_server import openai_client, tiny_server  # noqa: E402

MSGS = [{"role": "user", "content": "Describe a city as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "big": {"type": "boolean"}, "rank": {"enum": [1, 2, 3]}},
    "required": ["name", "big", "rank"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 512) as running:
        yield running


@pytest.fixture()
def client(server):
    return openai_client(server[0])


def _valid(value: dict) -> None:
    assert set(value) == {"name", "big", "rank"} and isinstance(value["name"], str) and len(value["name"]) <= 8
    assert isinstance(value["big"], bool) and value["rank"] in (1, 2, 3)


def test_json_schema_from_random_weights(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=120, temperature=1.0, seed=seed, response_format=fmt
        )
        assert r.choices[0].finish_reason == "stop"
        _valid(json.loads(r.choices[0].message.content))
        text = "".join(
            ch.choices[0].delta.content or ""
            for ch in client.chat.completions.create(
                model="tiny",
                messages=MSGS,
                max_tokens=120,
                temperature=1.0,
                seed=seed,
                response_format=fmt,
                stream=True,
            )
            if ch.choices
        )
        assert text == r.choices[0].message.content
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=40, temperature=1.0, seed=0)
    with pytest.raises(ValueError):  # without the constraint the same weights do not write JSON
        json.loads(plain.choices[0].message.content or "")


def test_json_object_and_thinking(client, server):
    # Free-form keys let random weights ramble inside a string; a bias toward the closing quote and brace
    # (which the grammar only allows where they are valid) ends the object within the budget.
    tok = server[1].context.tokenizer
    bias = {str(t): 6 for t in tok.encode('"') + tok.encode("}")}
    for thinking in (False, True):
        r = client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=200,
            temperature=1.0,
            seed=4,
            response_format={"type": "json_object"},
            logit_bias=bias,
            extra_body={"chat_template_kwargs": {"enable_thinking": thinking}},
        )
        assert r.choices[0].finish_reason == "stop", r.choices[0].message
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_invalid_schema_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="schema is invalid"):
        client.chat.completions.create(
            model="tiny",
            messages=MSGS,
            max_tokens=4,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            },
        )


def _log_softmax(row: np.ndarray) -> np.ndarray:
    m = row.max()
    return row - m - np.log(np.sum(np.exp(row - m)))


def test_chat_logprobs_are_the_reference_softmax(client, server):
    state = server[1]
    r = client.chat.completions.create(
        model="tiny",
        messages=MSGS,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    ids, content = choice.model_dump()["token_ids"], choice.logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    prompt = choice.model_dump()["prompt_token_ids"]
    target = state.client.backend.target
    rows = target.forward(prompt + ids, target.new_cache()).logits.astype(np.float64)[len(prompt) - 1 :]
    for i, (tok, entry) in enumerate(zip(ids, content)):
        ref = _log_softmax(rows[i])
        assert entry.logprob == pytest.approx(ref[tok], abs=1e-4)
        assert entry.token == state.context.tokenizer.decode([tok]) and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(ref.max(), abs=1e-4)
    streamed = [
        e.logprob
        for ch in client.chat.completions.create(
            model="tiny", messages=MSGS, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
        if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content
    ]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_completion_logprobs(client):
    r = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=1.0, seed=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    streamed = [
        v
        for ch in client.completions.create(
            model="tiny", prompt="Once upon", max_tokens=5, temperature=1.0, seed=3, logprobs=2, stream=True
        )
        if ch.choices[0].logprobs
        for v in ch.choices[0].logprobs.token_logprobs
    ]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_penalties_and_bias_reach_the_sampler(client):
    def ids(**kw) -> list[int]:
        r = client.completions.create(
            model="tiny",
            prompt="Once upon",
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True, **kw.pop("extra", {})},
            **kw,
        )
        return r.choices[0].model_dump()["token_ids"]

    plain = ids()
    assert ids(logit_bias={"333": 100}) == [333] * 8
    assert ids(frequency_penalty=2.0, presence_penalty=2.0) != plain
    assert ids(extra={"repetition_penalty": 1.0}) == plain
