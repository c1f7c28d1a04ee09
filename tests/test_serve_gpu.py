"""GPU test of the server as a user runs it: `thorgen serve --backend cuda` (a subprocess) on the tiny preset,
driven over HTTP with the official `openai` client: completions, chat (streamed and not), tools, reasoning,
seeded sampling, an abort mid-stream, and a prompt over the context. Greedy output must equal what
`thorgen generate --backend cuda` prints for the same token ids (the same engine through the other entry point).

Run on the H200: `THORGEN_KERNELS=<tiny sm_90a build> python -m pytest -m gpu -q -rA tests/test_serve_gpu.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.gpu
PROMPT_IDS = [2, 105, 200, 300, 400, 107]
MSGS = [{"role": "user", "content": "Name a prime number."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
        },
    }
]


def _thorgen(*args: str) -> list[str]:
    return [sys.executable, "-c", "from thorgen.cli import main; main()", *args]


def _start(model, kernels, log, *extra: str, command=_thorgen):
    """`thorgen serve --backend cuda` on a free port (`command(*args)`: its argv, by default the thorgen CLI);
    (process, url) once /health is 200."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(
                "serve",
                "--model",
                str(model),
                "--backend",
                "cuda",
                "--port",
                str(port),
                "--kernel-dir",
                str(kernels),
                "--served-model-name",
                "m",
                "x",
                *extra,
            ),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            pytest.fail(f"thorgen serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop(proc, log)
            pytest.fail(f"thorgen serve was not healthy within 180 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.25)


def _stop(proc, log) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    print(f"\n--- {log.name} (tail) ---\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    model, kernels = built
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url = _start(model, kernels, log, "--draft-tokens", "0")  # plain; speculative: its own test's server
    try:
        yield url, model, kernels
    finally:
        _stop(proc, log)


def _ids(url: str, prompt: list[int], n: int, **sampling) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "return_token_ids": True, **sampling}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_models_reports_the_default_context(server):
    data = httpx.get(server[0] + "/v1/models").json()["data"][0]
    assert data["max_model_len"] == 8192  # min(max_position_embeddings of the tiny preset, 65536)


def test_greedy_completion_equals_generate(server):
    url, model, kernels = server
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": PROMPT_IDS, "max_tokens": 24, "temperature": 0, "return_token_ids": True},
        timeout=120,
    ).json()
    ran = subprocess.run(
        _thorgen(
            "generate",
            "--model",
            str(model),
            "--backend",
            "cuda",
            "--prompt-ids",
            ",".join(map(str, PROMPT_IDS)),
            "--max-tokens",
            "24",
            "--json",
        ),
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, THORGEN_KERNELS=str(kernels)),
    )
    assert ran.returncode == 0, ran.stderr
    ids = json.loads(ran.stdout)["token_ids"]
    assert r["choices"][0]["token_ids"] == ids and r["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    assert r["usage"]["completion_tokens"] == len(ids)
    # Not compared: the text. Random weights emit runs of byte-fallback tokens that are not UTF-8, which the
    # server's streaming decoder and a whole-sequence decode render with different U+FFFD runs.


def test_chat_stream_equals_non_stream(client):
    full = client.chat.completions.create(model="m", messages=MSGS, max_tokens=16, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="m", messages=MSGS, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_tools_reasoning_and_seed(client):
    for choice in ("auto", "required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model="m", messages=MSGS, tools=TOOLS, tool_choice=choice, max_tokens=12, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    r = client.chat.completions.create(
        model="m",
        messages=MSGS,
        max_tokens=12,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    a, b = (
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=16, temperature=1.0, seed=7)
        for _ in range(2)
    )
    assert a.choices[0].message.content == b.choices[0].message.content


def test_abort_mid_stream_frees_the_engine(server, client):
    url = server[0]
    body = {"model": "m", "prompt": PROMPT_IDS, "max_tokens": 4000, "stream": True, "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
    start = time.perf_counter()
    r = client.completions.create(model="m", prompt=PROMPT_IDS, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1 and time.perf_counter() - start < 30
    health = httpx.get(url + "/health").json()
    assert health["status"] == "ok" and health["queued"] == 0


def test_prompt_over_the_context_is_a_400(server):
    r = httpx.post(server[0] + "/v1/completions", json={"model": "m", "prompt": [2] * 9000, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


# Greedy and seeded alike are strict: every kernel sums a row in the same fp32 order at every
# row count (one-token and batched MoE down, ffn_tail, split attention), so a row's logits are bit-identical alone
# and in any batch (tests/test_engine_batch_invariance_gpu.py checks the logits themselves).
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_concurrent_requests_equal_alone(server, sampling):
    """32 concurrent requests (different prompts) through the engine core: each gets its tokens alone."""
    from concurrent.futures import ThreadPoolExecutor

    url = server[0]
    prompts = [PROMPT_IDS[:-1] + [200 + 3 * i, 107] for i in range(32)]
    alone = [_ids(url, p, 12, **sampling) for p in prompts]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: _ids(url, p, 12, **sampling), prompts))
    assert together == alone


def _metric(url: str, name: str) -> float:
    lines = [ln for ln in httpx.get(url + "/metrics").text.splitlines() if ln.startswith(name + " ")]
    assert lines, f"/metrics has no {name}"
    return float(lines[0].split()[-1])


def test_speculative_server_equals_plain(server, tmp_path):
    """A second server with DFlash on (--draft-tokens 15): greedy tokens equal the plain server's, one request at
    a time and two at once (batched plain steps; the longer one then catches its own drafter context up and
    speculates again)."""
    from concurrent.futures import ThreadPoolExecutor

    url, model, kernels = server
    prompts = [PROMPT_IDS, [2, 105, 150, 151, 152, 107]]
    plain = [_ids(url, p, 40, temperature=0) for p in prompts]
    short = _ids(url, prompts[1], 12, temperature=0)
    log = tmp_path / "serve-speculative.log"
    proc, spec_url = _start(model, kernels, log, "--draft-tokens", "15")
    try:
        assert [_ids(spec_url, p, 40, temperature=0) for p in prompts] == plain
        assert _metric(spec_url, "thorgen_accepted_tokens_per_step_count") > 0  # verify steps ran
        steps = _metric(spec_url, "thorgen_accepted_tokens_per_step_count")
        # the long request first, then a short one that decodes plainly (num_speculative_tokens 0: 12 steps, not
        # one or two verify steps that could end before the long one is admitted), so the two surely share steps
        with ThreadPoolExecutor(2) as pool:
            long = pool.submit(_ids, spec_url, prompts[0], 200, temperature=0)
            time.sleep(0.05)
            together = [long, pool.submit(_ids, spec_url, prompts[1], 12, temperature=0, num_speculative_tokens=0)]
            together = [f.result() for f in together]
        assert together[1] == short and together[0][:40] == plain[0]
        assert _metric(spec_url, "thorgen_drafter_catch_up_tokens_total") > 0
        assert _metric(spec_url, "thorgen_accepted_tokens_per_step_count") > steps
    finally:
        _stop(proc, log)


def test_batched_verify_equals_plain(server, tmp_path):
    """Four greedy requests at once on a speculative server: their drafts are verified together in batched steps
    (runtime/cuda/spec_batch.py), and each request's tokens equal the plain server's, with no batched step failing
    over to running its sequences one by one."""
    from concurrent.futures import ThreadPoolExecutor

    url, model, kernels = server
    prompts = [[2, 105, 150 + 7 * i, 151 + i, 152, 107] for i in range(4)]
    plain = [_ids(url, p, 48, temperature=0) for p in prompts]
    log = tmp_path / "serve-batched-verify.log"
    proc, spec_url = _start(model, kernels, log, "--draft-tokens", "15")
    try:
        before = _metric(spec_url, "thorgen_speculative_steps_total")
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _ids(spec_url, p, 48, temperature=0), prompts))
        assert got == plain
        assert _metric(spec_url, "thorgen_speculative_steps_total") > before  # drafts were verified
        assert "a batched step of" not in log.read_text()
    finally:
        _stop(proc, log)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}], ids=["greedy", "seeded"])
