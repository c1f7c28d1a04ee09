"""Runtime stage: the engine client: `EngineClient` drives a backend from its own thread for the server.

The server talks to an `EngineClient`, which owns the thread that drives the device: the backend is opened on that
thread (runtime/api.py's `open_backend`) and every later call into it (the engine core's steps, close) runs there
too, so a CUDA context made current while loading is current wherever CUDA is called. That thread runs
runtime/engine/core.py's `EngineCore` over the backend's ModelRunner: submitted requests join the running batch
between steps. Outputs come back as immutable `RequestOutput` values, the last of which carries the request's
`GenerationResult`.

A fault stays with its request: a sequence the core finishes with its own error (runtime.backend.SequenceFailed)
ends as RequestRejected (the request's fault) or EngineFailure naming that request only, beside the others. A fault
of the engine itself (a step that fails as a whole, a device error) fails the requests in the core, each with an
error that names only itself, and the engine rebuilds its core (after EngineStateLost: reopens the backend) while
queued requests wait; `health()` says "recovering" meanwhile and "failed" when the rebuild failed. A fault on a
real GPU outlives any rebuild in its process: runtime/process's ProcessEngineClient, this client over an engine in
a child process, recovers from one by starting a fresh process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..model_spec.types import Gemma4VisionSpec
from .api import EngineConfig, OpenedModel, open_backend
from .backend import BackendError, EngineStateLost, GenerationResult, ImageSpan, SamplingParams, SequenceFailed
from .engine.core import EngineCore, RequestOutput
from .engine.interface import Backend

log = logging.getLogger("thorgen.engine")


class RequestRejected(BackendError):
    """The request cannot be served as asked (prompt over the context, bad ids, ...): a client error (4xx)."""


class EngineFailure(RuntimeError):
    """The engine failed while running a request (a CUDA error, a bug): a server error (5xx)."""


class EngineBusy(RuntimeError):
    """The queue is full; retry later (429)."""


class EngineUnavailable(RuntimeError):
    """The engine is loading, failed to load, or was closed (503)."""


@dataclass(frozen=True)
class Capabilities:
    backend: str
    max_context: int
    speculative: bool  # the backend can run DFlash draft + verify
    kv_dtype: str
    vocab_size: int
    constrained: bool = False  # grammar-constrained decoding (structured outputs, forced tool calls) works
    vision: Gemma4VisionSpec | None = None  # the model's vision tower (what image preprocessing needs); None: none


def capabilities_of(backend: Backend, backend_name: str, kv_dtype: str) -> Capabilities:
    features = backend.features
    return Capabilities(
        backend_name,
        backend.max_context,
        features.speculative,
        kv_dtype,
        backend.spec.target.vocab_size,
        features.grammar,
        backend.spec.vision,
    )


@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculative: bool
    stream: "RequestStream"
    images: tuple[ImageSpan, ...] = ()
    cancel: threading.Event = field(default_factory=threading.Event)
    in_core: bool = False  # handed to the engine core (else still in the submission queue)
    aborted: bool = False  # the core was told
    # (an engine process's client, runtime/process) outputs came back: the request ran; else, its engine process
    # dying, it runs again in the next one, once (`rerun`)
    started: bool = False
    rerun: bool = False


class OutputStream:
    """One request's outputs, in order: `async for out in stream`, or `await stream.next(t)`. Producers put
    RequestOutputs, or an exception that ends the stream, on `_queue`; `abort()` stops the request."""

    request_id: str

    def __init__(self) -> None:
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.done = False

    async def next(self, timeout: float | None = None) -> RequestOutput:
        """The next output; asyncio.TimeoutError when none comes within `timeout` (the request keeps running)."""
        if self.done:
            raise StopAsyncIteration
        item = await (asyncio.wait_for(self._queue.get(), timeout) if timeout is not None else self._queue.get())
        if isinstance(item, BaseException):
            self.done = True
            raise item
        self.done = item.finished
        return item

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        return await self.next()

    def abort(self) -> None:
        raise NotImplementedError


class RequestStream(OutputStream):
    """An EngineClient request's outputs; raises RequestRejected or EngineFailure where the engine reported one."""

    def __init__(self, client: "EngineClient", request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self.client, self.request_id, self._loop = client, request_id, loop

    def _put(self, item: RequestOutput | BaseException) -> None:  # engine thread -> event loop
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop shut down meanwhile
            pass

    def abort(self) -> None:
        self.client.abort(self.request_id)


class EngineClient:
    """Owns the engine thread, which runs an EngineCore over the backend's ModelRunner (continuous batching
    up to `max_num_seqs`). `opener` runs on that thread and returns the backend (or raises: the load error)."""

    def __init__(
        self,
        opener: Callable[[], Backend],
        backend_name: str = "reference",
        kv_dtype: str = "bf16",
        max_queue: int = 1024,
        max_num_seqs: int = 8,
        kv_tokens: int | None = None,
        max_step_tokens: int | None = None,
    ) -> None:
        self.backend_name, self.kv_dtype, self.max_queue = backend_name, kv_dtype, max_queue
        self.max_num_seqs, self.kv_tokens, self.max_step_tokens = max_num_seqs, kv_tokens, max_step_tokens
        self.backend: Backend | None = None
        self.core: EngineCore | None = None
        self.load_error: BaseException | None = None
        self._loaded = threading.Event()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._live: dict[str, _Job] = {}  # queued or running, by request id
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running = 0
        self._pending: list[RequestOutput] = []  # the last step's outputs, streamed during the next step
        # where the engine thread's time goes, summed over steps (health(); /metrics): "prepare" = step start ->
        # device work enqueued (scheduling, staging, launches), "flush" = handing the previous step's outputs to
        # the clients, "finish" = the rest (waiting for the device, postprocessing)
        self._stats = {"steps": 0, "running": 0, "prepare": 0.0, "flush": 0.0, "finish": 0.0}
        self._closed = False
        self._state = "ok"  # "recovering" while a fault rebuilds the engine, "failed" when that failed
        self._failure: str | None = None  # why the engine failed for good
        self.recoveries = 0  # engine faults recovered from
        self.last_recovery_s: float | None = None  # how long the last recovery took (from the fault to serving)
        self._opener = opener
        self._thread = threading.Thread(target=self._main, name="thorgen-engine", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, config: EngineConfig, max_queue: int = 1024) -> tuple["EngineClient", OpenedModel]:
        """Open `config` on a new engine thread; blocks until loaded; BackendError/... from the load re-raised."""
        holder: dict[str, OpenedModel] = {}

        def opener() -> Backend:
            holder["model"] = open_backend(config)
            return holder["model"].backend

        client = cls(
            opener,
            config.backend,
            config.kv_dtype,
            max_queue,
            config.max_num_seqs,
            max_step_tokens=config.max_step_tokens,
        )
        client.wait_ready()
        return client, holder["model"]

    # -- lifecycle --------------------------------------------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._loaded.wait(timeout):
            raise EngineUnavailable("the engine is still loading")
        if self.load_error is not None:
            raise self.load_error

    @property
    def ready(self) -> bool:
        return (
            self._loaded.is_set()
            and self.load_error is None
            and self._thread.is_alive()
            and not self._closed
            and self._state != "failed"
        )

    @property
    def capabilities(self) -> Capabilities:
        self.wait_ready(0)
        assert self.backend is not None
        return capabilities_of(self.backend, self.backend_name, self.kv_dtype)

    def health(self) -> dict[str, Any]:
        if not self._loaded.is_set():
            return {"status": "loading"}
        if self.load_error is not None:
            return {"status": "error", "error": f"{type(self.load_error).__name__}: {self.load_error}"}
        if self._state == "failed":
            return {"status": "failed", "error": self._failure, "recoveries": self.recoveries}
        if self._closed or not self._thread.is_alive():
            return {"status": "error", "error": "the engine thread stopped"}
        with self._lock:
            live = len(self._live)
        running = min(self._running, live)
        out: dict[str, Any] = {
            "status": self._state,
            "running": running,
            "queued": live - running,
            "recoveries": self.recoveries,
            "last_recovery_s": self.last_recovery_s,
            "steps": dict(self._stats),
        }
        report = self._core_report()
        if report is not None:
            report = dict(report)
            out["steps"]["catch_up_tokens"] = report.pop("catch_up_tokens")
            spec = report.pop("speculation")
            drafted = spec["draft_tokens"]
            # accepted drafts per drafted token (None before any speculative step)
            spec["acceptance_rate"] = round(spec["accepted_tokens"] / drafted, 4) if drafted else None
            out["steps"].update(spec)
            out.update(report)
        return out

    def _core_report(self) -> dict[str, Any] | None:
        """The engine core's part of health() (EngineCore.health: ints, read between steps or not)."""
        core = self.core
        return core.health() if core is not None else None

    def close(self, timeout: float = 30.0) -> None:
        """Cancel everything, close the backend on its own thread, and join it."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            jobs = list(self._live.values())
        for job in jobs:
            self._cancel(job)
        self._jobs.put(None)
        self._thread.join(timeout)

    def end_all(self, reason: str) -> int:
        """End every queued and running request now with EngineUnavailable(reason) (e.g. a shutdown's deadline):
        its stream raises that next, and the engine cancels it at its next step. Returns how many were ended."""
        with self._lock:
            jobs = list(self._live.values())
        for job in jobs:
            self._cancel(job)
            self._emit(job, EngineUnavailable(reason))
        return len(jobs)

    # -- requests ---------------------------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        request_id: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> RequestStream:
        """Queue a request; call from a running event loop. The returned stream yields its outputs. `images`:
        the prompt's image spans (runtime.media.prompts.expand_image_tokens makes the prompt and the spans)."""
        if not self.ready:
            health = self.health()
            raise EngineUnavailable(health.get("error") or f"the engine is {health['status']}")
        request_id = request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id, asyncio.get_running_loop())
        job = _Job(
            request_id,
            list(prompt_ids),
            int(max_tokens),
            sampling,
            frozenset(stop_ids),
            speculative,
            stream,
            tuple(images),
        )
        with self._lock:
            if request_id in self._live:
                raise RequestRejected(f"request id {request_id!r} is already running")
            if len(self._live) >= self.max_queue:
                raise EngineBusy(f"the server is busy: {len(self._live)} requests queued; retry later")
            self._live[request_id] = job
        self._enqueue(job)
        return stream

    def abort(self, request_id: str) -> bool:
        """Stop a queued or running request (it finishes with finish_reason "cancelled"); False if unknown."""
        with self._lock:
            job = self._live.get(request_id)
        if job is None:
            return False
        self._cancel(job)
        return True

    def _enqueue(self, job: _Job) -> None:
        """Hand a submitted job to the engine thread."""
        self._jobs.put(job)

    def _cancel(self, job: _Job) -> None:
        """Mark `job` cancelled: the engine thread finishes it ("cancelled") at its next step."""
        job.cancel.set()

    # -- the engine thread ------------------------------------------------------------------------------------
    def _new_core(self) -> EngineCore:
        assert self.backend is not None, "no backend is open"
        runner = self.backend.runner(self.max_num_seqs, self.kv_tokens)
        return EngineCore(runner, self.max_step_tokens, self.backend.draft_options)

    @property
    def _core(self) -> EngineCore:
        """The engine core the engine thread drives (there is one whenever it runs a step)."""
        assert self.core is not None, "no engine core"
        return self.core

    def _main(self) -> None:
        try:
            self.backend = self._opener()
            self.core = self._new_core()
        except BaseException as exc:  # reported by wait_ready / health
            self.load_error = exc
            self._loaded.set()
            return
        self._loaded.set()
        try:
            while True:
                try:
                    if not self._admit(block=self.core.unfinished == 0):
                        break
                    self._abort_cancelled()
                    if self.core.unfinished:
                        self._step()
                except Exception as exc:
                    if not self._recover(exc):
                        break
        finally:
            self._flush()
            self._fail_all(EngineUnavailable(self._failure or "the engine was closed"))
            self._close_backend()

    def _close_backend(self) -> None:
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                log.exception("closing the backend failed")

    def _recover(self, exc: BaseException) -> bool:
        """An engine fault: every request in the core fails with an error naming only itself, then the core is
        rebuilt (after EngineStateLost, or when that fails, the backend is reopened first). Queued requests wait
        and run after. False when the engine could not be rebuilt (health: "failed")."""
        log.error("the engine failed during a step; failing its requests and rebuilding it", exc_info=exc)
        started = time.perf_counter()
        self._state = "recovering"
        self._flush()
        with self._lock:
            jobs = [j for j in self._live.values() if j.in_core]
        for job in jobs:
            self._emit(
                job,
                EngineFailure(
                    f"request {job.request_id} failed: the engine failed during a step it "
                    f"shared with other requests ({type(exc).__name__}); it is recovering"
                ),
            )
        self._running = 0
        self.recoveries += 1
        reopen = isinstance(exc, EngineStateLost)
        for attempt in ("core", "backend"):
            if attempt == "core" and reopen:
                continue
            try:
                if attempt == "backend":
                    self._close_backend()
                    self.backend = self._opener()
                self.core = self._new_core()
                self._recovered(started)
                return True
            except Exception as rebuild:
                log.error("rebuilding the engine (%s) failed", attempt, exc_info=rebuild)
                self._failure = f"the engine failed and could not be rebuilt: {type(rebuild).__name__}: {rebuild}"
        self._state = "failed"
        return False

    def _recovered(self, started: float) -> None:
        self.last_recovery_s = time.perf_counter() - started
        self._state, self._failure = "ok", None
        log.warning("the engine recovered from its fault in %.2f s", self.last_recovery_s)

    def _admit(self, block: bool) -> bool:
        """Move submitted jobs into the core (waiting for one when idle); False once close() was called."""
        while True:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            block = False
            if job.cancel.is_set():  # aborted while queued
                result = GenerationResult(prompt_tokens=len(job.prompt_ids), finish_reason="cancelled")
                self._emit(job, RequestOutput(job.request_id, finished=True, result=result))
                continue
            try:
                self._core.add(
                    job.request_id,
                    job.prompt_ids,
                    job.max_tokens,
                    job.sampling,
                    job.stop_ids,
                    job.speculative,
                    job.images,
                )
                job.in_core = True
            except EngineStateLost as exc:  # (a driver failure is the engine's fault, whenever it happens)
                self._emit(job, self._failed(job.request_id, exc))
                raise
            except BackendError as exc:
                self._emit(job, RequestRejected(str(exc)))
            except Exception as exc:
                self._emit(job, self._failed(job.request_id, exc))

    def _abort_cancelled(self) -> None:
        with self._lock:
            jobs = [j for j in self._live.values() if j.in_core and not j.aborted and j.cancel.is_set()]
        for job in jobs:
            job.aborted = True
            self._core.abort(job.request_id)

    def _step(self) -> None:
        """One core step. The previous step's outputs go to the clients while this step's device work runs
        (the core calls `launched` right after enqueueing it): waking the event loop then costs no GPU time,
        where waking it between steps let it take the GIL before the next launch."""
        marks = [time.perf_counter()]

        def launched() -> None:
            marks.append(time.perf_counter())
            self._flush()
            marks.append(time.perf_counter())

        core = self._core
        outputs = core.step(launched=launched)  # (a fault of the engine itself raises: _recover)
        self._running = len(core.scheduler.running)
        self._pending = outputs
        t0, enqueued, flushed = marks
        st = self._stats  # (read by health() on other threads: a glimpse, not a snapshot)
        st["steps"] += 1
        st["running"] += self._running
        st["prepare"] += enqueued - t0
        st["flush"] += flushed - enqueued
        st["finish"] += time.perf_counter() - flushed
        if not core.unfinished:  # no next step to hide them behind
            self._flush()

    def _flush(self) -> None:
        outputs, self._pending = self._pending, []
        for out in outputs:
            with self._lock:
                job = self._live.get(out.request_id)
            if job is not None:
                self._emit(job, out if out.error is None else self._error_of(out.error))

    def _error_of(self, error: BackendError) -> BackendError | EngineFailure:
        """A sequence's own failure as its stream raises it: the request's fault -> RequestRejected (4xx)."""
        if isinstance(error, SequenceFailed) and error.request_fault:
            return RequestRejected(str(error))
        return EngineFailure(f"generation failed: {error}")

    def _emit(self, job: _Job, item: RequestOutput | BaseException) -> None:
        """Hand `item` to the job's stream; a final one (a finished output or an error) retires the job."""
        if isinstance(item, BaseException) or item.finished:
            with self._lock:
                self._live.pop(job.request_id, None)
        job.stream._put(item)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            jobs = list(self._live.values())
        for job in jobs:
            self._emit(job, exc)
        while True:
            try:
                queued = self._jobs.get_nowait()
            except queue.Empty:
                return
            if queued is not None:
                queued.stream._put(exc)

    @staticmethod
    def _failed(request_id: str, exc: BaseException) -> EngineFailure:
        log.error("request %s failed", request_id, exc_info=exc)
        return EngineFailure(f"request {request_id} failed: {type(exc).__name__}: {exc}")


# what the serve stage imports from here (RequestOutput and GenerationResult are the engine's and the backend's)
__all__ = [
    "Capabilities",
    "EngineBusy",
    "EngineClient",
    "EngineFailure",
    "EngineUnavailable",
    "GenerationResult",
    "OutputStream",
    "RequestOutput",
    "RequestRejected",
]
