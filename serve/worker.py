"""Serve stage: a request queue feeding one engine worker thread; cancellation reaches the engine between steps."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..runtime.backend import Backend, BackendError, GenerationResult, SamplingParams
from .metrics import Metrics
from .protocol import APIError

log = logging.getLogger("thorgen.serve")


@dataclass
class Job:
    """One generation. Events on `events`: ("tokens", StepOutput), ("done", GenerationResult), ("error", APIError)."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop_ids: frozenset[int]
    speculative: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.perf_counter)
    checked_at: float = 0.0  # event-loop time of the last client-connection check

    def emit(self, kind: str, payload: Any) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:  # the loop shut down while we were generating
            pass


class EngineWorker:
    """Runs jobs one at a time on a daemon thread. A failing job never kills the thread."""

    def __init__(self, backend: Backend, metrics: Metrics | None = None, max_queue: int = 1024) -> None:
        self.backend = backend
        self.metrics = metrics or Metrics()
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self.max_queue = max_queue
        self.current: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="thorgen-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        if self._queue.qsize() >= self.max_queue:
            raise APIError("the server is busy: too many queued requests, retry later", status=429,
                           type="server_busy")
        job.loop = job.loop or asyncio.get_running_loop()
        self.metrics.add(queued=1)
        self._queue.put(job)

    def close(self) -> None:
        self._queue.put(None)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.metrics.add(queued=-1)
            if job.cancel.is_set():  # the client left while queued
                job.emit("done", GenerationResult(finish_reason="cancelled", prompt_tokens=len(job.prompt_ids)))
                continue
            self.current = job
            self.metrics.add(running=1)
            try:
                self._run(job)
            except BackendError as exc:
                job.emit("error", APIError(str(exc)))
            except Exception as exc:  # an engine bug: report it to this client, keep serving the others
                log.exception("generation failed")
                job.emit("error", APIError(f"generation failed: {type(exc).__name__}: {exc}", status=500,
                                           type="server_error"))
            finally:
                self.metrics.add(running=-1)
                self.current = None

    def _run(self, job: Job) -> None:
        backend = self.backend
        stream = backend.generate_stream(job.prompt_ids, job.max_tokens, job.sampling, job.stop_ids,
                                         speculative=job.speculative, cancelled=job.cancel.is_set)
        n_out = 0
        first_at = None
        result = None
        broke_off = False
        try:
            while True:
                try:
                    step = next(stream)
                except StopIteration as stop:
                    result = stop.value if isinstance(stop.value, GenerationResult) else None
                    break
                if first_at is None:
                    first_at = time.perf_counter()
                    self.metrics.observe("ttft", first_at - job.arrived)
                n_out += len(step.token_ids)
                if job.speculative and step.accepted is not None:
                    self.metrics.observe("accepted_per_step", step.accepted + 1)
                job.emit("tokens", step)
                if job.cancel.is_set():
                    broke_off = True
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # runs the backend's cleanup (prefix-cache store) on this thread, now
        if result is None:
            last = getattr(backend, "last_result", None)
            result = last if isinstance(last, GenerationResult) else GenerationResult()
            if not result.prompt_tokens:
                result.prompt_tokens = len(job.prompt_ids)
        if broke_off:
            result.finish_reason = "cancelled"
        if first_at is not None and n_out > 1:
            elapsed = time.perf_counter() - first_at
            if elapsed > 0:
                self.metrics.observe("tokens_per_s", (n_out - 1) / elapsed)
        self.metrics.add(prompt_tokens=len(job.prompt_ids), cached_prompt_tokens=result.cached_prompt_tokens,
                         generation_tokens=n_out)
        job.emit("done", result)
