"""The engine in its own process (runtime/process), served over HTTP on the reference backend: a fault in the middle
of a step (the engine process exits there, as a device fault takes a process down; or it reports EngineStateLost;
or it is killed with SIGKILL) fails the requests that were running, each with an error naming only itself, while a
request that had no output yet runs again; /health goes `recovering`, then `ok` once a fresh engine process has
loaded, and the requests after it get the reference's tokens. An engine process that cannot start again leaves
/health `failed` with the reason; requests abort across the process boundary; closing the server leaves no engine
process."""

from __future__ import annotations

import functools
import os
import pickle
import signal
import threading
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import device_fault  # noqa: E402
from thorgen.runtime.api import EngineConfig, open_backend  # noqa: E402
from thorgen.runtime.backend import BackendError, SamplingParams, SequenceFailed  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.process.child import EngineSettings  # noqa: E402
from thorgen.runtime.process.client import ProcessEngineClient, open_engine  # noqa: E402

pytestmark = pytest.mark.slow  # (engine processes start in ~2 s each on 2 cores)

PROMPT = [2, 105, 200, 300, 107]
MAX_TOKENS = 6
STREAM = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Count to a hundred."}],
    "max_tokens": 200,  # (still running when the fault comes)
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def reference_tokens(tiny_checkpoint) -> list[int]:
    """PROMPT's greedy tokens from the reference backend's engine core, in this process."""
    backend = open_backend(EngineConfig(tiny_checkpoint, "reference", 256)).backend
    core = EngineCore(backend.runner(1))
    core.add("r", PROMPT, MAX_TOKENS, SamplingParams())
    tokens: list[int] = []
    while core.unfinished:
        for out in core.step():
            tokens += out.token_ids
    backend.close()
    return tokens


def _serve(tiny_checkpoint, fault: str = "exit"):
    """A ServerState over a ProcessEngineClient (2 sequences at once) whose engine process faults as `fault` once
    this process arms it (device_fault.arm)."""
    from thorgen.runtime.text.prompts import load_chat_template
    from thorgen.serve.app import ServerState
    from thorgen.serve.chat_template import ChatTemplate, load_tokenizer

    config = EngineConfig(tiny_checkpoint, "reference", 256)
    opener = functools.partial(device_fault.open_faulting, config, os.getpid(), fault)
    settings = EngineSettings(opener, "reference", "bf16", max_num_seqs=2)

    def loader():
        client = ProcessEngineClient(settings)
        client.wait_ready()
        files = client.files
        source, bos = load_chat_template(files.model_dir, files.chat_template)
        return client, load_tokenizer(files.tokenizer_path), ChatTemplate(source, bos), files.generation_config

    state = ServerState("tiny", loader)
    state.load()
    assert state.load_error is None, state.load_error
    return state


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _greedy(url: str) -> tuple[int, list[int] | str]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    return r.status_code, (r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text)


def _recovery(url: str, before: int, limit_s: float = 120) -> tuple[list[str], dict]:
    """/health's states (repeats collapsed) until it answers ok with more than `before` recoveries."""
    states: list[str] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        health = httpx.get(url + "/health", timeout=10).json()
        if not states or states[-1] != health["status"]:
            states.append(health["status"])
        if health["status"] in ("ok", "failed") and health.get("recoveries", 0) > before:
            return states, health
        time.sleep(0.005)
    raise AssertionError(f"no recovery within {limit_s} s: {states}")


