"""Serve stage tests: the official `openai` client against `thorgen serve` on the reference backend (tiny model)."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from thorgen.model_spec.conventions import KV_PAGE  # noqa: E402
from thorgen.runtime.api import EngineConfig  # noqa: E402
from thorgen.serve.app import ServerState, create_app  # noqa: E402
from thorgen.serve.cli import open_model  # noqa: E402
from scripted_backend import running_server  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 1024) as running:
        yield running


@pytest.fixture()
def client(server):
    return openai_client(server[0])


def test_chat_stream_equals_non_stream(client, server):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=8, temperature=0)
    msg = r.choices[0].message
    assert r.object == "chat.completion" and msg.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert 1 <= r.usage.completion_tokens <= 8
    count = httpx.post(server[0] + "/tokenize", json={"messages": MSGS}).json()["count"]
    assert r.usage.prompt_tokens == count
    text, reasoning, usage = "", "", None
    for ch in client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if ch.choices:
            d = ch.choices[0].delta.model_dump()
            text += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
        usage = ch.usage or usage
    assert text == (msg.content or "") and reasoning == (msg.model_dump().get("reasoning_content") or "")
    assert usage.completion_tokens == r.usage.completion_tokens
    # the same prompt again: the prefix cache supplies all of it in whole pages of KV_PAGE positions (the KV
    # manager's rule on every backend), but the last token, which runs again
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // KV_PAGE * KV_PAGE > 0


def test_seed_reproducible(client):
    def sample(seed: int) -> str:
        r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=seed)
        return r.choices[0].text + "|" + str(r.usage.completion_tokens)

    first = sample(11)
    assert sample(11) == first
    assert len({sample(s) for s in (12, 13, 14)} | {first}) > 1  # seeds matter (a constant seed would fail)


def test_thinking_changes_the_prompt(client, server):
    on = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    off = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, reasoning_effort="none")
    tok = httpx.post(
        server[0] + "/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"enable_thinking": True}}
    ).json()
    assert on.usage.prompt_tokens == tok["count"] != off.usage.prompt_tokens


def test_stop_sequence_trims(client):
    base = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    text = base.choices[0].message.content or ""
    visible = text.strip("\ufffd")
    if len(visible) < 2:
        pytest.skip("the random model produced too little visible text to place a stop string")
    stop = visible[len(visible) // 2 :][:2]
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_over_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "word " * 3000}])
    assert "context" in str(err.value)


def test_speculative_decoding_is_lossless(tiny_checkpoint, client):
    """With the DFlash drafter on, greedy output equals plain greedy output; /metrics sees the verify steps."""
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
    state = ServerState("tiny", lambda: open_model(EngineConfig(tiny_checkpoint, "reference", 1024)), speculative=None)
    state.load()
    assert state.context.speculative is True  # the tiny checkpoint carries a drafter
    with running_server(create_app(state)) as url:
        spec = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        r = spec.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
        assert r.choices[0].message.content == plain.choices[0].message.content
        assert r.usage.completion_tokens == plain.usage.completion_tokens
        metrics = httpx.get(url + "/metrics").text
    count = [line for line in metrics.splitlines() if line.startswith("thorgen_accepted_tokens_per_step_count")]
    assert count and float(count[0].split()[1]) >= 1


def _verify_steps(url: str) -> int:
    lines = [
        ln
        for ln in httpx.get(url + "/metrics").text.splitlines()
        if ln.startswith("thorgen_accepted_tokens_per_step_count")
    ]
    return int(float(lines[0].split()[1])) if lines else 0


def _counter(url: str, name: str) -> float:
    """A counter's value on /metrics (the first series of that name)."""
    line = next(ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.split("{")[0].split()[0] == name)
    return float(line.split()[-1])


def test_num_speculative_tokens_per_request(tiny_checkpoint, client):
    """A request's num_speculative_tokens: 0 decodes it plainly on a speculative server, N > 0 speculatively on a
    plain one (the engine caps its drafts: tests/test_speculative.py); the output is plain greedy either way, and
    a value outside 0..15 is a 400 naming the field. The draft counters (/metrics, /health) rise for a speculative
    request and stay flat for one with 0."""
    plain = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=5, temperature=0)
    url = f"http://{client.base_url.host}:{client.base_url.port}"
    before = _verify_steps(url)
    forced = client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=5, temperature=0, extra_body={"num_speculative_tokens": 3}
    )
    assert forced.choices[0].message.content == plain.choices[0].message.content
    assert _verify_steps(url) > before
    state = ServerState("tiny", lambda: open_model(EngineConfig(tiny_checkpoint, "reference", 1024)), speculative=None)
    state.load()
    with running_server(create_app(state)) as spec_url:
        body = {"model": "tiny", "messages": MSGS, "max_tokens": 5, "temperature": 0, "num_speculative_tokens": 0}
        r = httpx.post(spec_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and _verify_steps(spec_url) == 0
        assert r.json()["choices"][0]["message"]["content"] == plain.choices[0].message.content
        assert _counter(spec_url, "thorgen_draft_tokens_total") == 0
        assert httpx.get(spec_url + "/health").json()["steps"]["acceptance_rate"] is None  # nothing drafted yet
        speculative = {**body, "num_speculative_tokens": None}
        assert httpx.post(spec_url + "/v1/chat/completions", json=speculative, timeout=60).status_code == 200
        drafted = _counter(spec_url, "thorgen_draft_tokens_total")
        assert drafted > 0 and _counter(spec_url, "vllm:spec_decode_num_draft_tokens_total") == drafted
        assert _counter(spec_url, "thorgen_speculative_steps_total") == _verify_steps(spec_url) > 0
        steps = httpx.get(spec_url + "/health").json()["steps"]
        assert steps["draft_tokens"] == drafted and 0 <= steps["acceptance_rate"] <= 1
        r = httpx.post(spec_url + "/v1/chat/completions", json=body, timeout=60)  # num_speculative_tokens 0 again
        assert r.status_code == 200 and _counter(spec_url, "thorgen_draft_tokens_total") == drafted
        for bad in (16, -1, "3", True, 2.5):  # (2.0 is a JSON Schema integer, as for every integer field)
            r = httpx.post(spec_url + "/v1/chat/completions", json={**body, "num_speculative_tokens": bad}, timeout=60)
            assert r.status_code == 400 and "num_speculative_tokens" in r.text, (bad, r.text)
