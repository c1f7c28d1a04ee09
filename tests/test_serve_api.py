"""Serve stage tests: the HTTP API on a scripted engine: tools, reasoning, stop, bad input, auth, CORS, health."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.runtime.client import EngineClient  # noqa: E402
from thorgen.serve.app import ServerState, create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
Q = '<|"|>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "required": ["city"],
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
SCRIPT = {"out": ""}  # what the scripted engine answers, set per test


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(tok) -> ScriptedBackend:
    return ScriptedBackend(lambda prompt: tok.encode(SCRIPT["out"]), max_context=600, chunk=2)


@pytest.fixture(scope="module")
def server(engine, tok):
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state, cors_origins=["http://ui.example"])) as url:
        yield url, state


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def said(engine: ScriptedBackend, tok: Tokenizer) -> str:
    return tok.decode(engine.calls[-1]["prompt"])


def test_tool_calls_stream_and_not(client, engine, tok):
    SCRIPT["out"] = (
        f"<|tool_call>call:get_weather{{city:{Q}Zürich, CH{Q},days:2}}<tool_call|>"
        f"<|tool_call>call:now{{}}<tool_call|><|tool_response>"
    )
    msgs = [{"role": "user", "content": "weather?"}]
    r = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Zürich, CH", "days": 2}), ("now", {})]
    assert all(c.id and c.type == "function" for c in choice.message.tool_calls)
    assert "declaration:get_weather" in said(engine, tok)

    chunks = list(client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, stream=True))
    streamed = {}
    for ch in chunks:
        for d in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            assert d.id and d.type == "function" and d.function.name  # strict clients need all three each time
            streamed.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments
        if ch.choices and ch.choices[0].delta.content:
            assert "<|" not in ch.choices[0].delta.content
    assert [(n, json.loads(a)) for _, (n, a) in sorted(streamed.items())] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    one = client.chat.completions.create(model="x", messages=msgs, tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    assert one.choices[0].finish_reason == "tool_calls"


def test_tool_results_and_tool_choice(client, engine, tok):
    SCRIPT["out"] = "<|tool_call>call:now{}<tool_call|>"
    history = [
        {"role": "user", "content": "time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c9", "type": "function", "function": {"name": "now", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c9", "content": "12:00"},
    ]
    client.chat.completions.create(model="x", messages=history, tools=TOOLS)
    prompt = said(engine, tok)
    assert prompt.endswith(
        f"<|tool_call>call:now{{}}<tool_call|><|tool_response>response:now{{value:{Q}12:00{Q}}}"
        "<tool_response|><|channel>thought\n<channel|>"
    )
    SCRIPT["out"] = f"city:{Q}Oslo{Q}}}<tool_call|>"  # the prompt already opened the call
    r = client.chat.completions.create(
        model="x",
        messages=history[:1],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    assert said(engine, tok).endswith("<|tool_call>call:get_weather{")
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    SCRIPT["out"] = "just text"
    r = client.chat.completions.create(model="x", messages=history[:1], tools=TOOLS, tool_choice="none")
    assert "<|tool>" not in said(engine, tok) and r.choices[0].message.content == "just text"
    client.chat.completions.create(model="x", messages=history[:1], tools=TOOLS, tool_choice="required")
    assert said(engine, tok).endswith("<|tool_call>call:")


def test_reasoning_on_and_off(client, engine, tok):
    SCRIPT["out"] = "<|channel>thought\nFirst, 2+2.<channel|>It is 4.<turn|>"
    msgs = [{"role": "user", "content": "2+2?"}]
    r = client.chat.completions.create(
        model="x", messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    m = r.choices[0].message.model_dump()
    assert (m["content"], m["reasoning_content"], m["reasoning"]) == ("It is 4.", "First, 2+2.", "First, 2+2.")
    assert "<|think|>" in said(engine, tok) and said(engine, tok).endswith("<|turn>model\n")
    text, thought = "", ""
    for ch in client.chat.completions.create(model="x", messages=msgs, stream=True, reasoning_effort="high"):
        d = ch.choices[0].delta.model_dump() if ch.choices else {}
        text += d.get("content") or ""
        thought += d.get("reasoning_content") or ""
        assert d.get("reasoning_content") == d.get("reasoning")
    assert (text, thought) == ("It is 4.", "First, 2+2.")
    SCRIPT["out"] = "It is 4."
    r = client.chat.completions.create(model="x", messages=msgs)
    assert "<|think|>" not in said(engine, tok) and said(engine, tok).endswith("<|channel>thought\n<channel|>")
    assert r.choices[0].message.model_dump().get("reasoning_content") is None


def test_stop_usage_and_length(client, engine, tok):
    SCRIPT["out"] = "alpha beta gamma delta"
    msgs = [{"role": "user", "content": "go"}]
    r = client.chat.completions.create(model="x", messages=msgs, stop=["gam", "zz"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("alpha beta ", "stop")
    text = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(model="x", messages=msgs, stop="a g", stream=True)
        if ch.choices
    )
    assert text == "alpha bet"
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.usage.prompt_tokens == len(engine.calls[-1]["prompt"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3
    chunks = list(
        client.chat.completions.create(model="x", messages=msgs, stream=True, stream_options={"include_usage": True})
    )
    # + 1: the script runs out and the scripted model ends its turn with a stop id, which counts (as in vLLM)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tok.encode(SCRIPT["out"])) + 1


def test_return_token_ids(server, engine, tok):
    """vLLM's return_token_ids: the generated ids (stop id included) and the prompt ids, streamed and not."""
    url = server[0]
    SCRIPT["out"] = "ab<turn|>"
    body = {"model": "x", "messages": [{"role": "user", "content": "go"}], "return_token_ids": True}
    choice = httpx.post(url + "/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["token_ids"] == tok.encode("ab<turn|>") and choice["message"]["content"] == "ab"
    assert choice["prompt_token_ids"] == engine.calls[-1]["prompt"]
    for endpoint, extra in (("/v1/chat/completions", {}), ("/v1/completions", {"prompt": "x", "max_tokens": 9})):
        req = (
            dict(body, stream=True, **extra)
            if not extra
            else {"model": "x", "stream": True, "return_token_ids": True, **extra}
        )
        with httpx.stream("POST", url + endpoint, json=req) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
        assert ids == tok.encode("ab<turn|>")
    plain = httpx.post(url + "/v1/completions", json={"model": "x", "prompt": "x"}).json()["choices"][0]
    assert "token_ids" not in plain


def test_completions_endpoint(client, engine, tok):
    SCRIPT["out"] = "abc<eos>"
    r = client.completions.create(model="x", prompt="Once", max_tokens=10)
    assert r.choices[0].text == "abc" and r.choices[0].finish_reason == "stop"
    assert engine.calls[-1]["prompt"] == tok.encode("<bos>Once")
    assert (
        "".join(
            c.choices[0].text for c in client.completions.create(model="x", prompt="Once", stream=True) if c.choices
        )
        == "abc"
    )


BAD = [
    ("malformed json", b"{not json", 400),
    ("wrong type", {"messages": "hi"}, 400),
    ("empty messages", {"messages": []}, 400),
    ("unknown role", {"messages": [{"role": "bot", "content": "x"}]}, 400),
    ("n=17", {"messages": [{"role": "user", "content": "x"}], "n": 17}, 400),
    ("penalty", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 2.5}, 400),
    ("repetition_penalty", {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, 400),
    ("top_logprobs", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}, 400),
    ("top_logprobs_alone", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400),
    ("logprobs_type", {"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, 400),
    ("logit_bias_id", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"999999": 1}}, 400),
    ("logit_bias_key", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, 400),
    ("logit_bias_value", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": "big"}}, 400),
    ("response_format", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, 400),
    (
        "json_schema_missing",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a"}},
        },
        400,
    ),
    (
        "json_schema_invalid",
        {
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            },
        },
        400,
    ),
    ("temperature", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("too long", {"messages": [{"role": "user", "content": "x" * 700}]}, 400),
    ("max_tokens over ctx", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10000}, 400),
    (
        "bad tool",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "bad name!"}}],
        },
        400,
    ),
    (
        "bad schema",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"o": 5},
                        },
                    },
                }
            ],
        },
        400,
    ),
    (
        "unknown tool_choice",
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        400,
    ),
    ("image", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}, 400),
    ("orphan tool", {"messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, 400),
    (
        "thinking flag",
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": "yes"}},
        400,
    ),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx_error_object(server, name, body, status):
    url = server[0] + "/v1/chat/completions"
    r = (
        httpx.post(url, content=body, headers={"content-type": "application/json"})
        if isinstance(body, bytes)
        else httpx.post(url, json=body)
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if name == "malformed json":
        assert "not valid JSON" in err["message"]
    if name == "bad schema":  # named by its place, never a template internal
        assert "parameters.properties.o" in err["message"] and "template" not in err["message"], err


def test_worker_alive_after_bad_input(client):
    SCRIPT["out"] = "fine"
    assert (
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "x"}])
        .choices[0]
        .message.content
        == "fine"
    )