def _streams(url: str, n: int) -> tuple[list[device_fault.Stream], list[threading.Thread]]:
    streams = [device_fault.Stream() for _ in range(n)]
    threads = [threading.Thread(target=device_fault._stream, args=(url, STREAM, s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        assert s.started.wait(120)
    return streams, threads


def _failed_alone(stream: device_fault.Stream, *words: str) -> str:
    """The one request id the stream's error names (its own); the stream still ended with [DONE]."""
    assert stream.status == 200 and stream.done, stream.lines[-3:]
    (error,) = stream.errors
    assert "recovering" in error and all(w in error for w in words), error
    (rid,) = device_fault.request_ids(error)
    return rid


@pytest.mark.parametrize("fault, words", [("exit", ("exited with status 70",)), ("lost", ("EngineStateLost",))])
def test_a_fault_fails_the_running_requests_and_a_fresh_engine_process_serves(
    tiny_checkpoint, reference_tokens, fault, words
):
    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    state = _serve(tiny_checkpoint, fault)
    try:
        app = create_app(state)
        device_fault.add_route(app)
        with running_server(app) as url:
            assert _greedy(url) == (200, reference_tokens)
            first_pid = state.client.engine_pid
            streams, threads = _streams(url, 2)  # both sequences the engine runs at once
            waiting: dict = {}  # a request with no output yet: it runs again in the next engine process
            queued = threading.Thread(target=lambda: waiting.update(answer=_greedy(url)), daemon=True)
            queued.start()
            time.sleep(0.5)  # (handed to the engine, or still queued here: either way it must be served)
            assert httpx.post(url + device_fault.FAULT_ROUTE, timeout=10).status_code == 202
            states, health = _recovery(url, 0)
            for t in [*threads, queued]:
                t.join(120)
            named = {_failed_alone(s, *words) for s in streams}
            assert len(named) == 2  # each names itself
            assert waiting["answer"] == (200, reference_tokens)
            assert "recovering" in states and states[-1] == "ok", states  # (ok until the next step faults)
            assert health["recoveries"] == 1 and health["last_recovery_s"] > 0
            assert health["engine_pid"] != first_pid
            assert _greedy(url) == (200, reference_tokens)
    finally:
        state.close()


def test_an_engine_process_killed_with_sigkill_is_replaced(tiny_checkpoint, reference_tokens):
    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    state = _serve(tiny_checkpoint)
    pids = []
    try:
        with running_server(create_app(state)) as url:
            (stream,), threads = _streams(url, 1)
            pids.append(state.client.engine_pid)
            os.kill(pids[0], signal.SIGKILL)
            states, health = _recovery(url, 0)
            threads[0].join(120)
            _failed_alone(stream, "killed by SIGKILL")
            assert "recovering" in states and health["status"] == "ok" and health["recoveries"] == 1
            assert _greedy(url) == (200, reference_tokens)
            body = {  # a grammar crosses to the engine process (as its text and its tokenizer's key)
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "object"}}},
            }
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            pids.append(state.client.engine_pid)
    finally:
        state.close()
    assert pids[1] != pids[0]
    for pid in pids:  # the killed one reaped, the second closed with the server: neither left behind
        assert not _exists(pid)


def test_closing_the_server_mid_stream_ends_its_engine_process(tiny_checkpoint):
    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    state = _serve(tiny_checkpoint)
    with running_server(create_app(state)) as url:
        (stream,), threads = _streams(url, 1)
        pid = state.client.engine_pid
        state.close()
        threads[0].join(60)
    assert not _exists(pid)
    assert stream.done and len(stream.errors) == 1, stream.lines[-3:]


def test_an_engine_process_that_cannot_load_reports_why(tmp_path):
    config = EngineConfig(tmp_path / "missing", "reference", 256, engine_process=True)
    with pytest.raises(BackendError, match="missing"):
        open_engine(config)


def test_a_sequence_failure_crosses_the_process_boundary_whole():
    error = pickle.loads(pickle.dumps(SequenceFailed("req-3", "bad grammar", request_fault=True)))
    assert (error.request_id, error.request_fault, str(error)) == ("req-3", True, "request req-3: bad grammar")


def test_an_engine_process_that_cannot_start_again_leaves_health_failed(tiny_checkpoint, tmp_path):
    """The checkpoint gone when the fault comes: the restart's load error is /health's reason, requests get 503."""
    import shutil

    from scripted_backend import running_server
    from thorgen.serve.app import create_app

    model = shutil.copytree(tiny_checkpoint, tmp_path / "model")
    state = _serve(model)
    try:
        app = create_app(state)
        device_fault.add_route(app)
        with running_server(app) as url:
            (stream,), threads = _streams(url, 1)
            shutil.rmtree(model)
            assert httpx.post(url + device_fault.FAULT_ROUTE, timeout=10).status_code == 202
            states, health = _recovery(url, 0)
            threads[0].join(60)
            _failed_alone(stream, "exited with status 70")
            assert states[-1] == "failed" and "could not be restarted" in health["error"], health
            assert "model" in health["error"]  # (the load error names the missing folder)
            status, text = _greedy(url)
            assert status == 503 and "could not be restarted" in text
    finally:
        state.close()


