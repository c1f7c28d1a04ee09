"""Serve stage: the Ray Serve application of `thorgen cluster`: engine replicas behind one OpenAI-compatible ingress.

Two deployments. `ThorgenEngine` runs one `EngineClient` per replica (one GPU each with the cuda backend) and
streams `RequestOutput`s. `ThorgenIngress` runs the same FastAPI app as `thorgen serve` (templating, parsing,
SSE, metrics) over a `RemoteEngineClient`, whose deployment handle routes every request with the prefix-affinity
router (`routing.py`). Ray Serve supplies the rest: replica placement, health checks (`check_health` asks the
engine's `health()`), restarts of dead replicas, and draining on shutdown.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ...runtime.api import EngineConfig
from ...runtime.backend import ImageSpan
from ...runtime.client import (
    EngineBusy,
    EngineFailure,
    EngineUnavailable,
    RequestRejected,
    SamplingParams,
)
from ...runtime.process.client import open_engine
from .remote import ClusterMetrics, Failed, RemoteEngineClient, ReplicaHeaderMiddleware, Routed
from .routing import PrefixAffinityRouter

APP, ENGINE, INGRESS = "thorgen", "ThorgenEngine", "ThorgenIngress"


class EngineReplica:
    """One engine: opened on its own engine thread when the replica starts, closed when Serve stops it."""

    def __init__(self, config: EngineConfig, max_queue: int = 1024) -> None:
        from ...runtime.text.prompts import load_chat_template

        self.client, model = open_engine(config, max_queue)
        source, bos = load_chat_template(model.model_dir, model.chat_template)
        # the ingress may run on a host without the checkpoint: it gets the text side from here
        self.text = {
            "tokenizer": Path(model.tokenizer_path).read_text(encoding="utf-8"),
            "template": source,
            "bos": bos,
            "generation_config": model.generation_config,
            "capabilities": self.client.capabilities,
        }
        self.replica = serve.get_replica_context().replica_id.unique_id

    def text_side(self) -> dict:
        return self.text

    async def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int],
        speculative: bool,
        images: tuple[ImageSpan, ...] = (),
    ):
        """Routed(replica), then the engine's RequestOutputs; an engine error ends the stream as Failed."""
        yield Routed(self.replica)
        try:
            stream = self.client.submit(prompt_ids, max_tokens, sampling, stop_ids, speculative, images=images)
        except (RequestRejected, EngineBusy, EngineUnavailable) as exc:
            yield Failed(type(exc).__name__, str(exc))
            return
        try:
            async for out in stream:
                yield out
        except (RequestRejected, EngineFailure, EngineBusy, EngineUnavailable) as exc:
            yield Failed(type(exc).__name__, str(exc))
        finally:  # the ingress cancelled the call (client gone, stop string): free the engine now
            if not stream.done:
                stream.abort()

    def stats(self) -> dict:
        return {
            **self.client.health(),
            "replica": self.replica,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id()[:12],
        }

    def check_health(self) -> None:
        health = self.client.health()
        if health["status"] != "ok":  # Serve replaces a replica whose check fails
            raise RuntimeError(f"engine {health['status']}: {health.get('error')}")

    def __del__(self) -> None:  # Serve calls it after draining; the engine closes on its own thread
        client = getattr(self, "client", None)
        if client is not None:
            client.close()


@serve.ingress()
class Ingress:
    """The OpenAI-compatible HTTP front: `create_app` over the remote engine."""

    async def __init__(
        self,
        engine: Any,
        model_id: str,
        speculative: bool | None,
        api_key: str | None,
        cors_origins: list[str],
        poll_s: float,
    ) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from ...runtime.text.tokenizer import Tokenizer
        from ..app import ServerState
        from ..chat_template import ChatTemplate

        text = await engine.text_side.remote()
        tokenizer = Tokenizer(HFTokenizer.from_str(text["tokenizer"]))
        template = ChatTemplate(text["template"], text["bos"])
        self.client = RemoteEngineClient(engine, text["capabilities"], poll_s)
        await self.client.refresh()
        self.state = ServerState(
            model_id, lambda: (self.client, tokenizer, template, text["generation_config"]), speculative
        )
        self.state.metrics = ClusterMetrics(self.client, model_id)
        self.state.load()
        if self.state.load_error:
            raise RuntimeError(self.state.load_error)
        self.api_key, self.cors_origins = api_key, cors_origins
        self._poller = asyncio.get_running_loop().create_task(self.client.poll_forever())

    def __serve_build_asgi_app__(self):
        from ..app import create_app

        app = create_app(self.state, api_key=self.api_key, cors_origins=self.cors_origins)
        app.add_middleware(ReplicaHeaderMiddleware)
        return app


def build_app(
    config: EngineConfig,
    replicas: int,
    *,
    model_id: str,
    speculative: bool | None = False,
    api_key: str | None = None,
    cors_origins: tuple[str, ...] = (),
    cpus_per_replica: float = 1.0,
    max_ongoing_requests: int = 16,
    drain_timeout_s: float = 30.0,
    health_period_s: float = 2.0,
    poll_s: float = 1.0,
    routing: dict | None = None,
    max_queue: int = 1024,
):
    """The Serve application: `serve.run(build_app(...), name=APP, route_prefix="/")`."""
    resources = {"num_cpus": cpus_per_replica}
    if config.backend == "cuda":
        resources["num_gpus"] = 1  # Ray sets CUDA_VISIBLE_DEVICES to that one GPU in the replica's process
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=replicas,
        ray_actor_options=resources,
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=health_period_s,
        health_check_timeout_s=max(10.0, 5 * health_period_s),
        graceful_shutdown_wait_loop_s=0.5,
        graceful_shutdown_timeout_s=drain_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs=dict(routing or {})
        ),
    )
    # the ingress only parses and relays: no CPU reserved, many requests at once
    ingress = serve.deployment(
        Ingress,
        name=INGRESS,
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=4096,
        graceful_shutdown_timeout_s=drain_timeout_s,
    )
    return ingress.bind(engine.bind(config, max_queue), model_id, speculative, api_key, list(cors_origins), poll_s)
