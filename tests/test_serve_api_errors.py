"""Serve stage tests: every API answers an unknown model with a 404, a missing key with a 401 and a too-large body
with a 413, each in its own error shape (Anthropic's on /v1/messages, OpenAI's elsewhere), through the official
clients against the tiny checkpoint on the reference backend."""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

from tiny_server import tiny_server  # noqa: E402

KEY = "sekrit"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, ctx=512, api_key=KEY, max_body_bytes=64 << 10) as (base, _):
        yield base


def clients(url: str, key: str = KEY):
    return (
        anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60),
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60),
    )


def test_unknown_models_are_404_in_each_apis_shape(url) -> None:
    claude, oai = clients(url)
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="gpt-4o", max_tokens=4, messages=HI)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    assert "gpt-4o" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.count_tokens(model="gpt-4o", messages=HI)
    assert caught.value.body["error"]["type"] == "not_found_error"
    for call in (
        lambda: oai.responses.create(model="gpt-4o", input="Hi", max_output_tokens=4),
        lambda: oai.chat.completions.create(model="gpt-4o", messages=HI, max_tokens=4),
        lambda: oai.completions.create(model="gpt-4o", prompt="Hi", max_tokens=4),
        lambda: oai.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.code == "model_not_found" and caught.value.param in ("model", None)
    assert claude.messages.create(model="tiny", max_tokens=2, messages=HI).usage.output_tokens >= 1
    assert claude.messages.count_tokens(model="tiny", messages=HI).input_tokens > 0
    assert oai.responses.create(model="tiny", input="Hi", max_output_tokens=2).usage.output_tokens >= 1


def test_a_missing_key_is_401_in_each_apis_shape(url) -> None:
    claude, oai = clients(url, key="wrong")
    with pytest.raises(anthropic.AuthenticationError) as caught:
        claude.messages.create(model="tiny", max_tokens=4, messages=HI)
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": caught.value.body["error"]["message"]},
    }
    with pytest.raises(anthropic.AuthenticationError):
        claude.messages.count_tokens(model="tiny", messages=HI)
    with pytest.raises(openai.AuthenticationError) as caught:
        oai.responses.create(model="tiny", input="Hi")
    assert caught.value.code == "invalid_api_key"


def test_a_too_large_body_is_413_in_each_apis_shape(url) -> None:
    big = [{"role": "user", "content": "x" * (100 << 10)}]
    r = httpx.post(
        url + "/v1/messages", json={"model": "tiny", "max_tokens": 4, "messages": big}, headers={"x-api-key": KEY}
    )
    assert r.status_code == 413 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "request_too_large"
    claude, oai = clients(url)
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model="tiny", max_tokens=4, messages=big)
    assert caught.value.status_code == 413 and caught.value.body["error"]["type"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as caught:
        oai.chat.completions.create(model="tiny", messages=big, max_tokens=4)
    assert caught.value.status_code == 413 and caught.value.code == "request_too_large"
