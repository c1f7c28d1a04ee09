"""Runtime stage: the engine process's loop: the backend and its EngineCore, driven by the server's messages.

runtime/process/client.py starts it through multiprocessing's spawn context (a fresh interpreter, so the server's
process never initialises CUDA). Between steps it reads requests and aborts from one pipe; each step's outputs go
back on the other as one message, sent while the next step's device work runs (as the engine thread streams them in
process). A fault of the engine as a whole is reported with the requests that were in the core; after
EngineStateLost, or when the core cannot be rebuilt, the process exits at once: nothing in it can be trusted, the
backend is not closed (a poisoned context may not even close), and the parent starts a fresh process.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable


from ..api import OpenedModel
from ..backend import BackendError, EngineStateLost
from ..client import capabilities_of
from ..engine.core import EngineCore, RequestOutput
from .malloc import Trimmer, limit_arenas

log = logging.getLogger("thorgen.engine")

EXIT_ENGINE_LOST = 3  # the exit status of an engine process that reported a fault it cannot recover from itself

# The messages, tuples led by a name. Server -> engine: ("add", request id) and then, in a frame of its own, the
# pickled (prompt ids int32, max_tokens, sampling, stop ids, speculative, image spans); ("abort", request id);
# ("close",). Engine -> server: ("ready", Capabilities,
# ModelFiles, the core's health), ("load_error", exception), ("rejected", request id, the request's fault?,
# message), ("step", outputs, step stats or None), ("fault", request ids, error type, message, exiting?).


@dataclass(frozen=True)
class EngineSettings:
    """What the engine process opens and how it schedules. `opener` runs there: picklable (a module-level
    function, or a functools.partial of one, e.g. of runtime.api.open_backend over an EngineConfig)."""

    opener: Callable[[], OpenedModel]
    backend_name: str
    kv_dtype: str
    max_num_seqs: int = 8
    kv_tokens: int | None = None
    max_step_tokens: int | None = None
    log_level: int = logging.WARNING
    switch_interval_s: float | None = None  # the GIL's, as the server set its own (None: Python's default)


def run_engine(inbox: Connection, outbox: Connection, settings: EngineSettings) -> None:
    """The engine process's main: open, report ready (or the load error), then serve until told to close or until
    the server's end of the pipe closes (the server died: no engine process outlives it)."""
    logging.basicConfig(level=settings.log_level, format="%(levelname)s:     %(name)s [engine process]: %(message)s")
    limit_arenas()  # before the backend starts its threads (runtime/process/malloc.py)
    if settings.switch_interval_s is not None:  # (the engine thread shares the GIL with the backend's own threads)
        sys.setswitchinterval(settings.switch_interval_s)
    try:
        opened = settings.opener()
        loop = _EngineLoop(opened, inbox, outbox, settings)
    except BaseException as exc:
        outbox.send(("load_error", _picklable(exc)))
        return
    caps = capabilities_of(opened.backend, settings.backend_name, settings.kv_dtype)
    outbox.send(("ready", caps, opened.files, loop.core.health()))
    try:
        loop.run()
    finally:
        try:
            opened.backend.close()
        except Exception:
            log.exception("closing the backend failed")


def _picklable(exc: BaseException) -> BaseException:
    """`exc` when it survives pickling, else a BackendError with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return BackendError(f"{type(exc).__name__}: {exc}")


class _EngineLoop:
    """The engine core over the opened backend, fed from `inbox`, reporting to `outbox`."""

    def __init__(self, opened: OpenedModel, inbox: Connection, outbox: Connection, settings: EngineSettings) -> None:
        self.backend, self.inbox, self.outbox, self.settings = opened.backend, inbox, outbox, settings
        self.core = self._new_core()
        self.live: set[str] = set()  # the requests in the core
        self.pending: list[RequestOutput] = []  # the last step's outputs, sent during the next step
        self.stats: tuple[Any, ...] | None = None  # the last step's (running, prepare s, flush s, finish s, health)
        self.trimmer = Trimmer()  # free malloc pages back to the kernel every so many finished requests

    def _new_core(self) -> EngineCore:
        s = self.settings
        return EngineCore(self.backend.runner(s.max_num_seqs, s.kv_tokens), s.max_step_tokens)

    def run(self) -> None:
        while True:
            try:
                if not self._receive(block=not self.core.unfinished):
                    return
                if self.core.unfinished:
                    self._step()
            except Exception as exc:
                if not self._fault(exc):
                    os._exit(EXIT_ENGINE_LOST)

    def _receive(self, block: bool) -> bool:
        """Take the messages waiting (the first one waited for when `block`); False on close or EOF."""
        while block or self.inbox.poll():
            block = False
            try:
                message = self.inbox.recv()
            except EOFError:
                return False
            if message[0] == "close":
                return False
            if message[0] == "abort":
                self.core.abort(message[1])
                continue
            try:
                body = self.inbox.recv_bytes()
            except EOFError:
                return False
            self._add(message[1], body)
        return True

    def _add(self, request_id: str, body: bytes) -> None:
        """Queue a request; `body`: its pickled (prompt ids, max_tokens, sampling, stop ids, speculative, image
        spans), unpickled here so that a value that cannot be rebuilt fails its request alone."""
        try:
            prompt, max_tokens, sampling, stop_ids, speculative, images = pickle.loads(body)
            self.core.add(request_id, prompt.tolist(), max_tokens, sampling, stop_ids, speculative, images)
        except EngineStateLost:  # (a driver failure is the engine's fault, whenever it happens)
            self.live.add(request_id)
            raise
        except BackendError as exc:
            self.outbox.send(("rejected", request_id, True, str(exc)))
        except Exception as exc:
            log.error("request %s failed", request_id, exc_info=exc)
            self.outbox.send(("rejected", request_id, False, f"{type(exc).__name__}: {exc}"))
        else:
            self.live.add(request_id)

    def _step(self) -> None:
        """One core step; the previous step's outputs go out once this one's device work is enqueued."""
        marks = [time.perf_counter()]

        def launched() -> None:
            marks.append(time.perf_counter())
            self._flush()
            marks.append(time.perf_counter())

        outputs = self.core.step(launched=launched)
        t0, enqueued, flushed = marks
        running = len(self.core.scheduler.running)
        self.stats = (running, enqueued - t0, flushed - enqueued, time.perf_counter() - flushed, self.core.health())
        self.pending = outputs
        finished = [out.request_id for out in outputs if out.finished]
        self.live.difference_update(finished)
        if not self.core.unfinished:  # no next step to hide them behind
            self._flush()
        if finished:
            self.trimmer.finished(len(finished))

    def _flush(self) -> None:
        if self.pending or self.stats is not None:
            message = ("step", self.pending, self.stats)
            self.pending, self.stats = [], None
            self.outbox.send(message)

    def _fault(self, exc: BaseException) -> bool:
        """A fault of the engine as a whole: report it with the requests in the core (the server fails or re-runs
        them); the core is rebuilt here unless the engine's state is lost. False: this process must end."""
        log.error("the engine failed during a step", exc_info=exc)
        self._flush()
        failed, self.live = sorted(self.live), set()
        rebuilt = False
        if not isinstance(exc, EngineStateLost):
            try:
                self.core = self._new_core()
                rebuilt = True
            except Exception:
                log.exception("rebuilding the engine core failed")
        self.outbox.send(("fault", failed, type(exc).__name__, str(exc), not rebuilt))
        return rebuilt
