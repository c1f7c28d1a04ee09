"""Serve stage tests: /v1/completions' `echo` (the prompt ahead of the completion, and with `logprobs` the prompt's
logprobs ahead of the generated ones: lm-eval's loglikelihood request), `max_tokens` 0 (score the prompt only),
several prompts in one request, and GET /tokenizer_info as lm-eval's RemoteTokenizer reads it. Tiny model on the
reference backend; the logprobs are checked against the model's own log-softmax of one full forward."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

pytest.importorskip("fastapi")
from thorgen.runtime.reference.backend import ReferenceBackend  # noqa: E402
from thorgen.runtime.reference.logits import log_softmax  # noqa: E402
from tiny_server import tiny_server  # noqa: E402

CTX = 512
LP_TOL = 1e-6
TEXT = "Once upon a time, a fox"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, CTX) as running:
        yield running


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    """ids -> log-softmax rows [P, V] of one whole-prompt forward (row i predicts token i + 1)."""
    model = ReferenceBackend(tiny_ckpt, max_context=CTX).target

    def rows(ids: list[int]) -> np.ndarray:
        return np.stack([log_softmax(r) for r in model.forward(ids, model.new_cache(), last_only=False).logits])

    return rows


def post(server, **body) -> httpx.Response:
    return httpx.post(server[0] + "/v1/completions", json={"model": "tiny", **body}, timeout=120)


def complete(server, **body) -> dict:
    r = post(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


def ids_of(server, text: str) -> list[int]:
    return httpx.post(server[0] + "/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_puts_the_prompt_ahead_of_the_completion(server):
    plain = complete(server, prompt=TEXT, max_tokens=5, temperature=0)["choices"][0]["text"]
    assert complete(server, prompt=TEXT, max_tokens=5, temperature=0, echo=True)["choices"][0]["text"] == TEXT + plain
    ids = ids_of(server, TEXT)
    echoed = complete(server, prompt=ids, max_tokens=5, temperature=0, echo=True)["choices"][0]["text"]
    assert echoed == server[1].context.tokenizer.decode(ids) + plain  # token ids come back decoded (with the <bos>)


def test_echo_logprobs_are_the_models_own(server, oracle):
    """lm-eval's request: echo, logprobs, a list of token-id prompts. Per prompt one entry per prompt token (none
    for the first) and then the generated token's, each the log-softmax of the logits that predict it."""
    tok, top_n = server[1].context.tokenizer, 3
    prompts = [ids_of(server, TEXT), ids_of(server, "The sky is")]
    body = complete(
        server, prompt=prompts, max_tokens=1, temperature=0, logprobs=top_n, echo=True, return_token_ids=True
    )
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for ids, choice in zip(prompts, body["choices"]):
        lp, full = choice["logprobs"], ids + choice["token_ids"]
        rows = oracle(full)
        assert lp["tokens"] == [tok.decode([t]) for t in full]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert np.allclose(lp["token_logprobs"][1:], [rows[i - 1, t] for i, t in enumerate(full) if i], atol=LP_TOL)
        for i, top in enumerate(lp["top_logprobs"][1:], start=1):
            want = np.sort(rows[i - 1])[::-1][:top_n]
            # keyed by token text, so tokens that decode alike share a key: each value is one of the top-N
            assert 1 <= len(top) <= top_n and max(top.values()) == pytest.approx(want[0], abs=LP_TOL)
            assert all(np.isclose(want, v, atol=LP_TOL).any() for v in top.values())
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"]])[:-1])
        assert choice["text"].startswith(tok.decode(ids))  # then the generated text (special tokens hidden)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == 2


