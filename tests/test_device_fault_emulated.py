"""A fault on the device, on the emulated GPU: the server runs the cuda backend over a fake driver that models what a
trapping kernel does to a real context (every later call fails with CUDA_ERROR_LAUNCH_FAILED until the context is
destroyed or reset). With three streams and a request answered whole running, the trap of tests/device_fault.py (the
same hook the GPU test uses) fails each of them with an error naming only itself (the latter a 500), /health reports
`recovering` then `ok`, the backend reopens in a fresh context, and the next request gets the same tokens as before
the fault."""

from __future__ import annotations

import enum

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

import device_fault  # noqa: E402
from fake_driver import CONTEXT_FREE, FakeDriver  # noqa: E402

pytestmark = pytest.mark.slow  # (the emulated engine, and a server process: 10-20 s each on 2 cores)


class TrapResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_LAUNCH_FAILED = 719  # what a kernel's trap leaves sticky on a real context


class TrappingDriver(FakeDriver):
    """FakeDriver plus the trap kernel (PTX loaded by cuModuleLoadData) and a sticky context error: once the trap
    ran, every context-bound call answers CUDA_ERROR_LAUNCH_FAILED until the primary context is reset or its last
    retain released, which also frees every allocation it held."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sticky = False
        self.traps = self.resets = self.retained = self.contexts = 0

    def __getattribute__(self, name: str):
        attr = object.__getattribute__(self, name)
        sticky = object.__getattribute__(self, "__dict__").get("sticky")  # (unset while FakeDriver.__init__ runs)
        if sticky and name.startswith("cu") and name not in CONTEXT_FREE:
            return lambda *args, **kwargs: (TrapResult.CUDA_ERROR_LAUNCH_FAILED,)
        return super().__getattribute__(name) if callable(attr) else attr

    def cuGetErrorString(self, err):
        return TrapResult.CUDA_SUCCESS, f"fake description of {TrapResult(int(err)).name}".encode()

    def cuDevicePrimaryCtxRetain(self, d):
        if self.retained == 0:
            self.contexts += 1
        self.retained += 1
        return super().cuDevicePrimaryCtxRetain(d)

    def cuDevicePrimaryCtxRelease(self, d):
        self.retained -= 1
        if self.retained == 0:
            self._destroy_context()
        return super().cuDevicePrimaryCtxRelease(d)

    def cuDevicePrimaryCtxReset(self, d):
        self.resets += 1
        self._destroy_context()
        return (TrapResult.CUDA_SUCCESS,)

    def _destroy_context(self) -> None:
        self.sticky = False
        self._arrays.clear()
        self._bases.clear()

    def cuModuleLoadData(self, image):
        return (TrapResult.CUDA_SUCCESS, "trap module") if bytes(image).startswith(b".version") else (0, "module")

    def cuModuleGetFunction(self, mod, name):
        if mod == "trap module":
            assert name == device_fault.TRAP_ENTRY.encode()
            return TrapResult.CUDA_SUCCESS, device_fault.TRAP_ENTRY
        return super().cuModuleGetFunction(mod, name)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        if fn != device_fault.TRAP_ENTRY:
            return super().cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra)

        def trap() -> None:
            self.traps += 1
            self.sticky = True

        return self._run(stream, trap)


@pytest.fixture()
def emulated_server(tiny_checkpoint, tmp_path):
    """(URL, ServerState, driver) of the tiny checkpoint served by the cuda backend on a TrappingDriver, with the
    fault's route and the runner's hook installed."""
    from engine_emulator import write_fake_manifest
    from scripted_backend import TEST_MODEL_NAMES, running_server
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.api import EngineConfig
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.cuda import device as dev
    from thorgen.serve.app import ServerState, create_app
    from thorgen.serve.cli import open_model

    weights = repack(tiny_checkpoint, tmp_path / "weights")
    kernels = write_fake_manifest(Checkpoint.open(tiny_checkpoint).spec, tmp_path / "kernels")
    driver = TrappingDriver(kernels)
    dev.set_driver(driver)
    undo = device_fault.install()
    config = EngineConfig(tiny_checkpoint, "cuda", 512, weights=weights, kernels=kernels, max_num_seqs=4)
    state = ServerState("tiny", lambda: open_model(config), model_names=("tiny", *TEST_MODEL_NAMES))
    try:
        state.load()
        assert state.load_error is None, state.load_error
        app = create_app(state)
        device_fault.add_route(app)
        with running_server(app) as url:
            yield url, state, driver
    finally:
        state.close()
        undo()
        dev.set_driver(None)


def _greedy(url: str) -> list[int]:
    body = {"model": "tiny", "prompt": [2, 105, 200, 300, 107], "max_tokens": 6, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body | {"return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_trap_fails_the_step_s_requests_and_the_engine_reopens(emulated_server):
    url, state, driver = emulated_server
    before, backend = _greedy(url), state.client.backend
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count to a hundred."}],
        "max_tokens": 48,
        "temperature": 0,
        "ignore_eos": True,  # (the random tiny model must not end a stream before the fault)
        "stream": True,
    }
    run = device_fault.fault_during_streams(url, 3, body, wholes=1)
    print(f"\nrecovered in {run.recovery_s:.2f} s; /health went {' -> '.join(run.states)}")
    assert driver.traps == 1 and driver.resets == 1 and driver.contexts == 2
    named = []
    for whole in run.wholes:  # a 500 that names itself
        assert whole.status == 500, whole.text[:500]
        (rid,) = device_fault.request_ids(whole.text)
        named.append(rid)
    for stream in run.streams:  # each failed with its own error event, then [DONE]: none was cut off
        assert stream.status == 200 and stream.done, stream.lines[-3:]
        (error,) = stream.errors
        assert "CudaError" in error and "recovering" in error, error
        (rid,) = device_fault.request_ids(error)  # its own request only
        named.append(rid)
    assert len(set(named)) == 4
    assert "recovering" in run.states and run.states[-1] == "ok" and run.recoveries == 1
    assert state.client.backend is not backend  # reopened, in the fresh context
    assert _greedy(url) == before


def test_only_the_test_launcher_has_the_fault_route(tiny_checkpoint, tmp_path):
    """`thorgen serve` answers the route with a 404; tests/fault_serve.py, the same command line, arms the fault
    with it (a no-op on the reference backend, which launches no kernels)."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    template = ChatTemplate((tiny_checkpoint / "chat_template.jinja").read_text())
    state = scripted_state(ScriptedBackend(lambda prompt: [5]), tok, template)
    try:
        with running_server(create_app(state)) as url:
            assert httpx.post(url + device_fault.FAULT_ROUTE).status_code == 404
    finally:
        state.close()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    launcher = Path(__file__).resolve().with_name("fault_serve.py")
    args = ["serve", "--model", str(tiny_checkpoint), "--port", str(port), "--ctx", "256", "--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, str(launcher), *args])
    try:
        url = f"http://127.0.0.1:{port}"
        while proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, "the launcher's server exited"
        assert httpx.post(url + device_fault.FAULT_ROUTE).status_code == 202
        body = {"prompt": [2, 105, 200], "max_tokens": 3}  # served as before
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
