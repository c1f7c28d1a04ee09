"""Test support (not a test module): a real fault on the device, for the server's recovery tests, and the client
side that watches a server go through it.

The fault is a one-thread kernel that executes PTX `trap` (what CUDA C's `__trap()` compiles to), JIT-compiled by
the driver from PTX text when it is first launched, so nothing is built for it ahead of time. `install()` makes
the cuda runner launch it on the engine's stream ahead of the next step after `arm()`; `add_route()` gives a
server the route that arms it. No `thorgen serve` has that route: tests/fault_serve.py starts one that does.
The trap leaves the context's error sticky, as any fault on the device does: on a real GPU no later driver call in
that process succeeds (the fake driver of tests/test_device_fault_emulated.py lets a context reset clear it).

`arm()` touches a flag file named by the server's process id, so that the engine may run in that process or in
the engine process it started (runtime/process): the hook there watches its parent's flag. `open_faulting` is
that hook for the reference backend (CPU tests): a decode that ends its process, or raises EngineStateLost.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

FAULT_ROUTE = "/test/device-fault"
TRAP_ENTRY = "thorgen_test_trap"
# sm_75: the oldest target CUDA 13 still compiles for; the driver JIT-compiles it for the GPU it runs on
TRAP_PTX = f""".version 7.0
.target sm_75
.address_size 64

.visible .entry {TRAP_ENTRY}()
{{
    trap;
    ret;
}}
"""

FAULT_EXIT = 70  # the status an engine process that `open_faulting` ends exits with
_watched: int | None = None  # the server process whose flag the hook obeys (None: this process)
fired = threading.Event()  # set once a trap was launched


def _flag(server_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"thorgen-test-device-fault-{server_pid}"


def arm() -> None:
    """Make the next engine step of this server (in this process, or in its engine process) fault first."""
    _flag(os.getpid()).touch()
    fired.clear()


def _take() -> bool:
    """Whether the fault is armed, disarming it."""
    try:
        _flag(_watched or os.getpid()).unlink()
    except FileNotFoundError:
        return False
    return True


def _watch(server_pid: int | None) -> None:
    global _watched
    _watched = server_pid
    _flag(server_pid or os.getpid()).unlink(missing_ok=True)  # (a flag left by an earlier process of that id)


def launch_trap(stream: Any) -> None:
    """Load the trap kernel (the driver compiles its PTX) and launch it on `stream` (a runtime Stream)."""
    from thorgen.runtime.cuda.device import check, driver

    cu = driver()
    module = check(cu.cuModuleLoadData(TRAP_PTX.encode() + b"\0"), "load the trap kernel")
    function = check(cu.cuModuleGetFunction(module, TRAP_ENTRY.encode()), "find the trap kernel")
    check(cu.cuLaunchKernel(function, 1, 1, 1, 1, 1, 1, 0, stream.handle, 0, 0), "launch the trap kernel")
    fired.set()  # (its module goes with the context, which the recovery resets)


def install(server_pid: int | None = None) -> Callable[[], None]:
    """Wrap CudaRunner's prefill and decode so that, once armed, the next of them launches the trap on the
    engine's stream before its own work; `server_pid`: the server that arms it (None: this process; in an engine
    process, its parent). Returns the undo."""
    from thorgen.runtime.cuda.runner import CudaRunner

    _watch(server_pid)
    originals = {name: getattr(CudaRunner, name) for name in ("prefill", "decode")}

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _take():
                launch_trap(self.engine.stream)
            return original(self, *args, **kwargs)

        return step

    for name, original in originals.items():
        setattr(CudaRunner, name, wrap(original))

    def undo() -> None:
        for name, original in originals.items():
            setattr(CudaRunner, name, original)

    return undo


def open_faulting(config: Any, server_pid: int, fault: str) -> Any:
    """An engine process's opener (runtime.process.child.EngineSettings.opener): runtime.api.open_backend(config),
    whose runners' decode, once the server `server_pid` armed the fault, faults instead: `fault` "exit" ends the
    process there (status FAULT_EXIT), as a fault that takes the process down; "lost" raises EngineStateLost, as
    the cuda backend does after a device error."""
    from thorgen.runtime.api import open_backend
    from thorgen.runtime.backend import EngineStateLost

    _watch(server_pid)
    opened = open_backend(config)
    make_runner = opened.backend.runner

    def runner(*args: Any, **kwargs: Any) -> Any:
        made = make_runner(*args, **kwargs)
        decode = made.decode

        def faulting_decode(*a: Any, **k: Any) -> Any:
            if _take():
                if fault == "exit":
                    os._exit(FAULT_EXIT)
                raise EngineStateLost("the device's state is lost (the test's fault)")
            return decode(*a, **k)

        made.decode = faulting_decode
        return made

    opened.backend.runner = runner
    return opened


def add_route(app: Any) -> None:
    """POST FAULT_ROUTE on a FastAPI app arms the trap (202)."""
    from fastapi.responses import JSONResponse

    @app.post(FAULT_ROUTE, include_in_schema=False)
    async def device_fault() -> JSONResponse:
        arm()
        return JSONResponse({"armed": True}, status_code=202)


# ---- the client side: streams, the fault in their midst, /health through the recovery ----------------------------


@dataclass
class Stream:
    """One streamed chat completion: its SSE lines, and when its first text arrived."""

    lines: list[str] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    status: int | None = None

    @property
    def errors(self) -> list[str]:
        return [json.loads(x[6:])["error"]["message"] for x in self.lines if x.startswith('data: {"error"')]

    @property
    def done(self) -> bool:
        return bool(self.lines) and self.lines[-1] == "data: [DONE]"


@dataclass
class Whole:
    """One chat completion answered whole: its status and body."""

    status: int | None = None
    text: str = ""


@dataclass
class FaultRun:
    streams: list[Stream]
    wholes: list[Whole]  # requests answered whole, sent before the streams
    states: list[str]  # /health's status at each poll from the fault on, repeats collapsed
    recovery_s: float  # from arming the fault to /health answering ok again
    recoveries: int  # /health's count at the end
    engine_recovery_s: float | None = None  # /health's last_recovery_s at the end: the server's own measure


def request_ids(text: str) -> set[str]:
    """The engine's request ids an error message names."""
    return set(re.findall(r"\breq-\d+\b", text))


