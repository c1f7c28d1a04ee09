"""Serve stage tests: OpenAI's Responses API (stateless) through the official `openai` client: text, streaming
(`responses.stream` and the raw event order), function tools over two turns, reasoning items, structured output,
max_output_tokens and the 400s for what needs stored state or built-in tools."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
Q = '<|"|>'
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        if "<|tool_response>" in text:
            return tok.encode("It is sunny.")
        if "weather" in text:
            return tok.encode(f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>")
        if "<|think|>" in text:
            return tok.encode("<|channel>thought\nA greeting.<channel|>Hello!")
        return tok.encode('{"a": 1}')

    backend = ScriptedBackend(script, max_context=4096, chunk=3)
    state = scripted_state(backend, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60), url, backend, tok
    state.close()


def test_text_with_instructions(served):
    client, _, backend, tok = served
    r = client.responses.create(model="m", input="Hi", instructions="Answer in JSON.")
    assert r.status == "completed" and r.output_text == '{"a": 1}'
    assert [item.type for item in r.output] == ["message"]
    assert "Answer in JSON." in tok.decode(backend.calls[-1]["prompt"])
    assert r.usage.input_tokens == len(backend.calls[-1]["prompt"]) and r.usage.output_tokens == 9
    assert r.store is False


def test_max_output_tokens_is_incomplete(served):
    r = served[0].responses.create(model="m", input="Hi", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == '{"a' and r.usage.output_tokens == 3


def test_reasoning_item(served):
    client, _, backend, tok = served
    r = client.responses.create(model="m", input=[{"role": "user", "content": "Hi"}], reasoning={"effort": "high"})
    assert "<|think|>" in tok.decode(backend.calls[-1]["prompt"])
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "A greeting." and r.output_text == "Hello!"
    assert r.usage.output_tokens_details.reasoning_tokens == len("thought\nA greeting.") + 2  # and the delimiters


def test_stream_matches_whole_answer(served):
    client, url, _, _ = served
    kwargs = dict(model="m", input="Hi", reasoning={"effort": "low"})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text == "Hello!"

    def strip(response) -> list[dict]:
        return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in response.output]

    assert strip(final) == strip(whole)
    with httpx.stream("POST", url + "/v1/responses", json={**kwargs, "stream": True}, timeout=60) as r:
        types = [json.loads(line[6:])["type"] for line in r.iter_lines() if line.startswith("data: ")]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-1] == "response.completed" and "response.reasoning_text.delta" in types
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 2


@pytest.mark.parametrize("stream", [False, True])
def test_function_call_over_two_turns(served, stream):
    client, _, backend, tok = served
    history: list = [{"role": "user", "content": "Weather in Paris?"}]
    if stream:
        with client.responses.stream(model="m", input=history, tools=[TOOL]) as s:
            first = s.get_final_response()
    else:
        first = client.responses.create(model="m", input=history, tools=[TOOL])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    history += [item.model_dump(exclude_none=True) for item in first.output]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"})
    second = client.responses.create(model="m", input=history, tools=[TOOL])
    prompt = tok.decode(backend.calls[-1]["prompt"])
    assert "sunny, 21 C" in prompt and "call:get_weather" in prompt and second.output_text == "It is sunny."


def test_tool_choice_and_text_format(served):
    client, _, backend, tok = served
    client.responses.create(
        model="m", input="Hi", tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}
    )
    assert tok.decode(backend.calls[-1]["prompt"]).endswith("<|tool_call>call:get_weather{")
    # the format reaches the engine as a grammar, which the scripted engine refuses (it has no logits to mask)
    with pytest.raises(openai.BadRequestError, match="response_format / forced tool_choice is not supported"):
        client.responses.create(
            model="m", input="Hi", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
        )


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item references"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
    ],
)
def test_refusals(served, extra, names):
    client, url, _, _ = served
    body = {"model": "m", "input": "Hi", **extra}
    r = httpx.post(url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and names in r.json()["error"]["message"], r.json()
    with pytest.raises(openai.BadRequestError):
        client.responses.create(
            model="m", input=body.pop("input"), extra_body={k: v for k, v in body.items() if k != "model"}
        )