def test_requests_abort_in_the_engine_process(tiny_checkpoint):
    import asyncio

    config = EngineConfig(tiny_checkpoint, "reference", 256)
    client = ProcessEngineClient(EngineSettings(functools.partial(open_backend, config), "reference", "bf16"))
    try:
        client.wait_ready()

        async def run() -> tuple[str, str]:
            running = client.submit(PROMPT, 200, SamplingParams())
            first = await running.next(60)
            queued = client.submit(PROMPT, 200, SamplingParams())  # aborted before it can run a step
            queued.abort()
            running.abort()
            outs = [first] + [out async for out in running]
            queued_outs = [out async for out in queued]
            return outs[-1].result.finish_reason, queued_outs[-1].result.finish_reason

        assert asyncio.run(run()) == ("cancelled", "cancelled")
        assert client.health()["running"] == 0
    finally:
        client.close()


def test_a_request_that_cannot_cross_to_the_engine_process_fails_alone(tiny_checkpoint, tmp_path):
    """Values that do not pickle here, or cannot be rebuilt there, fail their request alone; the next one runs."""
    import asyncio

    pytest.importorskip("llguidance")
    from scripted_backend import write_test_tokenizer
    from thorgen.runtime.client import EngineFailure
    from thorgen.runtime.text.grammar import Grammar, tokenizer

    config = EngineConfig(tiny_checkpoint, "reference", 256)
    client = ProcessEngineClient(EngineSettings(functools.partial(open_backend, config), "reference", "bf16"))
    try:
        client.wait_ready()
        gone = write_test_tokenizer(tmp_path / "tokenizer.json")
        tok = tokenizer(str(gone), client.capabilities.vocab_size, (1,))
        gone.unlink()  # (the engine process rebuilds its tokenizer from this file)

        async def failure(grammar: Grammar) -> str:
            stray = client.submit(PROMPT, 4, SamplingParams(grammar=grammar))
            with pytest.raises(EngineFailure) as caught:
                await stray.next(60)
            assert device_fault.request_ids(str(caught.value)) == {stray.request_id}
            return str(caught.value)

        async def run() -> tuple[str, str, list[int]]:
            here = await failure(Grammar("start: /a/", object()))  # a tokenizer tokenizer() did not make
            there = await failure(Grammar("start: /a/", tok))
            outs = [out async for out in client.submit(PROMPT, MAX_TOKENS, SamplingParams())]
            return here, there, list(outs[-1].result.token_ids)

        here, there, tokens = asyncio.run(run())
        assert "TypeError: a Grammar pickles only" in here and "FileNotFoundError" in there
        assert len(tokens) == MAX_TOKENS and client.health()["recoveries"] == 0
    finally:
        client.close()


def test_the_soak_counts_the_engine_process_s_memory(tiny_checkpoint):
    import asyncio

    from scripted_backend import running_server
    from thorgen.runtime.bench.soak import _sample, process_rss
    from thorgen.serve.app import create_app

    state = _serve(tiny_checkpoint)
    try:
        with running_server(create_app(state)) as url:

            async def sample() -> dict:
                async with httpx.AsyncClient(timeout=30) as http:
                    return await _sample(http, url, 0.0, os.getpid())

            got = asyncio.run(sample())
            engine_pid = state.client.engine_pid
            assert got["rss_source"] == f"pid {os.getpid()} + engine process {engine_pid}"
            assert got["rss_bytes"] > process_rss(engine_pid)
            assert got["rss_bytes"] == got["server_rss_bytes"] + got["engine_rss_bytes"]  # (each apart too)
            assert got["server_rss_bytes"] > 0 and got["engine_rss_bytes"] > 0
    finally:
        state.close()


def test_the_request_pipe_holds_an_images_patches_in_few_writes() -> None:
    import multiprocessing

    from thorgen.runtime.process.client import PIPE_BYTES, widen

    fcntl = pytest.importorskip("fcntl")
    if not hasattr(fcntl, "F_GETPIPE_SZ") or not os.path.exists("/proc/sys/fs/pipe-max-size"):
        pytest.skip("no pipe sizes on this system")
    with open("/proc/sys/fs/pipe-max-size") as f:
        if int(f.read()) < PIPE_BYTES and os.geteuid() != 0:
            pytest.skip("this system allows no pipe that large")
    read, write = multiprocessing.get_context("spawn").Pipe(duplex=False)
    try:
        before = fcntl.fcntl(write.fileno(), fcntl.F_GETPIPE_SZ)
        widen(write)
        assert fcntl.fcntl(read.fileno(), fcntl.F_GETPIPE_SZ) == PIPE_BYTES > before
    finally:
        read.close()
        write.close()