def _has_text(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    return any((c.get("delta") or {}).get("content") for c in json.loads(line[6:]).get("choices", []))


def _stream(url: str, body: dict, out: Stream) -> None:
    import httpx

    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        out.status = r.status_code
        for line in r.iter_lines():
            if line:
                out.lines.append(line)
                if _has_text(line):
                    out.started.set()
    out.started.set()  # (ended before any text: the waiter must not hang)


def _whole(url: str, body: dict, out: Whole) -> None:
    import httpx

    r = httpx.post(url + "/v1/chat/completions", json=body | {"stream": False}, timeout=300)
    out.status, out.text = r.status_code, r.text


def fault_during_streams(
    url: str, n: int, body: dict, wholes: int = 0, poll_s: float = 0.005, limit_s: float = 300
) -> FaultRun:
    """`wholes` requests of `body` answered whole, then `n` streams of it; once each stream has text, the fault is
    armed through the server's route and /health is polled until it answers ok with one more recovery (or
    `limit_s` passes)."""
    import httpx

    before = httpx.get(url + "/health", timeout=10).json().get("recoveries", 0)
    streams, answers = [Stream() for _ in range(n)], [Whole() for _ in range(wholes)]
    threads = [threading.Thread(target=_whole, args=(url, body, w), daemon=True) for w in answers]
    threads += [threading.Thread(target=_stream, args=(url, body, s), daemon=True) for s in streams]
    for t in threads:
        t.start()
    for s in streams:
        s.started.wait(limit_s)
    r = httpx.post(url + FAULT_ROUTE, timeout=10)
    assert r.status_code == 202, r.text
    armed, states, recoveries, health = time.monotonic(), [], before, {}
    with httpx.Client(timeout=10) as http:
        while time.monotonic() - armed < limit_s:
            health = http.get(url + "/health").json()
            if not states or states[-1] != health["status"]:
                states.append(health["status"])
            recoveries = health.get("recoveries", recoveries)
            if health["status"] in ("ok", "failed") and recoveries > before:
                break
            time.sleep(poll_s)
    recovery_s = time.monotonic() - armed
    for t in threads:
        t.join(limit_s)
    return FaultRun(streams, answers, states, recovery_s, recoveries, health.get("last_recovery_s"))
