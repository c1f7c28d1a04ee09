"""Serve stage: the ingress's side of a Ray Serve engine deployment, shaped like `EngineClient` for `create_app`.

`RemoteEngineClient.submit` sends a request through the deployment handle (whose router picks the replica) and
returns a `RemoteStream` with `RequestStream`'s interface, so the unchanged FastAPI app serves the whole cluster.
A replica that dies turns into `EngineUnavailable` (503, retry); one that dies before producing any token is
retried once on another replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from ray.exceptions import RayActorError, RayTaskError, TaskCancelledError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from ...runtime.backend import ImageSpan
from ...runtime.client import (
    Capabilities,
    EngineBusy,
    EngineFailure,
    EngineUnavailable,
    GenerationResult,
    OutputStream,
    RequestOutput,
    RequestRejected,
    SamplingParams,
)
from . import routing
from ..metrics import Metrics

log = logging.getLogger("thorgen.cluster")
REPLICA_HEADER = "x-thorgen-replica"


@dataclass(frozen=True)
class Routed:
    """The first item of every replica stream: which replica serves the request."""

    replica: str


@dataclass(frozen=True)
class Failed:
    """An engine error, sent as a value so that its class survives the trip (4xx stays 4xx)."""

    kind: str
    message: str


ENGINE_ERRORS = {cls.__name__: cls for cls in (RequestRejected, EngineFailure, EngineBusy, EngineUnavailable)}

# Per HTTP request: a dict that learns {"replica": id} once the router has placed the request; the middleware
# reads it when the response starts (streams start after the first event, so the replica is known by then).
_REPLICA_SLOT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("thorgen_replica_slot", default=None)


class ReplicaHeaderMiddleware:
    """Adds `x-thorgen-replica` to generation responses, and `Retry-After` to 503s (a replica died or none is up)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        slot: dict = {}
        token = _REPLICA_SLOT.set(slot)

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                if "replica" in slot:
                    headers.append((REPLICA_HEADER.encode(), slot["replica"].encode()))
                if message["status"] == 503:
                    headers.append((b"retry-after", b"1"))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _REPLICA_SLOT.reset(token)


class RemoteStream(OutputStream):
    """One request's outputs from whichever replica serves it (an OutputStream, as EngineClient's are)."""

    def __init__(self, client: "RemoteEngineClient", request_id: str, args: tuple, slot: dict | None) -> None:
        super().__init__()
        self.client, self.request_id, self._args, self._slot = client, request_id, args, slot
        self.replica: str | None = None
        self._call: Any = None
        self._tokens: list[int] = []
        self._finished = self._aborted = False
        # a task of its own reads the replica's stream, so that `next(timeout)` timing out never cancels the call
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        for attempt in (1, 2):
            if self._aborted:
                return
            self._call = self.client.stream_handle.remote(*self._args)
            try:
                await self._read(self._call)
                return
            except (RayActorError, DeploymentUnavailableError) as exc:
                if self._aborted:
                    return
                if attempt == 1 and not self._tokens:  # nothing reached the client yet: another replica may serve it
                    log.warning(
                        "replica %s died before answering %s; retrying once: %s", self.replica, self.request_id, exc
                    )
                    continue
                err: BaseException = EngineUnavailable(
                    f"replica {self.replica} stopped during the request ({type(exc).__name__}); retry the request"
                )
            except TaskCancelledError:
                if self._aborted:
                    return
                err = EngineUnavailable("Ray Serve cancelled the request (shutting down?); retry the request")
            except asyncio.CancelledError:  # this task itself was cancelled (the loop is closing)
                if not self._aborted:
                    self._queue.put_nowait(EngineUnavailable("the ingress is shutting down; retry the request"))
                raise
            except BackPressureError as exc:
                err = EngineBusy(f"every replica is busy; retry later ({exc})")
            except RayTaskError as exc:
                err = EngineFailure(f"the replica failed: {exc}")
            except Exception as exc:  # anything else from Ray: still an error the client can see, never a hang
                log.exception("engine stream %s failed", self.request_id)
                err = EngineFailure(f"generation failed: {type(exc).__name__}: {exc}")
            self._queue.put_nowait(err)
            return

    async def _read(self, call: Any) -> None:
        async for item in call:
            if isinstance(item, Routed):
                self.replica = item.replica
                if self._slot is not None:
                    self._slot["replica"] = item.replica
                self.client.served[item.replica] += 1
            elif isinstance(item, Failed):
                self._queue.put_nowait(ENGINE_ERRORS.get(item.kind, EngineFailure)(item.message))
                return
            else:
                self._tokens += item.token_ids
                self._finished = item.finished
                self._queue.put_nowait(item)
                if item.finished:
                    return
        if not self._aborted:  # the replica ended the stream without a final output: it is shutting down
            self._queue.put_nowait(
                EngineUnavailable(f"replica {self.replica} ended the request early (shutting down); retry the request")
            )

    def abort(self) -> None:
        """Cancel the replica call (its engine request is aborted there); the stream ends "cancelled" here, as an
        `EngineClient` stream would."""
        if self._finished or self._aborted:
            return
        self._aborted = True
        if self._call is not None:
            self._call.cancel()
        result = GenerationResult(
            token_ids=list(self._tokens), finish_reason="cancelled", prompt_tokens=len(self._args[0])
        )
        self._queue.put_nowait(RequestOutput(self.request_id, finished=True, result=result))


