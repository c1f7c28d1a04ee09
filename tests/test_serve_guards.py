"""Serve stage tests: no request can stall the server: body limit, off-loop prompts, lone surrogates, strict types,
405 Allow, /v1/models/{id}, aborted streams in /metrics, bounded shutdown."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from thorgen.runtime.text.tokenizer import Tokenizer
from thorgen.serve.app import create_app
from thorgen.serve.chat_template import ChatTemplate
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def make_state(tok: Tokenizer, reply: str = "ok", **kw):
    engine = ScriptedBackend(lambda prompt: tok.encode(reply), **kw)
    return engine, scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))


def test_big_bodies_do_not_stall_a_stream(tok):
    """A 20 MB body gets a 413 (declared or chunked), a 5 MB message a quick 400, while a stream keeps flowing."""
    engine, state = make_state(tok, "word " * 2000, max_context=8192, delay=0.01)
    gaps: list[float] = []
    with running_server(create_app(state, max_body_bytes=8 << 20)) as url:
        started = threading.Event()

        def stream() -> None:
            body = {"messages": MSG, "stream": True, "max_tokens": 400}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                        started.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(10)
        huge = json.dumps({"messages": [{"role": "user", "content": "x" * (20 << 20)}]}).encode()
        with httpx.Client(timeout=60) as http:
            r = http.post(url + "/v1/chat/completions", content=huge, headers={"content-type": "application/json"})
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            chunked = http.post(
                url + "/v1/chat/completions",
                headers={"content-type": "application/json"},
                content=(huge[i : i + (1 << 20)] for i in range(0, len(huge), 1 << 20)),
            )
            assert chunked.status_code == 413
            start = time.perf_counter()
            r = http.post(
                url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * (5 << 20)}]}
            )
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
            assert time.perf_counter() - start < 3.0
            assert http.get(url + "/health").status_code == 200  # the same connection still works
        reader.join(60)
    assert len(gaps) > 100
    assert max(gaps) < 1.0, f"the stream stalled for {max(gaps):.2f} s"


SURROGATE_BODIES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
        "messages[0].content[0].text",
    ),
    (
        "/v1/chat/completions",
        {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "description": "bad \ud83d"}}]},
        "tools[0].function.description",
    ),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/chat/completions", {"messages": MSG, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs.\\ud800"),
    ("/v1/completions", {"prompt": "x\udc00"}, "prompt"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "system", "content": "\ud800"}]}, "messages[0].content"),
]


def test_lone_surrogates_are_400_and_the_connection_survives(tok):
    _, state = make_state(tok)
    with running_server(create_app(state)) as url, httpx.Client(limits=httpx.Limits(max_connections=1)) as http:
        for path, body, field in SURROGATE_BODIES:
            # json.dumps writes a lone surrogate as the \\udXXX escape, as a client's JSON encoder would
            r = http.post(url + path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["param"] == field and "surrogate" in err["message"], err
        # UTF-8-encoded surrogates (invalid UTF-8 that Python's JSON decoder lets through) are refused too
        raw = b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'
        r = http.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        for _ in range(40):
            r = http.post(url + "/v1/chat/completions", json={"messages": MSG})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


def test_tokenize_refuses_a_bad_tool_with_either_form(tok):
    """/tokenize checks `tools` as the schema says (a function name of [A-Za-z0-9_.-]{1,64}) whether it renders
    `messages` or only counts a `prompt`'s tokens."""
    _, state = make_state(tok)
    bad = [{"type": "function", "function": {"name": "]", "parameters": None}}]
    with running_server(create_app(state)) as url:
        for body in ({"prompt": "hi", "tools": bad}, {"messages": MSG, "tools": bad}):
            r = httpx.post(url + "/tokenize", json=body)
            assert r.status_code == 400 and "tools[0].function.name" in r.text, r.text
        ok = [{"type": "function", "function": {"name": "get_time", "parameters": None}}]
        assert httpx.post(url + "/tokenize", json={"prompt": "hi", "tools": ok}).status_code == 200


STRICT = [
    ("temperature", "0.5"),
    ("temperature", True),
    ("frequency_penalty", False),
    ("top_p", "1"),
    ("max_tokens", True),
    ("max_tokens", "5"),
    ("seed", 1.5),
    ("stream", "true"),
]


def test_strict_types_405_allow_and_model_retrieve(tok):
    _, state = make_state(tok)
    with running_server(create_app(state)) as url, httpx.Client(base_url=url) as http:
        for name, value in STRICT:
            r = http.post("/v1/chat/completions", json={"messages": MSG, name: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, value, r.text)
        ok = http.post("/v1/chat/completions", json={"messages": MSG, "temperature": 1, "max_tokens": 4.0})
        assert ok.status_code == 200  # JSON integers are numbers, and 4.0 is a JSON Schema integer
        r = http.delete("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
        assert http.put("/v1/models").headers["allow"] == "GET"
        card = http.get(f"/v1/models/{state.model_id}").json()
        assert card["id"] == state.model_id and card["object"] == "model"
        missing = http.get("/v1/models/org/other-model")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        doc = http.get("/openapi.json").json()
        text = json.dumps(doc)
        assert '"422"' not in text and "HTTPValidationError" not in text and '"ge"' not in text
        chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
        assert "text/event-stream" in chat["200"]["content"] and "400" in chat and "413" in chat
        temperature = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["temperature"]
        assert {"type": "number", "minimum": 0, "maximum": 2}.items() <= temperature["anyOf"][0].items()


def test_aborted_streams_are_counted(tok):
    _, state = make_state(tok, "word " * 3000, delay=0.005)
    with running_server(create_app(state)) as url:
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": MSG, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data:")
        line = 'thorgen_requests_aborted_total{endpoint="/v1/chat/completions"} 1.0'
        deadline = time.monotonic() + 5
        while line not in (text := httpx.get(url + "/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert line in text
        assert 'thorgen_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0' in text


def test_shutdown_is_bounded_with_a_stream_running(tok):
    engine, state = make_state(tok, "word " * 5000, delay=0.01)
    got_data = threading.Event()

    def stream(url: str) -> None:
        try:
            with httpx.stream(
                "POST", url + "/v1/chat/completions", json={"messages": MSG, "stream": True}, timeout=30
            ) as r:
                for line in r.iter_lines():
                    got_data.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream, as it should

    with running_server(create_app(state)) as url:  # running_server waits at most 1 s for open requests
        reader = threading.Thread(target=stream, args=(url,), daemon=True)
        reader.start()
        assert got_data.wait(10)
        start = time.perf_counter()
    assert time.perf_counter() - start < 5.0
    deadline = time.monotonic() + 5
    while engine.calls[-1]["end"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.calls[-1]["end"] == "cancelled"  # the engine was told to stop, not left generating
