"""Serve stage tests: `thorgen cluster` on Ray Serve: two reference-backend replicas of the tiny model behind one
ingress, driven by the official `openai` client (Ray starts once for the module; every wait is bounded)."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
serve = pytest.importorskip("ray.serve")

from thorgen.runtime.api import EngineConfig  # noqa: E402
from thorgen.serve.app import ServerState, create_app  # noqa: E402
from thorgen.serve.cli import open_model  # noqa: E402
from thorgen.serve.cluster.deployment import APP, ENGINE, build_app  # noqa: E402
from thorgen.serve.cluster.cli import cluster as cluster_command  # noqa: E402
from thorgen.serve.cluster.remote import ReplicaHeaderMiddleware, _REPLICA_SLOT  # noqa: E402
from thorgen.serve.cluster.routing import PrefixIndex, block_hashes, rank  # noqa: E402
from scripted_backend import running_server  # noqa: E402

pytestmark = pytest.mark.slow
CTX = 1024
LONG = [{"role": "user", "content": "Count slowly from one to one thousand, one number per line."}]
PRIME = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    """(ingress URL, single-server URL): two replicas on Ray Serve, and one plain `thorgen serve` app."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # the replicas share 2 cores; inherited by Ray's workers
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # one sequence per engine: a second request queues behind the first (the fault test relies on it)
        serve.run(
            build_app(
                EngineConfig(tiny_checkpoint, "reference", CTX, max_num_seqs=1),
                2,
                model_id="tiny",
                poll_s=0.5,
                health_period_s=1.0,
                drain_timeout_s=20.0,
                routing={"seed": 0},
            ),
            name=APP,
            route_prefix="/",
            blocking=False,
        )
        single = ServerState(
            "tiny", lambda: open_model(EngineConfig(tiny_checkpoint, "reference", CTX)), speculative=False
        )
        single.load()
        assert single.load_error is None, single.load_error
        url = f"http://127.0.0.1:{port}"
        _wait(lambda: len(_replicas_up(url)) == 2, 60, "both replicas to report healthy")
        with running_server(create_app(single)) as single_url:
            yield url, single_url
        single.close()
    finally:
        serve.shutdown()
        ray.shutdown()


def _client(url: str, retries: int = 0) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=retries, timeout=60)


def _wait(ok, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.25)


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _replicas_up(url: str) -> dict[str, int]:
    """replica id -> pid, for replicas whose engine reports ok."""
    try:
        text = _metrics(url)
    except httpx.HTTPError:
        return {}
    up = {}  # (labels in any order: the exposition sorts them)
    for m in re.finditer(r"^thorgen_replica_up\{([^}]*)\} 1(\.0)?$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m[1]))
        up[labels["replica"]] = int(labels["pid"])
    return up


def _counter(text: str, name: str, label: str) -> int:
    m = re.search(rf"^{name}\{{{label}\}} ([0-9.e+]+)$", text, re.M)
    return int(float(m[1])) if m else 0


def _chat(client, messages, **kw):
    """(completion, replica header)."""
    raw = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, **kw)
    return raw.parse(), raw.headers.get("x-thorgen-replica")


# ---- the routing policy on its own ---------------------------------------------------------------------------


def test_policy_prefers_the_prefix_holder_within_the_load_bound():
    index, rng = PrefixIndex(capacity=8), random.Random(0)
    turn1 = list(range(40))
    index.record(block_hashes(turn1, 16), "a")
    turn2 = turn1 + [7] * 30
    assert index.match(block_hashes(turn2, 16), {"a", "b"}) == ("a", 2)
    loads = {"a": 3, "b": 1}
    ranked, why = rank(["a", "b"], str, loads.get, block_hashes(turn2, 16), index, 1, 2, rng)
    assert why == "affinity" and ranked[0] == ["a"]
    loads["a"] = 4  # more than 2 above the least-loaded: balance instead
    ranked, why = rank(["a", "b"], str, loads.get, block_hashes(turn2, 16), index, 1, 2, rng)
    assert why == "balance" and ranked[0] == ["b"]
    # unrelated prompt, equal loads: the replica holding fewer cached blocks goes first
    ranked, why = rank(["a", "b"], str, {"a": 0, "b": 0}.get, block_hashes([9] * 40, 16), index, 1, 2, rng)
    assert why == "balance" and ranked[0] == ["b"]
    index.forget("a")
    assert index.match(block_hashes(turn2, 16), {"a", "b"}) == (None, 0) and len(index) == 0
    for i in range(20):  # bounded: the least recently used blocks go
        index.record(block_hashes([i] * 16, 16), "b")
    assert len(index) == 8 and index.held["b"] == 8


