"""Serve stage: `thorgen cluster`: N engine replicas on Ray Serve behind one OpenAI-compatible ingress.

Two deployments. `ThorgenEngine` runs one `EngineClient` per replica (one GPU each with the cuda backend) and
streams `RequestOutput`s. `ThorgenIngress` runs the same FastAPI app as `thorgen serve` (templating, parsing,
SSE, metrics) over a `RemoteEngineClient`, whose deployment handle routes every request with the prefix-affinity
router (`routing.py`). Ray Serve supplies the rest: replica placement, health checks (`check_health` asks the
engine's `health()`), restarts of dead replicas, and draining on shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path
from typing import Any

import click
import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from ..runtime.api import (EngineBusy, EngineClient, EngineConfig, EngineFailure, EngineUnavailable,
                           RequestRejected, SamplingParams)
from .remote import ClusterMetrics, Failed, RemoteEngineClient, ReplicaHeaderMiddleware, Routed
from .routing import PrefixAffinityRouter

APP, ENGINE, INGRESS = "thorgen", "ThorgenEngine", "ThorgenIngress"


class EngineReplica:
    """One engine: opened on its own engine thread when the replica starts, closed when Serve stops it."""

    def __init__(self, config: EngineConfig, max_queue: int = 1024) -> None:
        from .chat_template import load_chat_template

        self.client, model = EngineClient.open(config, max_queue)
        source, bos = load_chat_template(model.model_dir, model.chat_template)
        # the ingress may run on a host without the checkpoint: it gets the text side from here
        self.text = {"tokenizer": Path(model.tokenizer_path).read_text(encoding="utf-8"), "template": source,
                     "bos": bos, "generation_config": model.generation_config,
                     "capabilities": self.client.capabilities}
        self.replica = serve.get_replica_context().replica_id.unique_id

    def text_side(self) -> dict:
        return self.text

    async def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                       stop_ids: frozenset[int], speculative: bool):
        """Routed(replica), then the engine's RequestOutputs; an engine error ends the stream as Failed."""
        yield Routed(self.replica)
        try:
            stream = self.client.submit(prompt_ids, max_tokens, sampling, stop_ids, speculative)
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
        return {**self.client.health(), "replica": self.replica, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()[:12]}

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

    async def __init__(self, engine: Any, model_id: str, speculative: bool | None, api_key: str | None,
                       cors_origins: list[str], poll_s: float) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        from ..runtime.tokenizer import Tokenizer
        from .app import ServerState
        from .chat_template import ChatTemplate

        text = await engine.text_side.remote()
        tokenizer = Tokenizer(HFTokenizer.from_str(text["tokenizer"]))
        template = ChatTemplate(text["template"], text["bos"])
        self.client = RemoteEngineClient(engine, text["capabilities"], poll_s)
        await self.client.refresh()
        self.state = ServerState(model_id, lambda: (self.client, tokenizer, template, text["generation_config"]),
                                 speculative)
        self.state.metrics = ClusterMetrics(self.client)
        self.state.load()
        if self.state.load_error:
            raise RuntimeError(self.state.load_error)
        self.api_key, self.cors_origins = api_key, cors_origins
        self._poller = asyncio.get_running_loop().create_task(self.client.poll_forever())

    def __serve_build_asgi_app__(self):
        from .app import create_app

        app = create_app(self.state, api_key=self.api_key, cors_origins=self.cors_origins)
        app.add_middleware(ReplicaHeaderMiddleware)
        return app


def build_app(config: EngineConfig, replicas: int, *, model_id: str, speculative: bool | None = False,
              api_key: str | None = None, cors_origins: tuple[str, ...] = (), cpus_per_replica: float = 1.0,
              max_ongoing_requests: int = 16, drain_timeout_s: float = 30.0, health_period_s: float = 2.0,
              poll_s: float = 1.0, routing: dict | None = None, max_queue: int = 1024):
    """The Serve application: `serve.run(build_app(...), name=APP, route_prefix="/")`."""
    resources = {"num_cpus": cpus_per_replica}
    if config.backend == "cuda":
        resources["num_gpus"] = 1  # Ray sets CUDA_VISIBLE_DEVICES to that one GPU in the replica's process
    engine = serve.deployment(
        EngineReplica, name=ENGINE, num_replicas=replicas, ray_actor_options=resources,
        max_ongoing_requests=max_ongoing_requests, health_check_period_s=health_period_s,
        health_check_timeout_s=max(10.0, 5 * health_period_s),
        graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=drain_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                  request_router_kwargs=dict(routing or {})))
    # the ingress only parses and relays: no CPU reserved, many requests at once
    ingress = serve.deployment(Ingress, name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=4096, graceful_shutdown_timeout_s=drain_timeout_s)
    return ingress.bind(engine.bind(config, max_queue), model_id, speculative, api_key, list(cors_origins), poll_s)