def test_streamed_echo_equals_the_whole_answer(server):
    """The first chunk carries the prompt's text and logprobs ahead of the first token's, as in vLLM."""
    args = dict(prompt=TEXT, max_tokens=4, temperature=0, logprobs=2, echo=True)
    whole = complete(server, **args)["choices"][0]
    chunks = []
    with httpx.stream(
        "POST", server[0] + "/v1/completions", json={"model": "tiny", "stream": True, **args}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(TEXT) and len(chunks[0]["logprobs"]["tokens"]) > len(ids_of(server, TEXT))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [c["logprobs"] for c in chunks if c["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for s in streamed for v in s[key]] == whole["logprobs"][key]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]


def test_max_tokens_0_scores_the_prompt_only(server):
    ids = ids_of(server, TEXT)
    one = complete(server, prompt=[ids], max_tokens=1, temperature=0, logprobs=1, echo=True)["choices"][0]
    body = complete(server, prompt=[ids], max_tokens=0, logprobs=1, echo=True, return_token_ids=True)
    c = body["choices"][0]
    assert c["text"] == server[1].context.tokenizer.decode(ids)
    assert c["finish_reason"] == "length" and c["token_ids"] == []
    assert {k: v[: len(ids)] for k, v in one["logprobs"].items()} == c["logprobs"]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    texts = []
    with httpx.stream(
        "POST",
        server[0] + "/v1/completions",
        timeout=120,
        json={"model": "tiny", "prompt": TEXT, "max_tokens": 0, "echo": True, "stream": True},
    ) as r:
        texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(texts) == TEXT
    r = post(server, prompt=TEXT, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_several_prompts_give_choices_prompt_major(server):
    """Choice p * n + j answers prompt p with seed + j; usage counts each prompt once and every choice's tokens."""
    prompts, n = ["Once", "The sky is blue and"], 2
    body = complete(server, prompt=prompts, n=n, seed=5, temperature=1.0, max_tokens=6)
    assert [c["index"] for c in body["choices"]] == list(range(len(prompts) * n))
    singles = [complete(server, prompt=p, seed=5 + j, temperature=1.0, max_tokens=6) for p in prompts for j in range(n)]
    assert [c["text"] for c in body["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert body["usage"]["prompt_tokens"] == sum(singles[p * n]["usage"]["prompt_tokens"] for p in range(len(prompts)))
    assert body["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)
    streamed: dict[int, str] = {}
    with httpx.stream(
        "POST",
        server[0] + "/v1/completions",
        timeout=120,
        json={
            "model": "tiny",
            "prompt": prompts,
            "n": n,
            "seed": 5,
            "temperature": 1.0,
            "max_tokens": 6,
            "stream": True,
        },
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(len(prompts) * n)] == [c["text"] for c in body["choices"]]


@pytest.mark.parametrize(
    "prompt, n, param, words",
    [
        ([], 1, "prompt", "empty"),
        ([[]], 1, "prompt[0]", "empty"),
        ([[2, 300], []], 1, "prompt[1]", "empty"),
        ([[2, 300], [2, 10**6]], 1, "prompt[1]", "vocabulary"),
        ([2, 10**6], 1, "prompt", "vocabulary"),
        ([[2]] * 5, 13, "prompt", "5 prompts x n=13 = 65 choices"),
        (["a"] * 65, 1, "prompt", "at most 64"),
        (["a", 1], 1, None, "invalid request"),
        ([[2, True]], 1, None, "invalid request"),  # strict: a boolean is no token id
        ([["2"]], 1, None, "invalid request"),
    ],
)
def test_bad_prompts_are_400s_naming_the_field(server, prompt, n, param, words):
    r = post(server, prompt=prompt, n=n, max_tokens=1)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and (param is None or error["param"] == param), error
    assert error["param"].startswith("prompt")


def test_tokenizer_info_serves_lm_evals_remote_tokenizer(server):
    url, state = server
    info = httpx.get(url + "/tokenizer_info").json()
    assert {k: info[k] for k in ("bos_token", "eos_token", "pad_token")} == {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
    }
    assert info["chat_template"] == state.context.template.source and info["model_max_length"] == CTX
    assert info["tokenizer_class"] and info["vocab_size"] == state.context.tokenizer.vocab_size
    assert "/tokenizer_info" in httpx.get(url + "/openapi.json").json()["paths"]
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(url + "/v1/completions")
    remote = utils.RemoteTokenizer(url + "/v1/completions")
    ids = remote.encode(TEXT)
    assert ids == state.context.tokenizer.encode(TEXT) and remote.decode(ids) == TEXT  # no <bos> added
    assert (remote.bos_token_id, remote.eos_token_id) == (2, 1)