def test_affinity_key_holds_the_image_hashes():
    from types import SimpleNamespace

    from thorgen.runtime.backend import ImageInput, ImageSpan
    from thorgen.serve.cluster.routing import prompt_ids_of

    def image(name: str) -> ImageInput:
        return ImageInput(np.zeros((36, 768), np.uint8), np.zeros((36, 2), np.int32), 4, name)

    prompt = [2, 5, 255] + [99] * 4 + [256] + list(range(30))  # boi, 4 image placeholders, eoi, text

    def hashes(*spans, by_keyword=False):
        args = (prompt, 8, None, frozenset(), False, spans)
        request = (
            SimpleNamespace(args=(), kwargs={"prompt_ids": prompt, "images": spans})
            if by_keyword
            else SimpleNamespace(args=args, kwargs={})
        )
        return block_hashes(prompt_ids_of(request), 16)

    cat, dog = ImageSpan(3, image("cat")), ImageSpan(3, image("dog"))
    assert hashes(cat) == hashes(ImageSpan(3, image("cat"))) == hashes(cat, by_keyword=True)
    assert hashes(cat)[0] != hashes(dog)[0] != block_hashes(prompt, 16)[0]  # same ids, other image: no match
    index = PrefixIndex(capacity=8)
    index.record(hashes(cat), "a")
    assert index.match(hashes(cat), {"a"}) == ("a", 2) and index.match(hashes(dog), {"a"}) == (None, 0)
    assert prompt_ids_of(SimpleNamespace(args=(prompt, 8, None, frozenset(), False), kwargs={})) == prompt


def test_middleware_names_the_replica_and_marks_503_retryable():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/placed/{status}")
    async def placed(status: int):
        _REPLICA_SLOT.get()["replica"] = "r1"  # what RemoteStream does once the router has placed the request
        return JSONResponse({"error": {"message": "x"}}, status_code=status)

    app.add_middleware(ReplicaHeaderMiddleware)
    with running_server(app) as url:
        ok, gone = httpx.get(url + "/placed/200", timeout=10), httpx.get(url + "/placed/503", timeout=10)
    assert ok.headers["x-thorgen-replica"] == "r1" and "retry-after" not in ok.headers
    assert gone.status_code == 503 and gone.headers["retry-after"] == "1"


def test_cluster_command_rejects_bad_options(tmp_path):
    from click.testing import CliRunner

    result = CliRunner().invoke(cluster_command, ["--model", str(tmp_path)])
    assert result.exit_code != 0 and "config.json" in result.output
    result = CliRunner().invoke(cluster_command, ["--kv-dtype", "fp8"])
    assert result.exit_code != 0 and "--backend cuda" in result.output


# ---- through the ingress ----------------------------------------------------------------------------------------


def test_openai_client_answers_and_equals_single_server(cluster):
    url, single_url = cluster
    msgs = PRIME
    got, want = _client(url), _client(single_url)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        a, replica = _chat(got, msgs, max_tokens=8, **kw)
        b = want.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, **kw)
        assert replica in _replicas_up(url)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (b.usage.prompt_tokens, b.usage.completion_tokens)
        assert a.choices[0].finish_reason == b.choices[0].finish_reason
        streamed, usage = "", None
        for ch in got.chat.completions.create(
            model="tiny", messages=msgs, max_tokens=8, stream=True, stream_options={"include_usage": True}, **kw
        ):
            if ch.choices:
                streamed += ch.choices[0].delta.content or ""
            usage = ch.usage or usage
        assert streamed == (b.choices[0].message.content or "")
        assert usage.completion_tokens == b.usage.completion_tokens
    c = got.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    d = want.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert c.choices[0].text == d.choices[0].text and c.usage.completion_tokens == d.usage.completion_tokens