@click.command(help="Serve N engine replicas (one GPU each, or CPU-only with --backend reference) on Ray Serve "
                    "behind one OpenAI-compatible endpoint, routing each conversation to the replica that holds "
                    "its prefix cache. Starts a local Ray instance unless --ray-address names one to join.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Checkpoint folder, at the same path on every host (default: the tiny random demo model).")
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--backend", type=click.Choice(["reference", "cuda"]), default="reference", show_default=True)
@click.option("--replicas", type=click.IntRange(1), default=None,
              help="Engine replicas (default: every GPU of the Ray cluster with cuda, 1 with reference).")
@click.option("--ray-address", default=None, help="Join this Ray cluster ('auto': the one `ray start` began).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--ctx", type=click.IntRange(2), default=None)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option("--draft-tokens", type=click.IntRange(0), default=None,
              help="0 turns speculative decoding off (default: as `thorgen serve`).")
@click.option("--api-key", default=None, envvar="THORGEN_API_KEY")
@click.option("--cors-origin", "cors_origins", multiple=True)
@click.option("--model-name", default=None)
@click.option("--weights", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--kernel-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--cpus-per-replica", type=click.FloatRange(0), default=1.0, show_default=True)
@click.option("--max-ongoing", type=click.IntRange(1), default=16, show_default=True,
              help="Requests Serve sends one replica at once (the engine queues them).")
@click.option("--block-tokens", type=click.IntRange(1), default=16, show_default=True,
              help="Prefix-affinity block size in tokens.")
@click.option("--max-imbalance", type=click.IntRange(0), default=2, show_default=True,
              help="Keep affinity while the replica's queue is at most this much above the least-loaded one.")
@click.option("--drain-timeout", type=click.FloatRange(0), default=30.0, show_default=True,
              help="Seconds in-flight requests may take to finish on shutdown.")
def cluster(model_dir: Path | None, draft_dir: Path | None, backend: str, replicas: int | None,
            ray_address: str | None, host: str, port: int, ctx: int | None, kv_dtype: str,
            draft_tokens: int | None, api_key: str | None, cors_origins: tuple[str, ...], model_name: str | None,
            weights: Path | None, kernel_dir: Path | None, cpus_per_replica: float, max_ongoing: int,
            block_tokens: int, max_imbalance: int, drain_timeout: float) -> None:
    from .demo import DEMO_MODEL_ID, ensure_demo_checkpoint

    if model_dir is not None and not (model_dir / "config.json").exists():
        raise click.ClickException(f"{model_dir}: no config.json, not a checkpoint folder")
    if backend == "reference" and kv_dtype != "bf16":
        raise click.ClickException("the reference backend keeps K/V in float32; --kv-dtype fp8 needs --backend cuda")
    demo = model_dir is None
    folder = ensure_demo_checkpoint() if demo else model_dir.resolve()
    config = EngineConfig(folder, backend, ctx if ctx or not demo else 2048, kv_dtype,
                          draft_dir.resolve() if draft_dir else None, weights, kernel_dir)
    off = draft_tokens == 0 or (draft_tokens is None and (demo or backend == "cuda"))  # as `thorgen serve`
    ray.init(address=ray_address, include_dashboard=False if ray_address is None else None)
    if replicas is None:
        replicas = int(ray.cluster_resources().get("GPU", 0)) if backend == "cuda" else 1
        if replicas == 0:
            raise click.ClickException("the Ray cluster has no GPU: give --replicas, or use --backend reference")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(config, replicas, model_id=model_name or (DEMO_MODEL_ID if demo else folder.name),
                            speculative=False if off else None, api_key=api_key, cors_origins=cors_origins,
                            cpus_per_replica=cpus_per_replica, max_ongoing_requests=max_ongoing,
                            drain_timeout_s=drain_timeout,
                            routing={"block_tokens": block_tokens, "max_imbalance": max_imbalance}),
                  name=APP, route_prefix="/", blocking=False)
        click.echo(f"thorgen: {replicas} {backend} replicas on Ray Serve; OpenAI API at http://{host}:{port}/v1")
        while not stop.wait(1.0):  # a timed wait: the signal handler runs between waits
            pass
        click.echo("thorgen: draining (in-flight requests finish, new ones are refused)")
    except RuntimeError as exc:  # a replica failed to start (bad checkpoint, no kernels, ...)
        raise click.ClickException(str(exc)) from exc
    finally:
        serve.delete(APP)  # waits for the replicas' graceful shutdown (at most --drain-timeout)
        if ray_address is None:
            serve.shutdown()
        ray.shutdown()
