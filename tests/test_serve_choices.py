"""CPU tests: `n` > 1 choices through the official openai client on the tiny reference server. Choice i is its own
engine sequence sampled with seed + i, so each equals the single request with that seed; usage counts the prompt
once and every choice's tokens; streamed chunks carry their choice's index."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
pytest.importorskip("fastapi")
pytest.importorskip("openai")
from tiny_server import openai_client, tiny_server  # noqa: E402

MSGS = [{"role": "user", "content": "Count to three."}]


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 512) as (url, _):
        yield openai_client(url)


def test_n_choices_equal_single_requests_with_their_seeds(client):
    r = client.chat.completions.create(model="m", messages=MSGS, n=3, seed=40, temperature=1.0, max_tokens=8)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [
        client.chat.completions.create(model="m", messages=MSGS, seed=40 + i, temperature=1.0, max_tokens=8)
        for i in range(3)
    ]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_choices_stream_by_index(client):
    texts, finished = {}, set()
    for ch in client.completions.create(
        model="m", prompt="Once", n=2, seed=7, temperature=1.0, max_tokens=6, stream=True
    ):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1}
    alone = [
        client.completions.create(model="m", prompt="Once", seed=7 + i, temperature=1.0, max_tokens=6).choices[0].text
        for i in range(2)
    ]
    assert [texts[0], texts[1]] == alone


def test_too_many_choices_is_a_400(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="at most 16"):
        client.chat.completions.create(model="m", messages=MSGS, n=17, max_tokens=2)
