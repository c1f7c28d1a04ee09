"""Runtime API tests: the EngineClient drives its backend from one thread (where it was opened), maps request
mistakes to 4xx and engine failures to 5xx through the server, aborts queued and running requests, and reports
load errors. The cuda backend is served over HTTP on the CPU emulator, whose fake driver answers
CUDA_ERROR_INVALID_CONTEXT off the thread that made its context current (the bug `serve --backend cuda` had)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from thorgen.runtime.api import EngineConfig, open_backend  # noqa: E402
from thorgen.runtime.client import EngineClient, EngineUnavailable, RequestRejected  # noqa: E402
from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.options import default_ctx  # noqa: E402
from thorgen.runtime.engine.kv_pages import PagePool  # noqa: E402
from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import ServerState, create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


class ThreadBoundBackend(ScriptedBackend):
    """Like a CUDA context: usable only on the thread that created it (its runner raises anywhere else)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.owner = threading.get_ident()
        self.closed_on = None

    def here(self) -> None:
        if threading.get_ident() != self.owner:
            raise BackendError("used off its thread")

    def runner(self, max_num_seqs: int = 8, kv_tokens: int | None = None):
        runner = super().runner(max_num_seqs, kv_tokens)
        for name in ("check", "apply", "prefill", "decode", "release"):
            method = getattr(runner, name)
            setattr(runner, name, lambda *a, _m=method, **k: (self.here(), _m(*a, **k))[1])
        return runner

    def close(self) -> None:
        self.here()
        self.closed_on = threading.get_ident()


def _collect(client: EngineClient, prompt: list[int], n: int, abort_after: int | None = None):
    async def run():
        stream = client.submit(prompt, n, SamplingParams(), stop_ids=frozenset({1}))
        outs = []
        async for out in stream:
            outs.append(out)
            if abort_after is not None and len(outs) == abort_after:
                stream.abort()
        return outs

    return asyncio.run(run())


def test_client_opens_runs_and_closes_on_its_own_thread(tok):
    made = {}

    def opener():
        made["b"] = ThreadBoundBackend(lambda p: tok.encode("hello world"), chunk=2)
        return made["b"]

    client = EngineClient(opener)
    client.wait_ready(10)
    outs = _collect(client, [2, 3], 64)
    reply = tok.encode("hello world") + [1]  # the scripted runner ends its turn with the stop id
    assert [t for o in outs for t in o.token_ids] == reply
    final = outs[-1]
    assert final.finished and final.result.finish_reason == "stop" and final.result.token_ids == reply
    assert made["b"].owner != threading.get_ident()
    health = client.health()
    steps = health.pop("steps")  # where the engine thread's time went, summed over its steps
    kv = health.pop("kv")  # the scheduler's KV blocks: none charged once every request finished
    assert health == {
        "status": "ok",
        "running": 0,
        "queued": 0,
        "recoveries": 0,
        "last_recovery_s": None,
        "gpu_memory_used": None,
        # (the scripted runner keeps no images, and registers no page: its prefix index is an empty pool's)
        "caches": {"image_rows_bytes": 0, "prefix_index_bytes": PagePool(1).index_bytes},
    }
    assert kv["blocks"] > 0 and kv["used"] == 0 and kv["block_tokens"] == 16
    assert steps["steps"] >= len(reply) // 2 and min(steps[p] for p in ("prepare", "flush", "finish")) >= 0
    client.close()
    assert made["b"].closed_on == made["b"].owner
    assert client.health()["status"] == "error"


def test_abort_running_and_unknown(tok):
    client = EngineClient(lambda: ScriptedBackend(lambda p: list(range(200, 300)), delay=0.01))
    client.wait_ready(10)
    outs = _collect(client, [2], 100, abort_after=3)
    assert outs[-1].finished and outs[-1].result.finish_reason == "cancelled"
    assert len(outs) < 20  # stopped within a few steps
    assert client.abort("no-such-request") is False
    client.close()


def test_request_mistake_is_rejected_and_load_error_reported():
    client = EngineClient(lambda: ScriptedBackend(lambda p: [5], max_context=8))
    client.wait_ready(10)

    async def too_long():
        stream = client.submit([2] * 4, 2, SamplingParams())
        return await stream.next()

    client.core.runner.check = _raiser(BackendError("prompt token ids [9999] lie outside the vocabulary"))
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        asyncio.run(too_long())
    client.close()

    broken = EngineClient(_raiser(OSError("weights missing")))
    with pytest.raises(OSError, match="weights missing"):
        broken.wait_ready(10)
    assert broken.health() == {"status": "error", "error": "OSError: weights missing"}

    async def submit():
        broken.submit([2], 1, SamplingParams())

    with pytest.raises(EngineUnavailable, match="weights missing"):
        asyncio.run(submit())


