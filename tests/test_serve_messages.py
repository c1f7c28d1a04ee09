"""Serve stage tests: Anthropic's Messages API through the official `anthropic` client: text, streaming, tools over
two turns, thinking, stop sequences, usage with prefix-cache reads, token counting and Anthropic-shaped errors."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import (  # noqa: E402
    ScriptedBackend,
    ScriptedRunner,
    running_server,
    scripted_state,  # noqa: E402
    write_test_tokenizer,
)

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
Q = '<|"|>'
CACHED = 8  # prompt tokens the test runner reports as read from its prefix cache
TOOL = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


class CachingRunner(ScriptedRunner):
    def prefill(self, seq, start, end, sample, launched=None, beside=False):
        if start == 0:  # (what a prefix-cache hit of CACHED tokens reports; a script holds no K/V to reuse)
            seq.cached_prompt_tokens = min(CACHED, len(seq.prompt) - 1)
        return super().prefill(seq, start, end, sample, launched, beside)


class CachingBackend(ScriptedBackend):
    def runner(self, max_num_seqs: int = 8, kv_tokens: int | None = None) -> CachingRunner:
        return CachingRunner(self, max_num_seqs, kv_tokens)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        if "<|tool_response>" in text:
            return tok.encode("It is sunny in Paris.")
        if "weather" in text:
            return tok.encode(f"Let me look.<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>")
        if "<|think|>" in text:
            return tok.encode("<|channel>thought\nThe user greets me.<channel|>Hello!")
        return tok.encode("Hello there. STOP here")

    backend = CachingBackend(script, max_context=4096, chunk=3)
    state = scripted_state(backend, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        yield anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=60), url, backend, tok
    state.close()


def test_text_and_usage(served):
    client, _, backend, _ = served
    msg = client.messages.create(
        model="m", max_tokens=64, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there. STOP here"
    assert msg.stop_reason == "end_turn" and msg.role == "assistant"
    prompt = backend.calls[-1]["prompt"]
    assert msg.usage.cache_read_input_tokens == CACHED
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(prompt)
    assert msg.usage.cache_creation_input_tokens == 0
    assert msg.usage.output_tokens == len("Hello there. STOP here") + 1  # one token a character, and the stop
    count = client.messages.count_tokens(model="m", system="Be brief.", messages=[{"role": "user", "content": "Hi"}])
    assert count.input_tokens == len(prompt)


def test_stop_sequence_and_max_tokens(served):
    client = served[0]
    msg = client.messages.create(
        model="m", max_tokens=64, stop_sequences=["STOP"], messages=[{"role": "user", "content": "Hi"}]
    )
    assert msg.content[0].text == "Hello there. " and msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == "STOP"
    msg = client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "Hi"}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3


def test_stream_matches_whole_answer(served):
    client, url, _, _ = served
    kwargs = dict(
        model="m",
        max_tokens=64,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Hi"}],
    )
    kwargs["max_tokens"] = 2048
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason == "end_turn"
    assert streamed.usage.model_dump() == whole.usage.model_dump()
    with httpx.stream("POST", url + "/v1/messages", json={**kwargs, "stream": True}, timeout=60) as r:
        names = [line[len("event: ") :] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2


def test_thinking_blocks(served):
    client, _, backend, tok = served
    msg = client.messages.create(
        model="m",
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert "<|think|>" in tok.decode(backend.calls[-1]["prompt"])
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "The user greets me." and msg.content[0].signature
    assert msg.content[1].text == "Hello!"
    plain = client.messages.create(
        model="m", max_tokens=64, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Hi"}]
    )
    assert "<|think|>" not in tok.decode(backend.calls[-1]["prompt"]) and plain.content[0].type == "text"


@pytest.mark.parametrize("stream", [False, True])
def test_tools_over_two_turns(served, stream):
    client, _, backend, tok = served
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    kwargs = dict(model="m", max_tokens=256, tools=[TOOL])
    if stream:
        with client.messages.stream(messages=history, **kwargs) as s:
            first = s.get_final_message()
    else:
        first = client.messages.create(messages=history, **kwargs)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["text", "tool_use"]
    call = first.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id.startswith("toolu_")
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
    ]
    second = client.messages.create(messages=history, **kwargs)
    prompt = tok.decode(backend.calls[-1]["prompt"])
    assert "sunny" in prompt and "call:get_weather" in prompt
    assert second.stop_reason == "end_turn" and second.content[0].text == "It is sunny in Paris."


def test_tool_choice_forces_a_call(served):
    client, _, backend, tok = served
    client.messages.create(
        model="m",
        max_tokens=64,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert tok.decode(backend.calls[-1]["prompt"]).endswith("<|tool_call>call:get_weather{")
    client.messages.create(
        model="m",
        max_tokens=64,
        tools=[TOOL],
        tool_choice={"type": "none"},
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert "declaration:get_weather" not in tok.decode(backend.calls[-1]["prompt"])


@pytest.mark.parametrize(
    "body, names",
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "mcp_servers": [{"url": "x"}]},
            "mcp_servers",
        ),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "container": "c"}, "container"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "frobnicate": 1}, "frobnicate"),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [TOOL],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "nope",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search_20250305",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 10},
            },
            "budget_tokens",
        ),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        (
            {
                "max_tokens": 2048,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Su"}],
            },
            "prefill",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                ],
            },
            "tool_use",
        ),
        (
            {"max_tokens": 8, "stop_sequences": ["x"] * 17, "messages": [{"role": "user", "content": "Hi"}]},
            "stop_sequences",
        ),
        ({"max_tokens": 8, "temperature": float("nan"), "messages": [{"role": "user", "content": "Hi"}]}, "finite"),
        (
            {
                "max_tokens": 8,
                "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}},
                "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "{"}],
            },
            "output_config.format",
        ),
    ],
)
def test_errors_in_anthropic_shape(served, body, names):
    client, url, _, _ = served
    payload = json.dumps({"model": "m", **body})  # (json writes NaN, which Python's json reads back)
    r = httpx.post(url + "/v1/messages", content=payload, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert names in err["error"]["message"], err
    if "max_tokens" in body and "temperature" not in body:  # the client insists on max_tokens (and on JSON: no NaN)
        rest = {k: v for k, v in body.items() if k not in ("max_tokens", "messages")}
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="m", max_tokens=body["max_tokens"], messages=body["messages"], extra_body=rest)
        assert caught.value.body["error"]["type"] == "invalid_request_error"


HI = {"role": "user", "content": "Hi"}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "A tool will know.", "signature": "c2ln"},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
    ],
}
ANSWERED = {
    "role": "user",
    "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "text", "text": "And tomorrow?"},
    ],
}
THINKING = {"type": "enabled", "budget_tokens": 1024}
# request shapes whose prompt count_tokens must count exactly as /v1/messages charges it
COUNTED = {
    "plain": {"messages": [HI]},
    "system": {"system": "Be brief.", "messages": [HI]},
    "system blocks": {
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [HI],
    },
    "tools": {"tools": [TOOL], "messages": [ASK]},
    "tool_choice auto": {"tools": [TOOL], "tool_choice": {"type": "auto"}, "messages": [ASK]},
    "tool_choice any": {"tools": [TOOL], "tool_choice": {"type": "any"}, "messages": [HI]},
    "tool_choice tool": {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}, "messages": [HI]},
    "tool_choice tool, no parallel calls": {
        "tools": [TOOL],
        "messages": [HI],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
    },
    "tool_choice none": {"tools": [TOOL], "tool_choice": {"type": "none"}, "messages": [HI]},
    "thinking on": {"thinking": THINKING, "messages": [HI]},
    "thinking off": {"thinking": {"type": "disabled"}, "messages": [HI]},
    "thinking, system, forced tool": {
        "thinking": THINKING,
        "system": "Be brief.",
        "tools": [TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [HI],
    },
    "tool turns": {"tools": [TOOL], "system": "Be brief.", "messages": [ASK, CALLED, ANSWERED]},
    "tool turns, thinking": {"tools": [TOOL], "thinking": THINKING, "messages": [ASK, CALLED, ANSWERED]},
    "several turns": {"messages": [HI, {"role": "assistant", "content": "Hello."}, HI]},
}


@pytest.mark.parametrize("shape", COUNTED)
def test_count_tokens_counts_what_messages_charges(served, shape):
    """count_tokens renders the prompt with the very function /v1/messages generates from: the count equals the
    input the answer reports (its cache reads included) and the prompt the engine got."""
    client, _, backend, _ = served
    body = {"model": "m", **COUNTED[shape]}
    counted = client.messages.count_tokens(**body).input_tokens
    msg = client.messages.create(max_tokens=2048 if "thinking" in body else 64, **body)
    assert msg.usage.cache_read_input_tokens == CACHED
    assert counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(backend.calls[-1]["prompt"])


def test_count_tokens_refuses_what_messages_refuses(served):
    """A prefill with thinking on is refused alike by both endpoints."""
    _, url, _, _ = served
    body = {"model": "m", "thinking": THINKING, "messages": [HI, {"role": "assistant", "content": "Su"}]}
    counted = httpx.post(url + "/v1/messages/count_tokens", json=body, timeout=30)
    answered = httpx.post(url + "/v1/messages", json={**body, "max_tokens": 2048}, timeout=30)
    assert counted.status_code == answered.status_code == 400
    assert counted.json() == answered.json() and "prefill" in counted.json()["error"]["message"]


@pytest.mark.parametrize(
    "content", ["Sure, here", [{"type": "text", "text": "Sure, "}, {"type": "text", "text": "here"}]]
)
def test_a_final_assistant_message_is_continued(served, content):
    """The prefill ends the prompt, right after the generation prompt; the answer holds the continuation only,
    and count_tokens counts that very prompt."""
    client, _, backend, tok = served
    messages = [HI, {"role": "assistant", "content": content}]
    msg = client.messages.create(model="m", max_tokens=64, messages=messages)
    prompt = tok.decode(backend.calls[-1]["prompt"])
    assert prompt.endswith("<|turn>model\n<|channel>thought\n<channel|>Sure, here"), prompt[-80:]
    assert msg.content[0].text == "Hello there. STOP here" and msg.stop_reason == "end_turn"
    assert client.messages.count_tokens(model="m", messages=messages).input_tokens == len(backend.calls[-1]["prompt"])
