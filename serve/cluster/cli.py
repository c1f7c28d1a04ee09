"""Serve stage: `thorgen cluster`, the command line of the Ray Serve deployment (Ray is imported only when it runs,
so that `thorgen --help` stays fast)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import click

from ...runtime.api import engine_option_flags


@click.command(
    help="Serve N engine replicas (one GPU each, or CPU-only with --backend reference) on Ray Serve "
    "behind one OpenAI-compatible endpoint, routing each conversation to the replica that holds "
    "its prefix cache. Starts a local Ray instance unless --ray-address names one to join."
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint folder, at the same path on every host (default: the tiny random demo model).",
)
@click.option("--draft", "draft_dir", type=click.Path(file_okay=False, path_type=Path), default=None)
@click.option("--backend", type=click.Choice(["reference", "cuda"]), default="reference", show_default=True)
@click.option(
    "--replicas",
    type=click.IntRange(1),
    default=None,
    help="Engine replicas (default: every GPU of the Ray cluster with cuda, 1 with reference).",
)
@click.option("--ray-address", default=None, help="Join this Ray cluster ('auto': the one `ray start` began).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option("--ctx", type=click.IntRange(2), default=None)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--draft-tokens",
    type=click.IntRange(0),
    default=None,
    help="0 turns speculative decoding off (default: as `thorgen serve`).",
)
@click.option("--api-key", default=None, envvar="THORGEN_API_KEY")
@click.option("--cors-origin", "cors_origins", multiple=True)
@click.option("--model-name", default=None)
@click.option("--weights", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--kernel-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--cpus-per-replica", type=click.FloatRange(0), default=1.0, show_default=True)
@click.option(
    "--max-ongoing",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Requests Serve sends one replica at once (the engine queues them).",
)
@click.option(
    "--block-tokens",
    type=click.IntRange(1),
    default=16,
    show_default=True,
    help="Prefix-affinity block size in tokens.",
)
@click.option(
    "--max-imbalance",
    type=click.IntRange(0),
    default=2,
    show_default=True,
    help="Keep affinity while the replica's queue is at most this much above the least-loaded one.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(0),
    default=30.0,
    show_default=True,
    help="Seconds in-flight requests may take to finish on shutdown.",
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="Requests each replica's engine decodes together (as `thorgen serve`).",
)
@engine_option_flags
def cluster(
    model_dir: Path | None,
    draft_dir: Path | None,
    backend: str,
    replicas: int | None,
    ray_address: str | None,
    host: str,
    port: int,
    ctx: int | None,
    kv_dtype: str,
    draft_tokens: int | None,
    api_key: str | None,
    cors_origins: tuple[str, ...],
    model_name: str | None,
    weights: Path | None,
    kernel_dir: Path | None,
    cpus_per_replica: float,
    max_ongoing: int,
    block_tokens: int,
    max_imbalance: int,
    drain_timeout: float,
    max_num_seqs: int,
    engine_options,
) -> None:
    import ray
    from ray import serve

    from ...runtime.api import EngineConfig
    from .deployment import APP, build_app
    from ..demo import DEMO_CTX, DEMO_MODEL_ID, ensure_demo_checkpoint

    if model_dir is not None and not (model_dir / "config.json").exists():
        raise click.ClickException(f"{model_dir}: no config.json, not a checkpoint folder")
    if backend == "reference" and kv_dtype != "bf16":
        raise click.ClickException("the reference backend keeps K/V in float32; --kv-dtype fp8 needs --backend cuda")
    demo = model_dir is None
    folder = ensure_demo_checkpoint() if demo else model_dir.resolve()
    config = EngineConfig(
        folder,
        backend,
        ctx if ctx or not demo else DEMO_CTX,
        kv_dtype,
        draft_dir.resolve() if draft_dir else None,
        weights,
        kernel_dir,
        max_num_seqs=max_num_seqs,
        options=engine_options,
    )
    off = draft_tokens == 0 or (draft_tokens is None and demo)  # as `thorgen serve` (any N > 0: the full block)
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
        serve.run(
            build_app(
                config,
                replicas,
                model_id=model_name or (DEMO_MODEL_ID if demo else folder.name),
                speculative=False if off else None,
                api_key=api_key,
                cors_origins=cors_origins,
                cpus_per_replica=cpus_per_replica,
                max_ongoing_requests=max_ongoing,
                drain_timeout_s=drain_timeout,
                routing={"block_tokens": block_tokens, "max_imbalance": max_imbalance},
            ),
            name=APP,
            route_prefix="/",
            blocking=False,
        )
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