def test_models_tokenize_metrics_cors(server, tok):
    url, state = server
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == state.model_id
    ids = httpx.post(url + "/tokenize", json={"prompt": "hi ∑"}).json()
    assert ids["tokens"] == tok.encode("<bos>hi ∑") and ids["count"] == len(ids["tokens"])
    assert httpx.post(url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"] == "<bos>hi ∑"
    assert httpx.post(url + "/detokenize", json={"tokens": [10**6]}).status_code == 400
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert tok.decode(chat["tokens"]).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    metrics = httpx.get(url + "/metrics").text
    assert 'thorgen_requests_total{endpoint="/v1/chat/completions",status="200"}' in metrics
    assert "thorgen_time_to_first_token_seconds_count" in metrics and "thorgen_generation_tokens_total" in metrics
    gauges = {ln.split()[0]: float(ln.split()[1]) for ln in metrics.splitlines() if ln.startswith("thorgen_kv_cache")}
    assert (
        gauges["thorgen_kv_cache_blocks"] > 0
        and 0 <= gauges["thorgen_kv_cache_blocks_used"] <= gauges["thorgen_kv_cache_blocks"]
        and 0 <= gauges["thorgen_kv_cache_usage"] <= 1
    )
    pre = httpx.options(
        url + "/v1/chat/completions", headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"}
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ui.example"
    assert "access-control-allow-origin" not in httpx.get(url + "/v1/models", headers={"Origin": "http://evil"}).headers


def test_api_key_and_health_while_loading(tok):
    gate = threading.Event()
    engine = ScriptedBackend(lambda p: tok.encode("ok"))

    def loader():
        gate.wait(10)
        client = EngineClient(lambda: engine)
        client.wait_ready()
        return client, tok, ChatTemplate(TEMPLATE.read_text()), {"eos_token_id": [1, 106, 50]}

    state = ServerState("m", loader)
    with running_server(create_app(state, api_key="sekrit")) as url:
        state.load_in_background()
        assert httpx.get(url + "/health").status_code == 503
        body = {"messages": [{"role": "user", "content": "x"}]}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer sekrit"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        gate.set()
        for _ in range(200):
            if httpx.get(url + "/health").status_code == 200:
                break
            threading.Event().wait(0.02)
        health = httpx.get(url + "/health").json()
        assert {k: health[k] for k in ("status", "running", "queued")} == {"status": "ok", "running": 0, "queued": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0)
        assert ok.chat.completions.create(model="m", messages=body["messages"]).choices[0].message.content == "ok"
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": "wrong"})
        assert r.status_code == 401
        r = httpx.post(url + "/v1/chat/completions", json=body | {"model": "m"}, headers={"x-api-key": "sekrit"})
        assert r.status_code == 200  # (Anthropic's clients send the key this way)
