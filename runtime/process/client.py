"""Runtime stage: `ProcessEngineClient`, the EngineClient whose engine runs in a child process, and `open_engine`.

A fault on the device (an illegal address, a trapping kernel) leaves the CUDA context's error sticky: nothing in
that process can use the GPU again, a context reset included. So the engine (runtime/process/child.py: the backend
and its EngineCore) runs in a process of its own, started with multiprocessing's spawn context, and the server's
process never touches CUDA. The server's side keeps EngineClient's requests, streams and health; two threads talk
to the engine process: one sends requests and aborts, one reads the batched outputs of each step.

When the engine process dies (an exit status, a signal, EOF on its pipe) or reports a fault, the requests that
were running in it fail, each with an error that names only itself; a request that has had no output yet (waiting
for its turn, or prefilling) runs again in the next process, once. Health says "recovering" while a fresh process
opens the backend (a new process: a new CUDA context), then "ok"; "failed", with the reason, when it cannot start.
`last_recovery_s` says how long the last recovery took, from the fault to serving again.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import multiprocessing
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.reduction import ForkingPickler
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..api import EngineConfig, ModelFiles, open_backend
from ..backend import GenerationResult
from ..client import Capabilities, EngineClient, EngineFailure, EngineUnavailable, RequestRejected, _Job
from ..engine.core import RequestOutput
from .child import EngineSettings, run_engine

log = logging.getLogger("thorgen.engine")

STOP_GRACE_S = 5.0  # after SIGTERM, how long an engine process gets before SIGKILL


def open_engine(config: EngineConfig, max_queue: int = 1024) -> tuple[EngineClient, ModelFiles]:
    """Open `config` for a server: in an engine process when `config.engine_process`, else on an engine thread;
    blocks until loaded (the load's error re-raised)."""
    if not config.engine_process:
        client, opened = EngineClient.open(config, max_queue)
        return client, opened.files
    settings = EngineSettings(
        functools.partial(open_backend, config),
        config.backend,
        config.kv_dtype,
        config.max_num_seqs,
        max_step_tokens=config.max_step_tokens,
        log_level=logging.getLogger().getEffectiveLevel(),
        switch_interval_s=sys.getswitchinterval(),
    )
    process_client = ProcessEngineClient(settings, max_queue)
    try:
        process_client.wait_ready()
    except BaseException:
        process_client.close()
        raise
    assert process_client.files is not None
    return process_client, process_client.files


@dataclass
class _EngineProcess:
    """One engine process and the server's ends of its two pipes."""

    process: Any  # a multiprocessing (spawn) Process
    inbox: Any  # Connection: the server writes
    outbox: Any  # Connection: the server reads
    reported: bool = False  # it reported a fault it exits for: requests it never read are not its to fail

    def exit_reason(self, timeout: float) -> str:
        """Wait up to `timeout` for the process to end (then stop it), and say how it ended."""
        self.stop(timeout)
        code = self.process.exitcode
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def stop(self, timeout: float) -> None:
        """Join the process; SIGTERM after `timeout`, SIGKILL after STOP_GRACE_S more: never an orphan, no hang."""
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_GRACE_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(STOP_GRACE_S)
        for conn in (self.inbox, self.outbox):
            conn.close()


class ProcessEngineClient(EngineClient):
    """EngineClient over an engine process (runtime/process/child.py), restarted after it dies or loses the
    device; the engine thread here reads that process's messages and supervises it."""

    def __init__(self, settings: EngineSettings, max_queue: int = 1024) -> None:
        self._settings = settings
        self._spawn = multiprocessing.get_context("spawn")  # (fork would copy this process's threads and state)
        self._cond = threading.Condition()  # guards the next three
        self._outbox: deque[tuple[str, _Job]] = deque()  # ("add" | "abort", job) for the feeder to send
        self._engine: _EngineProcess | None = None
        self._accepting = False  # the engine process is up and takes messages
        self._caps: Capabilities | None = None
        self._report: dict[str, Any] | None = None  # the engine core's health, as of its last step
        self._fault_at: float | None = None  # when the fault being recovered from was reported
        self.files: ModelFiles | None = None
        self._feeder = threading.Thread(target=self._feed, name="thorgen-engine-feeder", daemon=True)
        super().__init__(
            _no_backend,
            settings.backend_name,
            settings.kv_dtype,
            max_queue,
            settings.max_num_seqs,
            settings.kv_tokens,
            settings.max_step_tokens,
        )

    # -- what differs from the engine thread's client -----------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        self.wait_ready(0)
        assert self._caps is not None
        return self._caps

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None before it started)."""
        engine = self._engine
        return engine.process.pid if engine is not None else None

    def health(self) -> dict[str, Any]:
        out = super().health()
        if "running" in out:
            out["engine_pid"] = self.engine_pid
        return out

    def _core_report(self) -> dict[str, Any] | None:
        return self._report

    def _enqueue(self, job: _Job) -> None:
        with self._cond:
            self._outbox.append(("add", job))
            self._cond.notify()

    def _cancel(self, job: _Job) -> None:
        job.cancel.set()
        if job.in_core:
            with self._cond:
                self._outbox.append(("abort", job))
                self._cond.notify()

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything, tell the engine process to close its backend and exit (stopped after `timeout`
        otherwise), and join the threads."""
        with self._cond:  # (with _start's check: no engine process starts after this)
            if self._closed:
                return
            self._closed = True
            engine = self._engine
            self._cond.notify_all()  # the feeder sends "close" and ends
        with self._lock:
            jobs = list(self._live.values())
        for job in jobs:
            job.cancel.set()
        if engine is not None:
            engine.stop(timeout)
        self._thread.join(timeout)
        if self._feeder.is_alive():
            self._feeder.join(timeout)

    # -- the engine thread: start the engine process, read it, restart it ----------------------------------------
    def _main(self) -> None:
        try:
            engine = self._start()
        except BaseException as exc:  # reported by wait_ready / health
            self.load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        self._feeder.start()
        try:
            while not self._closed:
                self._read(engine)
                if self._closed:
                    break
                started = self._fault_at or time.perf_counter()
                self._state = "recovering"
                self._lost(engine)
                try:
                    engine = self._start()
                except BaseException as exc:
                    if not self._closed:
                        log.error("the engine process could not be restarted", exc_info=exc)
                        self._failure = f"the engine failed and could not be restarted: {type(exc).__name__}: {exc}"
                        self._state = "failed"
                    break
                self._fault_at = None
                self._recovered(started)
        finally:
            self._fail_all(EngineUnavailable(self._failure or "the engine was closed"))

    def _start(self) -> _EngineProcess:
        """Start an engine process and wait until it has opened the backend; its load error is raised."""
        inbox_read, inbox = self._spawn.Pipe(duplex=False)
        outbox, outbox_write = self._spawn.Pipe(duplex=False)
        widen(inbox)
        process = self._spawn.Process(
            target=run_engine, args=(inbox_read, outbox_write, self._settings), name="thorgen-engine", daemon=True
        )
        with self._cond:
            if self._closed:
                raise EngineUnavailable("the engine was closed")
            process.start()
            engine = self._engine = _EngineProcess(process, inbox, outbox)
        inbox_read.close()  # (this process's copies: EOF then means the engine process's ends closed)
        outbox_write.close()
        try:
            message = outbox.recv()
        except (EOFError, OSError):
            raise EngineFailure(f"the engine process {engine.exit_reason(STOP_GRACE_S)} while loading") from None
        if message[0] == "load_error":
            engine.stop(STOP_GRACE_S)
            raise message[1]
        _, self._caps, self.files, self._report = message
        log.info("the engine process %d is ready", process.pid)
        with self._cond:
            self._accepting = True
            self._cond.notify_all()
        return engine

    def _read(self, engine: _EngineProcess) -> None:
        """Hand the engine process's messages on until its pipe closes."""
        while True:
            try:
                message = engine.outbox.recv()
            except (EOFError, OSError):
                return
            kind = message[0]
            if kind == "step":
                self._on_step(message[1], message[2])
            elif kind == "rejected":
                self._on_rejected(*message[1:])
            elif kind == "fault":
                self._on_fault(engine, *message[1:])

    def _on_step(self, outputs: list[RequestOutput], stats: tuple[Any, ...] | None) -> None:
        for out in outputs:
            with self._lock:
                job = self._live.get(out.request_id)
            if job is not None:
                job.started = True
                self._emit(job, out if out.error is None else self._error_of(out.error))
        if stats is not None:
            running, prepare, flush, finish, self._report = stats
            self._running = running
            st = self._stats
            st["steps"] += 1
            st["running"] += running
            st["prepare"] += prepare
            st["flush"] += flush
            st["finish"] += finish

    def _on_rejected(self, request_id: str, request_fault: bool, message: str) -> None:
        with self._lock:
            job = self._live.get(request_id)
        if job is not None:
            job.in_core = False
            failure = f"request {request_id} failed: {message}"
            self._emit(job, RequestRejected(message) if request_fault else EngineFailure(failure))

    def _on_fault(self, engine: _EngineProcess, request_ids: list[str], error: str, message: str, exits: bool) -> None:
        """The engine process reports a fault of the engine as a whole (it exits after it when `exits`)."""
        log.error("the engine failed during a step (%s: %s); failing its requests", error, message)
        if exits:
            with self._cond:
                self._accepting, engine.reported = False, True
            self._fault_at = time.perf_counter()
            self._state = "recovering"
        with self._lock:
            jobs = [self._live[r] for r in request_ids if r in self._live]
        self._fail_or_rerun(jobs, f"the engine failed during a step it shared with other requests ({error})")
        self.recoveries += 1
        if not exits:  # (it rebuilt its core: serving again already)
            self._recovered(time.perf_counter())

    def _lost(self, engine: _EngineProcess) -> None:
        """The engine process's pipe closed: wait for it to end, then fail or re-run the requests it held."""
        with self._cond:
            self._accepting = False
        self._running = 0
        reason = engine.exit_reason(STOP_GRACE_S)
        with self._lock:
            jobs = [j for j in self._live.values() if j.in_core]
        if engine.reported:  # it failed what it held when it reported: the rest it never read
            log.warning("the engine process %s after its fault", reason)
            self._fail_or_rerun(jobs, None)
            return
        log.error("the engine process %s; failing its requests and starting another", reason)
        self._fail_or_rerun(jobs, f"the engine process {reason} during a step it shared with other requests")
        self.recoveries += 1

    def _fail_or_rerun(self, jobs: list[_Job], failure: str | None) -> None:
        """Fail each of `jobs` that ran with an error naming it and `failure`; queue the others again, ahead of
        the rest (to run once more; a request that already did fails). `failure` None: queue them all again."""
        rerun = []
        for job in jobs:
            job.in_core = job.aborted = False
            if failure is None or not (job.started or job.rerun):
                job.rerun = job.rerun or failure is not None
                rerun.append(job)
            else:
                self._emit(job, EngineFailure(f"request {job.request_id} failed: {failure}; it is recovering"))
        with self._cond:
            self._outbox.extendleft(("add", job) for job in reversed(rerun))
            self._cond.notify()

    # -- the feeder thread: requests and aborts to the engine process --------------------------------------------
    def _feed(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._accepting and self._outbox):
                    self._cond.wait()
                engine = self._engine
                if self._closed:
                    break
                kind, job = self._outbox.popleft()
                message = self._message(kind, job)
            if message is None or engine is None:  # (an accepting client always has its engine process)
                continue
            frames = [ForkingPickler.dumps(message[:2])]
            if message[0] == "add":  # (the request's values in a frame of their own: see child.py's _add)
                try:
                    frames.append(ForkingPickler.dumps(message[2]))
                except Exception as exc:  # a value that cannot cross to the engine process: this request's failure
                    job.in_core = False
                    self._emit(job, self._failed(job.request_id, exc))
                    continue
            try:
                for frame in frames:
                    engine.inbox.send_bytes(frame)
            except (OSError, ValueError):  # it died: the engine thread fails or re-runs the job
                pass
        if engine is not None:
            try:
                engine.inbox.send(("close",))
            except (OSError, ValueError):
                pass

    def _message(self, kind: str, job: _Job) -> tuple[Any, ...] | None:
        """The message that sends `job` (or its abort) to the engine process; None when there is none to send."""
        if kind == "abort":
            if not job.in_core or job.aborted:
                return None
            job.aborted = True
            return ("abort", job.request_id)
        with self._lock:
            live = self._live.get(job.request_id) is job
        if not live:  # ended meanwhile (end_all)
            return None
        if job.cancel.is_set():  # aborted while queued
            result = GenerationResult(prompt_tokens=len(job.prompt_ids), finish_reason="cancelled")
            self._emit(job, RequestOutput(job.request_id, finished=True, result=result))
            return None
        job.in_core = True
        prompt = np.asarray(job.prompt_ids, np.int32)
        return (
            "add",
            job.request_id,
            (prompt, job.max_tokens, job.sampling, job.stop_ids, job.speculative, job.images),
        )


PIPE_BYTES = 1 << 20  # Linux's largest pipe an unprivileged process may ask for (fs.pipe-max-size's default)


def widen(connection: Any) -> None:
    """A pipe that holds a request's image patches (~2 MB at budget 280) in one or two writes rather than Linux's
    default 64 KiB: each refill is a hand-off between the two processes, which cost milliseconds on a busy host.
    Where the system allows no such size (or is not Linux), the pipe stays as it is."""
    try:
        fcntl.fcntl(connection.fileno(), getattr(fcntl, "F_SETPIPE_SZ"), PIPE_BYTES)
    except (AttributeError, OSError):
        pass


def _no_backend() -> Any:  # (EngineClient's opener: never called, the engine process opens the backend)
    raise AssertionError("the engine process opens the backend")
