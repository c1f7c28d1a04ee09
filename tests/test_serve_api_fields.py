"""Serve stage tests through the official clients on the tiny checkpoint (reference backend): Anthropic's prefill
(the answer continues a final assistant message) and structured outputs (output_config.format), the Responses
API's seed, errors that name each API's own fields, and NaN / infinite numbers refused as such."""

from __future__ import annotations

import json

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

from tiny_server import tiny_server  # noqa: E402

CTX = 1024
HI = [{"role": "user", "content": "Hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, ctx=CTX) as (url, _):
        yield (
            url,
            anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120),
            openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120),
        )


def test_prefill_is_continued(served) -> None:
    _, claude, _ = served
    messages = [*HI, {"role": "assistant", "content": "The answer is"}]
    msg = claude.messages.create(model="tiny", max_tokens=5, messages=messages)
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.usage.output_tokens >= 1
    counted = claude.messages.count_tokens(model="tiny", messages=messages).input_tokens
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    assert counted > claude.messages.count_tokens(model="tiny", messages=HI).input_tokens


def test_output_config_holds_the_answer_to_its_schema(served) -> None:
    _, claude, _ = served
    for seed_text in ("Weather?", "Plan a trip.", "Where to?"):
        msg = claude.messages.create(
            model="tiny",
            max_tokens=400,
            messages=[{"role": "user", "content": seed_text}],
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
        )
        assert [b.type for b in msg.content] == ["text"] and msg.stop_reason == "end_turn"
        jsonschema.validate(json.loads(msg.content[0].text), SCHEMA)
    beta = claude.messages.create(
        model="tiny",
        max_tokens=400,
        messages=HI,
        extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}},
    )
    jsonschema.validate(json.loads(beta.content[0].text), SCHEMA)


def test_responses_seed_repeats_a_sample(served) -> None:
    _, _, oai = served

    def sample(seed: int) -> str:
        r = oai.responses.create(
            model="tiny", input="Hi", temperature=1.0, max_output_tokens=12, extra_body={"seed": seed}
        )
        return r.output_text

    assert sample(5) == sample(5)
    assert len({sample(5), sample(6), sample(7)}) > 1


def test_errors_name_each_apis_own_fields(served) -> None:
    _, claude, oai = served
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="tiny", input="Hi", max_output_tokens=CTX)
    assert caught.value.param == "max_output_tokens" and "max_output_tokens" in caught.value.body["message"]
    assert "max_tokens" not in caught.value.body["message"].replace("max_output_tokens", "")
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="tiny", input="word " * 2000, max_output_tokens=4)
    assert caught.value.param == "input" and "input" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=HI, max_completion_tokens=CTX)
    assert caught.value.param == "max_completion_tokens"
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=CTX, messages=HI)
    assert "max_tokens" in caught.value.body["error"]["message"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": HI, "temperature": float("nan")}),
        ("/v1/chat/completions", {"messages": HI, "top_p": float("inf")}),
        ("/v1/completions", {"prompt": "Hi", "presence_penalty": float("-inf")}),
        ("/v1/responses", {"input": "Hi", "temperature": float("nan")}),
        ("/v1/messages", {"messages": HI, "max_tokens": 4, "top_p": float("nan")}),
    ],
)
def test_non_finite_numbers_are_refused_as_such(served, path, body) -> None:
    url = served[0]
    content = json.dumps({"model": "tiny", **body})  # NaN / Infinity: what Python's json writes and reads
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "must be a finite number" in err["message"] and "less than" not in err["message"], err


def test_a_budget_past_the_context_points_at_ctx(served) -> None:
    _, claude, _ = served
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=CTX, messages=HI)
    assert "--ctx" in caught.value.body["error"]["message"]
