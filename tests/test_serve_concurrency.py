"""Serve stage tests: 32 concurrent streams stay unmixed; a client that disconnects frees the engine at once."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def echo_engine(tok: Tokenizer, **kw) -> ScriptedBackend:
    """Answers 'reply to <request tag> ...' so each client can check it got its own answer, whole."""

    def script(prompt: list[int]) -> list[int]:
        tag = re.findall(r"request-(\d+)", tok.decode(prompt))[-1]
        n = int(re.findall(r"len-(\d+)", tok.decode(prompt))[-1])
        return tok.encode(f"reply to {tag}: " + " ".join(f"{tag}.{i}" for i in range(n)))

    return ScriptedBackend(script, **kw)


def test_32_concurrent_streams_unmixed(tok):
    engine = echo_engine(tok, chunk=3, delay=0.0005)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)

        def one(i: int) -> tuple[int, str, str | None]:
            text, finish = "", None
            stream = client.chat.completions.create(
                model="m", stream=True, messages=[{"role": "user", "content": f"request-{i} len-{5 + i % 7}"}]
            )
            for ch in stream:
                if ch.choices:
                    text += ch.choices[0].delta.content or ""
                    finish = ch.choices[0].finish_reason or finish
            return i, text, finish

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, range(32)))
        for i, text, finish in results:
            n = 5 + i % 7
            assert text == f"reply to {i}: " + " ".join(f"{i}.{k}" for k in range(n))
            assert finish == "stop"
        assert len(engine.calls) == 32 and state.client.ready


def test_disconnect_frees_the_worker(tok):
    engine = echo_engine(tok, chunk=1, delay=0.02)  # 'len-5000' would take minutes if not cancelled
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "request-1 len-5000"}]}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                assert next(lines).startswith("data:")
        # and a non-streaming client that gives up
        body2 = dict(body, stream=False, messages=[{"role": "user", "content": "request-2 len-5000"}])
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions", json=body2, timeout=0.5)
        start = time.perf_counter()
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "request-3 len-2"}])
        assert r.choices[0].message.content == "reply to 3: 3.0 3.1"
        assert time.perf_counter() - start < 3.0
        first, second = engine.calls[0], engine.calls[1]
        assert first["end"] == "cancelled" and second["end"] == "cancelled"
        assert first["ended"] - first["started"] < 3.0  # stopped within a few steps, not after 5000 tokens