class RemoteEngineClient:
    """`EngineClient`'s interface over every replica of the engine deployment; `health()` sums their engines'
    health as last polled (`poll_forever`, one `broadcast("stats")` a period)."""

    def __init__(self, handle: Any, capabilities: Capabilities, poll_s: float = 1.0) -> None:
        self.handle = handle
        self.stream_handle = handle.options(method_name="generate", stream=True)
        self.capabilities = capabilities
        self.poll_s = poll_s
        self.replicas: dict[str, dict] = {}  # replica id -> its last stats (engine health, pid, node)
        self.served: Counter = Counter()  # requests placed on each replica, by this ingress
        self.polled = False
        self._ids = itertools.count()
        self._closed = False

    async def refresh(self) -> None:
        try:
            results = await self.handle.broadcast("stats").results_async(
                timeout_s=max(2 * self.poll_s, 2.0), return_exceptions=True
            )
        except Exception as exc:  # no replica reachable right now: report none, ask again next period
            log.warning("polling the replicas failed: %s", exc)
            results = []
        self.replicas = {r["replica"]: r for r in results if isinstance(r, dict)}
        self.polled = True

    async def poll_forever(self) -> None:
        while not self._closed:
            await self.refresh()
            await asyncio.sleep(self.poll_s)

    @property
    def ready(self) -> bool:
        return not self._closed and (not self.polled or self.health()["status"] == "ok")

    def health(self) -> dict:
        if self._closed:
            return {"status": "error", "error": "the ingress was closed"}
        up = [r for r in self.replicas.values() if r.get("status") == "ok"]
        if not up:
            return {"status": "loading" if not self.polled else "error", "error": "no healthy engine replica"}
        return {
            "status": "ok",
            "running": sum(r.get("running", 0) for r in up),
            "queued": sum(r.get("queued", 0) for r in up),
            "replicas": len(up),
        }

    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        request_id: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> RemoteStream:
        if not self.ready:
            raise EngineUnavailable(self.health().get("error", "no engine replica is up"))
        request_id = request_id or f"req-{next(self._ids)}"
        args = (list(prompt_ids), int(max_tokens), sampling, frozenset(stop_ids), bool(speculative), tuple(images))
        return RemoteStream(self, request_id, args, _REPLICA_SLOT.get())

    def abort(self, request_id: str) -> bool:
        return False  # streams abort themselves (`RemoteStream.abort`): a replica cannot be addressed by id

    def close(self) -> None:
        self._closed = True


class _ReplicaCollector(Collector):
    """One series per replica (up, running, queued, requests placed) and the routing decisions, at each scrape."""

    def __init__(self, client: RemoteEngineClient) -> None:
        self.client = client

    def collect(self) -> Iterable[Metric]:
        up = GaugeMetricFamily(
            "thorgen_replica_up",
            "1 while the replica's engine reports ok (labels: pid, node).",
            labels=["replica", "pid", "node"],
        )
        running = GaugeMetricFamily(
            "thorgen_replica_requests_running", "Generations on the replica's engine now.", labels=["replica"]
        )
        queued = GaugeMetricFamily(
            "thorgen_replica_requests_queued", "Generations waiting for the replica's engine.", labels=["replica"]
        )
        for rid, stats in sorted(self.client.replicas.items()):
            up.add_metric([rid, str(stats.get("pid")), str(stats.get("node"))], int(stats.get("status") == "ok"))
            running.add_metric([rid], stats.get("running", 0))
            queued.add_metric([rid], stats.get("queued", 0))
        placed = CounterMetricFamily(
            "thorgen_replica_requests", "Requests this ingress placed on the replica.", labels=["replica"]
        )
        for rid, n in sorted(self.client.served.items()):
            placed.add_metric([rid], n)
        decisions = CounterMetricFamily(
            "thorgen_routing_decisions", "Routing decisions: prefix affinity or balance.", labels=["decision"]
        )
        for decision in ("affinity", "balance"):
            decisions.add_metric([decision], routing.DECISIONS[decision])
        yield from (up, running, queued, placed, decisions)


class ClusterMetrics(Metrics):
    """The ingress's request metrics (they cover every replica) plus one series per replica and the routing
    (the engine-step counters and KV blocks are each replica's own: not summed here)."""

    def __init__(self, client: RemoteEngineClient, model_name: str = "thorgen") -> None:
        super().__init__(model_name)
        self.client = client
        self.registry.register(_ReplicaCollector(client))

    def render(
        self,
        steps: dict | None = None,
        kv: dict | None = None,
        gpu_memory: int | None = None,
        caches: dict[str, int] | None = None,
    ) -> str:
        return super().render(None)  # (the replicas' own engine figures are per replica: _ReplicaCollector)
