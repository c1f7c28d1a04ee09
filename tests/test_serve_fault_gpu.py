"""GPU test of the server's recovery from a real fault on the device: `thorgen serve --backend cuda` on the tiny
preset, started through tests/fault_serve.py (the same command line plus the route that arms the fault), with four
streams running when the next engine step launches a kernel that traps (tests/device_fault.py). Each of those
requests fails with an error that names only itself (and its stream still ends with [DONE]); /health reports
`recovering`, then `ok` once the server has started a fresh engine process (`--engine-process`, on by default with
the cuda backend: the trap's sticky error outlives any context reset within the process it hit, so a new CUDA
context needs a new process; tests/fault_serve.py installs the hook in that process); the next requests get what
they got before the fault. The recovery time is printed (`-rA` shows it), as the client saw it and as /health's
`last_recovery_s` has it.

Run on the GPU: `THORGEN_KERNELS=<tiny build> python -m pytest -m gpu -q -rA tests/test_serve_fault_gpu.py`.
"""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

import device_fault  # noqa: E402
from test_serve_gpu import _start, _stop  # noqa: E402

pytestmark = pytest.mark.gpu
LAUNCHER = Path(__file__).resolve().with_name("fault_serve.py")
STREAMS = 4


@pytest.fixture(scope="module")
def fault_server(built, tmp_path_factory):
    model, kernels = built
    log = tmp_path_factory.mktemp("fault-serve") / "serve.log"
    launcher = lambda *args: [sys.executable, str(LAUNCHER), *args]  # noqa: E731
    proc, url = _start(model, kernels, log, "--draft-tokens", "0", "--max-num-seqs", "8", command=launcher)
    try:
        yield url
    finally:
        _stop(proc, log)


def _greedy(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_device_fault_fails_its_requests_and_the_server_recovers(fault_server):
    url = fault_server
    prompts = [[2, 105, 200 + 10 * i, 300, 400, 107] for i in range(STREAMS)]
    before = [_greedy(url, p) for p in prompts]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 3000,  # (the streams must still run when the trap comes: seconds on the GPU)
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    run = device_fault.fault_during_streams(url, STREAMS, body, wholes=1)
    print(
        f"\nrecovery from the device fault: {run.recovery_s:.2f} s from arming it, {run.engine_recovery_s} s by "
        f"/health's last_recovery_s (/health: {' -> '.join(run.states)})"
    )
    named = []
    for whole in run.wholes:  # a 500 that names itself
        assert whole.status == 500, whole.text[:500]
        (rid,) = device_fault.request_ids(whole.text)
        named.append(rid)
    for stream in run.streams:
        assert stream.status == 200 and stream.done, stream.lines[-3:]  # an error event, then [DONE]
        (error,) = stream.errors
        assert "CudaError" in error and "recovering" in error, error
        (rid,) = device_fault.request_ids(error)  # its own request, nobody else's
        named.append(rid)
    assert len(set(named)) == STREAMS + 1
    assert "recovering" in run.states and run.states[-1] == "ok" and run.recoveries == 1
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:  # served correctly, together, after it
        assert list(pool.map(lambda p: _greedy(url, p), prompts)) == before
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["recoveries"] == 1
    assert 0 < health["last_recovery_s"] <= run.recovery_s
