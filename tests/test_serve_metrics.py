"""Serve stage tests: /metrics parses with prometheus-client's own parser after hostile and unknown paths, counts
each request under its route's template (or `unmatched`), never under the raw path, and carries vLLM's names."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

parser = pytest.importorskip("prometheus_client.parser")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from thorgen.serve.metrics import UNMATCHED  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
HOSTILE = [
    "/v1/models/a%22b",  # a quote
    "/v1/models/a%5Cb%0Ac",  # a backslash and a newline
    "/v1/models/x%22%7D%201%0Afake_metric%202",  # an injected line, percent-encoded
    "/v1/models/%7B%7D%2C%3D",
    '/nope/a"b',
    "/v1/unknown%0Aline",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))
    state = scripted_state(ScriptedBackend(lambda prompt: tok.encode("ok")), tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        yield url, state


def families(url: str) -> dict:
    r = httpx.get(url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in parser.text_string_to_metric_families(r.text)}


def test_hostile_and_unknown_paths_leave_metrics_parseable_and_bounded(served) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as http:
        for path in HOSTILE:
            assert http.get(path).status_code in (404, 405)
        for i in range(50):  # many distinct unknown paths: one series, not fifty
            assert http.get(f"/nowhere/{i}").status_code == 404
            assert http.get(f"/v1/models/unknown-{i}").status_code == 404
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).is_success
    got = families(url)
    samples = [s for s in got["thorgen_requests"].samples if s.name == "thorgen_requests_total"]
    endpoints = {s.labels["endpoint"] for s in samples}
    assert endpoints <= {UNMATCHED, "/v1/models/{model_id:path}", "/v1/chat/completions"}, endpoints
    assert {UNMATCHED, "/v1/models/{model_id:path}", "/v1/chat/completions"} <= endpoints
    count = {(s.labels["endpoint"], s.labels["status"]): s.value for s in samples}
    # (a model id with a newline matches no route: '{model_id:path}' stops at line ends)
    assert count[(UNMATCHED, "404")] >= 50 and count[("/v1/models/{model_id:path}", "404")] >= 50
    assert count[(UNMATCHED, "404")] + count[("/v1/models/{model_id:path}", "404")] == len(HOSTILE) + 100
    assert count[("/v1/chat/completions", "200")] == 1
    assert "fake_metric" not in got


def test_vllm_names_beside_thorgen_names(served) -> None:
    url, state = served
    httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}]})
    got = families(url)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:e2e_request_latency_seconds",
        "vllm:kv_cache_usage_perc",
        "thorgen_time_to_first_token_seconds",
        "thorgen_request_prepare_seconds",
        "thorgen_kv_cache_usage",
    ):
        assert name in got, name
    prepared = {s.name: s.value for s in got["thorgen_request_prepare_seconds"].samples}
    first = {s.name: s.value for s in got["thorgen_time_to_first_token_seconds"].samples}
    assert prepared["thorgen_request_prepare_seconds_count"] == first["thorgen_time_to_first_token_seconds_count"] >= 1
    assert prepared["thorgen_request_prepare_seconds_sum"] > 0
    ttft = {s.name: s for s in got["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"].labels == {"model_name": state.model_id}
    assert ttft["vllm:time_to_first_token_seconds_count"].value >= 1
    prompt = next(s for s in got["vllm:prompt_tokens"].samples if s.name == "vllm:prompt_tokens_total")
    ours = next(s for s in got["thorgen_prompt_tokens"].samples if s.name == "thorgen_prompt_tokens_total")
    assert prompt.value == ours.value > 0