def test_prefix_cache_hit_equals_miss(server, sampling):
    """A chat's next turn reuses the K/V the previous turn left (usage.prompt_tokens_details.cached_tokens) and
    gets exactly the tokens of a full prefill (after unrelated requests took every lane's cache)."""
    url = server[0]

    def run(prompt):
        body = {"model": "m", "prompt": prompt, "max_tokens": 16, "return_token_ids": True, **sampling}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
        return r["choices"][0]["token_ids"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    first, _ = run(PROMPT_IDS)
    turn2 = PROMPT_IDS + first + [107, 105, 250, 251, 107]
    hit, cached_hit = run(turn2)
    for i in range(8):  # other conversations take every KV lane (--max-num-seqs 8; the LRU lane goes first)
        run([2, 400 + i, 401])
    miss, cached_miss = run(turn2)
    # all but the last answer token had K/V, in whole pages of the paged layers (more when an earlier test's lane
    # holds a longer greedy continuation)
    assert cached_hit >= (len(PROMPT_IDS) + len(first) - 1) // 16 * 16 > 0 and cached_miss <= 1
    assert hit == miss


def test_structured_output_logprobs_and_penalties(client, server):
    """The processed head on the GPU through HTTP: a json_schema is obeyed on random weights, a logit_bias of
    +100 forces its token, and greedy logprobs name the picked token first (its logprob is the top one's)."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "json"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool), r.choices[0].message.content
    ids = _ids(server[0], PROMPT_IDS, 6, temperature=0, logit_bias={"77": 100})
    assert ids == [77] * 6
    body = {
        "model": "m",
        "prompt": PROMPT_IDS,
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 3,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.3,
        "return_token_ids": True,
    }
    c = httpx.post(server[0] + "/v1/completions", json=body, timeout=120).json()["choices"][0]
    top = c["logprobs"]["top_logprobs"]
    assert len(top) == len(c["token_ids"]) and all(len(t) == 3 for t in top)
    assert all(lp <= 0 for lp in c["logprobs"]["token_logprobs"])


def test_echo_prompt_logprobs(server):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, a list of token-id prompts) through HTTP
    on the device: one entry per prompt token (None first) and the generated one, which is close to the same
    request's logprob without echo: there the prompt's K/V came from the prefill kernels, here from the scoring
    passes' batched forms (5.2e-3 apart at most, measured on the H200; 2.7e-4 on this token)."""
    body = {"model": "m", "prompt": [PROMPT_IDS], "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(PROMPT_IDS) + 1 and lp["token_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    plain = httpx.post(
        server[0] + "/v1/completions", json={**body, "echo": False, "prompt": PROMPT_IDS}, timeout=120
    ).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"][-1] == pytest.approx(plain["token_logprobs"][0], abs=1e-2)