def _raiser(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc

    return fn


def _fails_after(runner, exc: BaseException, steps: int):
    """Make the runner's decode raise `exc` once `steps` decode steps ran."""
    decode, calls = runner.decode, []

    def failing(seqs, launched=None):
        calls.append(1)
        if len(calls) > steps:
            raise exc
        return decode(seqs, launched)

    return failing


def test_http_status_of_engine_errors(tok):
    """Client mistakes stay 400; a CUDA error at submission or any failure mid-generation is a 500."""
    from thorgen.runtime.cuda.device import CudaError

    engine = ScriptedBackend(lambda p: tok.encode("ok"))
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    body = {"model": "m", "messages": MSGS}
    with running_server(create_app(state)) as url:
        runner = state.client.core.runner
        cases = [
            (
                "check",
                _raiser(BackendError("prompt token ids [9999] lie outside the vocabulary")),
                400,
                "invalid_request_error",
            ),
            ("prefill", _raiser(CudaError("cuMemGetInfo", 201, "CUDA_ERROR_INVALID_CONTEXT")), 500, "server_error"),
            ("decode", _fails_after(runner, RuntimeError("kernel fault"), 0), 500, "server_error"),
        ]
        for name, fn, status, kind in cases:
            setattr(state.client.core.runner, name, fn)
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == status, r.text
            assert r.json()["error"]["type"] == kind
            for patched in ("check", "prefill", "decode"):  # back to the class's methods (the core may be new)
                state.client.core.runner.__dict__.pop(patched, None)
        # streamed: the failure arrives as an error event after the tokens already sent, then [DONE]
        SCRIPT_LONG = tok.encode("a long reply")
        engine.script = lambda p: SCRIPT_LONG
        state.client.core.runner.decode = _fails_after(state.client.core.runner, RuntimeError("kernel fault"), 2)
        with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), timeout=30) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and "kernel fault" in text and text.rstrip().endswith("data: [DONE]")
        content = "".join(
            json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in text.splitlines()
            if line.startswith("data: {") and "choices" in line
        )
        assert content == "a l"  # the prefill and two decode steps that ran before the failure were streamed
        # the failure finished its request alone: the engine stays healthy and the server still answers
        state.client.core.runner.__dict__.pop("decode", None)
        assert state.client.health()["status"] == "ok"
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
    state.close()


def test_default_ctx():
    assert default_ctx(8192) == 8192 and default_ctx(262144) == 65536 and default_ctx(262144, 1000) == 1000


@pytest.fixture(scope="module")
def emulated_cuda(tiny_checkpoint, tmp_path_factory):
    """(config, driver) for the cuda backend on the CPU emulator (fake driver + fake manifest, real repack)."""
    pytest.importorskip("thorgen.codegen.plan")
    import engine_emulator as EE
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.convert.repack import repack

    root = tmp_path_factory.mktemp("emulated-serve")
    weights = repack(tiny_checkpoint, root / "weights")
    kernels = EE.write_fake_manifest(Checkpoint.open(tiny_checkpoint).spec, root / "kernels")
    drv = EE.install(kernels)
    yield EngineConfig(tiny_checkpoint, "cuda", weights=weights, kernels=kernels), drv
    dev.set_driver(None)


def test_emulated_driver_is_thread_bound(emulated_cuda):
    _, drv = emulated_cuda
    assert drv.cuCtxSetCurrent("ctx")[0] == 0 and drv.cuMemGetInfo()[0] == 0
    seen = []
    t = threading.Thread(target=lambda: seen.append(int(drv.cuMemGetInfo()[0])))
    t.start()
    t.join()
    assert seen == [201]  # CUDA_ERROR_INVALID_CONTEXT off the thread that made the context current


def test_serve_cuda_backend_over_http(emulated_cuda):
    """`serve --backend cuda`'s loader, on the emulator: the engine opens on its own thread and answers HTTP;
    --ctx defaults to the model's 8192 (not 65536, which the tiny model refuses)."""
    from thorgen.serve.cli import open_model

    config, _ = emulated_cuda
    state = ServerState("tiny-cuda", lambda: open_model(config), model_names=("tiny-cuda", "m"))
    state.load()
    assert state.load_error is None, state.load_error
    assert state.caps.backend == "cuda" and state.caps.max_context == 8192
    try:
        with running_server(create_app(state)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
            a = client.completions.create(model="m", prompt=[2, 105, 200, 107], max_tokens=4, temperature=0)
            b = client.completions.create(model="m", prompt=[2, 105, 200, 107], max_tokens=4, temperature=0)
            assert a.usage.completion_tokens == 4 or a.choices[0].finish_reason == "stop"
            assert a.choices[0].text == b.choices[0].text
            chunks = list(
                client.chat.completions.create(model="m", messages=MSGS, max_tokens=3, stream=True, temperature=0)
            )
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        state.close()


def test_open_backend_names_unknown_backend(tiny_checkpoint):
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        open_backend(EngineConfig(tiny_checkpoint, "tpu"))


def test_max_num_batched_tokens_reaches_the_scheduler(tiny_checkpoint):
    """`serve --max-num-batched-tokens N` -> EngineConfig.max_step_tokens -> the scheduler's step budget; without
    it the engine's default (a whole prefill chunk beside every decode); 0 is a usage error, not a server."""
    from click.testing import CliRunner

    from thorgen.runtime.engine.core import default_step_tokens
    from thorgen.serve.cli import serve

    for asked, want in ((40, 40), (None, None)):
        client, _ = EngineClient.open(
            EngineConfig(tiny_checkpoint, "reference", ctx=256, max_num_seqs=2, max_step_tokens=asked)
        )
        try:
            assert _collect(client, [2, 105, 200], 2)  # it ran (the core is built on the engine thread)
            budget = client.core.scheduler.max_step_tokens
            assert budget == (want or default_step_tokens(client.core.runner))
        finally:
            client.close()
    res = CliRunner().invoke(serve, ["--max-num-batched-tokens", "0"])
    assert res.exit_code == 2 and "--max-num-batched-tokens" in res.output