def test_image_through_the_cluster_equals_single_server(cluster):
    import base64
    import io

    from PIL import Image

    url, single_url = cluster
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": data_url}}, {"type": "text", "text": "What is it?"}],
        }
    ]
    a, replica = _chat(
        _client(url), msgs, max_tokens=6, temperature=0, extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}}
    )
    b = _client(single_url).chat.completions.create(
        model="tiny",
        messages=msgs,
        max_tokens=6,
        temperature=0,
        extra_body={"mm_processor_kwargs": {"max_soft_tokens": 70}},
    )
    assert replica in _replicas_up(url) and a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens > 20  # the image's soft tokens counted on both


def test_bad_input_is_4xx(cluster):
    url, _ = cluster
    r = httpx.post(
        url + "/v1/chat/completions", content=b"{not json", timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.BadRequestError) as err:
        _client(url).chat.completions.create(model="tiny", messages=LONG, max_tokens=CTX)
    assert "context" in str(err.value)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [10**9], "max_tokens": 2}, timeout=30)
    assert r.status_code == 400


def test_conversation_sticks_to_one_replica_and_unrelated_ones_spread(cluster):
    url, _ = cluster
    client = _client(url)
    before = _metrics(url)
    messages = [{"role": "user", "content": "Tell me about the history of the city of Lyon, in detail."}]
    replicas, cached = [], []
    for turn in range(4):
        r, replica = _chat(client, messages, max_tokens=6, temperature=0)
        replicas.append(replica)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content or "ok"},
            {"role": "user", "content": f"And what happened next, part {turn + 2}?"},
        ]
    assert len(set(replicas)) == 1 and replicas[0] is not None, replicas
    assert all(c > 0 for c in cached[1:]), cached  # the later turns found their prefix in that replica's cache
    after = _metrics(url)
    assert (
        _counter(after, "thorgen_routing_decisions_total", 'decision="affinity"')
        - _counter(before, "thorgen_routing_decisions_total", 'decision="affinity"')
    ) >= 3
    label = f'replica="{replicas[0]}"'
    assert (
        _counter(after, "thorgen_replica_requests_total", label)
        - _counter(before, "thorgen_replica_requests_total", label)
    ) == 4
    spread = {
        _chat(client, [{"role": "user", "content": f"{topic} is my question today."}], max_tokens=2, temperature=0)[1]
        for topic in ("Rivers", "Quartz", "Jazz", "Origami", "Volcanoes", "Tea")
    }
    assert spread == set(_replicas_up(url)) and len(spread) == 2, spread


def test_stop_string_ends_the_replica_request_as_single_server(cluster):
    """A stop string makes the ingress cancel the replica call; the answer is trimmed as by `thorgen serve`."""
    url, single_url = cluster
    base = _client(single_url).chat.completions.create(model="tiny", messages=PRIME, max_tokens=12, temperature=0)
    text = (base.choices[0].message.content or "").strip("\ufffd")
    if len(text) < 2:
        pytest.skip("the random model produced too little visible text to place a stop string")
    stop = text[len(text) // 2 :][:2]
    want = _client(single_url).chat.completions.create(
        model="tiny", messages=PRIME, max_tokens=12, temperature=0, stop=[stop]
    )
    got, _ = _chat(_client(url), PRIME, max_tokens=12, temperature=0, stop=[stop])
    assert got.choices[0].message.content == want.choices[0].message.content == text[: text.index(stop)]
    assert got.choices[0].finish_reason == want.choices[0].finish_reason == "stop"


def test_client_disconnect_frees_the_replica(cluster):
    """The engine request stops soon after the client leaves, well before it would have finished."""
    url, _ = cluster
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=30,
        json={
            "model": "tiny",
            "messages": LONG,
            "max_tokens": 900,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        },
    ) as r:
        replica, n, started = r.headers["x-thorgen-replica"], 0, None
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                ids = choices[0].get("token_ids") or [] if choices else []
                started = started or (time.monotonic() if ids else None)
                n += len(ids)
                if n >= 40:
                    break
        rate = n / (time.monotonic() - started)  # tokens/s on this machine
    left = (900 - n) / rate
    label = f'replica="{replica}"'
    _wait(
        lambda: (
            _counter(_metrics(url), "thorgen_replica_requests_running", label) == 0
            and _counter(_metrics(url), "thorgen_replica_requests_queued", label) == 0
        ),
        max(2.0, left / 2),
        f"the abandoned stream's engine request to end (it had {left:.1f}s of tokens left)",
    )


def test_replica_killed_mid_stream(cluster):
    """The stream being served gets an error event then ends; a request queued behind it on the dead replica
    is retried elsewhere; the next requests succeed; Ray starts a replacement replica."""
    url, _ = cluster
    client = _client(url)
    up = _replicas_up(url)
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=LONG, max_tokens=600, temperature=0, stream=True
    )
    victim = raw.headers.get("x-thorgen-replica")
    assert victim in up, (victim, up)
    queued: dict = {}

    def send_queued() -> None:  # the same prompt: affinity puts it behind the stream on the same engine
        try:
            queued["reply"] = _chat(_client(url), LONG, max_tokens=4, temperature=0)
        except Exception as exc:  # reported by the assertion below
            queued["error"] = exc

    behind = threading.Thread(target=send_queued, daemon=True)
    chunks, error = 0, None
    stream = raw.parse()
    try:
        for ch in stream:
            chunks += 1
            assert not (ch.choices and ch.choices[0].finish_reason), "the stream ended before the kill"
            if chunks == 3:
                behind.start()
                _wait(
                    lambda: _counter(_metrics(url), "thorgen_replica_requests_queued", f'replica="{victim}"') >= 1,
                    20,
                    "the second request to queue on the victim",
                )
                os.kill(up[victim], signal.SIGKILL)
    except openai.APIError as exc:
        error = exc
    assert error is not None and "retry" in str(error), error
    assert chunks >= 3
    behind.join(60)
    assert not behind.is_alive() and "error" not in queued, queued
    assert queued["reply"][1] != victim and queued["reply"][0].usage.completion_tokens >= 1
    for i in range(3):
        r, replica = _chat(
            client, [{"role": "user", "content": f"After the crash, question {i}."}], max_tokens=3, temperature=0
        )
        assert replica != victim and r.usage.completion_tokens >= 1
    _wait(
        lambda: len(_replicas_up(url)) == 2 and victim not in _replicas_up(url), 90, "Ray to replace the killed replica"
    )
    status = serve.status().applications[APP].deployments[ENGINE]
    assert status.replica_states.get("RUNNING") == 2, status.replica_states


def test_shutdown_drains_in_flight_requests(cluster):
    """`serve.delete` (what `thorgen cluster` runs on SIGINT/SIGTERM) lets a running stream finish."""
    url, _ = cluster
    finish: dict = {}
    streaming = threading.Event()  # its first chunk came (a poll of the replicas' running gauge could miss it)

    def stream_to_end() -> None:
        try:
            for ch in _client(url).chat.completions.create(
                model="tiny", messages=LONG, max_tokens=60, temperature=0, stream=True
            ):
                streaming.set()
                if ch.choices and ch.choices[0].finish_reason:
                    finish["reason"] = ch.choices[0].finish_reason
        except Exception as exc:
            finish["error"] = exc
        streaming.set()

    t = threading.Thread(target=stream_to_end, daemon=True)
    t.start()
    assert streaming.wait(60), "the stream did not start"
    assert not finish, f"the stream ended before the shutdown began: {finish}"
    serve.delete(APP)
    t.join(60)
    assert not t.is_alive() and finish.get("reason") in ("length", "stop"), finish
    with pytest.raises(httpx.HTTPError):  # the app is gone: nothing answers generation any more
        httpx.post(
            url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=10
        ).raise_for_status()
