"""Serve stage: `thorgen serve` (the OpenAI-compatible server) and `thorgen chat` (the terminal client)."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import click

from ..runtime.api import engine_option_flags
from .demo import DEMO_CTX

SWITCH_INTERVAL_S = 2e-4  # the GIL switch interval while serving (see serve())


class NamesOption(click.Option):
    """A repeatable option that also takes several values after one flag, as vLLM's `--served-model-name A B`:
    the words up to the next option join the first (click has no nargs='+' for options)."""

    def add_to_parser(self, parser, ctx) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = getattr(parser, "_long_opt", {}).get(name)
            if option is None:  # (a click without this parser: one value per flag, repeatable)
                continue

            def process(value, state, one=option.process) -> None:
                one(value, state)
                while state.rargs and not state.rargs[0].startswith("-"):
                    one(state.rargs.pop(0), state)

            option.process = process


def open_model(config):
    """-> (engine client, tokenizer, chat template, generation_config); the backend opens on the engine thread, or
    in the engine process (config.engine_process)."""
    from ..runtime.process.client import open_engine
    from ..runtime.text.prompts import load_chat_template
    from .chat_template import ChatTemplate, load_tokenizer

    client, model = open_engine(config)
    try:
        source, bos = load_chat_template(model.model_dir, model.chat_template)
        return client, load_tokenizer(model.tokenizer_path), ChatTemplate(source, bos), model.generation_config
    except BaseException:
        client.close()
        raise


@click.command(
    help="Serve a checkpoint over an OpenAI-compatible HTTP API, with a web UI at /. Without --model, "
    "serves a tiny random-weight demo model (not Gemma) so that everything can be tried anywhere."
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint folder (config.json, safetensors, tokenizer.json, chat_template.jinja).",
)
@click.option(
    "--draft",
    "draft_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="DFlash drafter folder (default: MODEL/dflash when present).",
)
@click.option("--backend", type=click.Choice(["reference", "cuda"]), default="reference", show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--ctx",
    type=click.IntRange(2),
    default=None,
    help="Context length in tokens (default: min(the model's max_position_embeddings, 65536); the demo: "
    f"{DEMO_CTX}, all its checkpoint allows).",
)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--draft-tokens",
    type=click.IntRange(0, 15),
    default=None,
    help="Speculative (DFlash) drafts per step, at most: 1..15; 0 turns speculative decoding off "
    "(default: on with a drafter, 15; a request may ask for fewer with num_speculative_tokens).",
)
@click.option(
    "--emulate-acceptance",
    type=click.IntRange(0, 15),
    default=None,
    help="Synthetic checkpoints: every speculative step commits K drafts + 1, whatever the drafts were (the speed "
    "at that acceptance; the tokens are not the model's). /health and `thorgen bench serve` report it as emulated.",
)
@click.option(
    "--api-key",
    default=None,
    envvar="THORGEN_API_KEY",
    help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1.",
)
@click.option("--cors-origin", "cors_origins", multiple=True, help="Allowed CORS origin (repeat; '*' for any).")
@click.option(
    "--served-model-name",
    "--model-name",
    "model_names",
    cls=NamesOption,
    multiple=True,
    metavar="NAME [NAME ...]",
    help="The names the server answers to: requests naming another `model` get "
    "a 404; /v1/models lists them, answers carry the first (default: the folder name, and `thorgen`, the "
    "name the README's examples send).",
)
@click.option(
    "--weights",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="cuda: repacked weights folder (default: the one `thorgen repack-weights` wrote for MODEL).",
)
@click.option(
    "--kernel-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="cuda: built kernels folder (default: $THORGEN_KERNELS or ./thorgen-build/<model>/<arch>).",
)
@click.option(
    "--max-num-seqs",
    type=click.IntRange(1, 256),
    default=8,
    show_default=True,
    help="Requests decoded together (continuous batching; the cuda backend holds up to 32).",
)
@click.option(
    "--kv-cache-gib",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="cuda: GiB of KV cache: a sliding-window ring per sequence (--max-num-seqs of them, fewer if one "
    "--ctx-token sequence would not fit beside them), the rest pages of the full-attention layers "
    "shared by all sequences; default: 90% of what is free beside the weights.",
)
@click.option(
    "--max-num-batched-tokens",
    "max_step_tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens one step schedules: prompt chunks plus every running sequence's decode rows (default: "
    "one whole prefill chunk, 2,048 rows on the cuda backend, beside every sequence's decode). Lower "
    "it to shorten other streams' token gaps while prompts prefill, at the price of TTFT (or see "
    "--prefill-pieces).",
)
@click.option(
    "--max-body-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=8,
    show_default=True,
    help="Largest request body accepted; bigger ones get a 413.",
)
@click.option(
    "--image-max-tokens",
    type=click.Choice(["70", "140", "280", "560", "1120"]),
    default="280",
    show_default=True,
    help="Soft tokens an image may take (a request may ask for another budget with "
    "mm_processor_kwargs.max_soft_tokens).",
)
@click.option(
    "--limit-images-per-prompt",
    type=click.IntRange(0),
    default=16,
    show_default=True,
    help="Images one prompt may hold; more get a 400.",
)
@click.option(
    "--allowed-media-domains",
    multiple=True,
    help="Hosts whose http(s) image and video URLs are fetched (repeat, or comma-separate; 5 s timeout, no "
    "redirects); without it only inline data: URLs are taken.",
)
@click.option(
    "--engine-process/--no-engine-process",
    default=None,
    help="Run the engine in a child process, which the server replaces after a fault on the device (a CUDA "
    "error no context reset clears): the requests it was running fail, the others wait, /health says "
    "'recovering' meanwhile [default: on with --backend cuda].",
)
@click.option(
    "--limit-videos-per-prompt",
    type=click.IntRange(0),
    default=1,
    show_default=True,
    help="Videos one prompt may hold (each up to 32 frames of 70 soft tokens); more get a 400.",
)
@click.option(
    "--video-max-seconds",
    type=click.FloatRange(0, min_open=True),
    default=600,
    show_default=True,
    help="Longest video accepted, by its stream's duration; a longer one gets a 400 before its frames are decoded.",
)
@click.option(
    "--video-max-mb",
    type=click.FloatRange(0, min_open=True),
    default=32,
    show_default=True,
    help="Largest video file accepted (a data URL's decoded payload or a fetched file); a data URL also needs "
    "--max-body-mb room.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(0),
    default=10,
    show_default=True,
    help="Seconds a shutdown (Ctrl-C, SIGTERM) waits for running requests; then each still running ends "
    "with an error (a stream: an error event, then data: [DONE]).",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
    help="Server log level; 'debug' also prints tracebacks of load errors.",
)
@engine_option_flags
def serve(
    model_dir: Path | None,
    draft_dir: Path | None,
    backend: str,
    host: str,
    port: int,
    ctx: int | None,
    kv_dtype: str,
    draft_tokens: int | None,
    emulate_acceptance: int | None,
    api_key: str | None,
    cors_origins: tuple[str, ...],
    model_names: tuple[str, ...],
    weights: Path | None,
    kernel_dir: Path | None,
    max_num_seqs: int,
    kv_cache_gib: float | None,
    max_step_tokens: int | None,
    max_body_mb: float,
    image_max_tokens: str,
    limit_images_per_prompt: int,
    allowed_media_domains: tuple[str, ...],
    engine_process: bool | None,
    limit_videos_per_prompt: int,
    video_max_seconds: float,
    video_max_mb: float,
    shutdown_timeout: float,
    log_level: str,
    engine_options,
) -> None:
    import uvicorn

    from ..runtime.api import DraftOptions, EngineConfig
    from ..runtime.process.malloc import limit_arenas
    from .app import GracefulServer, ServerState, create_app
    from .demo import DEMO_MODEL_ID, ensure_demo_checkpoint
    from .media import MediaOptions

    if model_dir is not None and not (model_dir / "config.json").exists():
        raise click.ClickException(f"{model_dir}: no config.json, not a checkpoint folder")
    # before the loader, the engine and the worker threads start: each thread would otherwise keep an arena of
    # its own, whose free pages stay resident (runtime/process/malloc.py: what `bench soak` measured)
    limit_arenas()
    demo = model_dir is None
    if backend == "reference" and kv_dtype != "bf16":
        raise click.ClickException("the reference backend keeps K/V in float32; --kv-dtype fp8 needs --backend cuda")
    names = model_names or (DEMO_MODEL_ID if demo else model_dir.name, "thorgen")
    name = names[0]

    def loader():
        folder = ensure_demo_checkpoint() if demo else model_dir
        return open_model(
            EngineConfig(
                folder,
                backend,
                ctx if ctx or not demo else DEMO_CTX,
                kv_dtype,
                draft_dir,
                weights,
                kernel_dir,
                max_num_seqs=max_num_seqs,
                kv_cache_gib=kv_cache_gib,
                max_step_tokens=max_step_tokens,
                options=engine_options,
                drafts=DraftOptions(emulate_acceptance=emulate_acceptance),
                engine_process=backend == "cuda" if engine_process is None else engine_process,
            )
        )

    # None: speculative exactly when the checkpoint has a drafter (decided once loaded). The demo's random
    # drafter never agrees with its random target, so there it only costs time unless asked for.
    off = draft_tokens == 0 or (draft_tokens is None and demo and emulate_acceptance is None)
    if emulate_acceptance is not None and draft_tokens == 0:
        raise click.ClickException("--emulate-acceptance needs speculative decoding (not --draft-tokens 0)")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    domains = tuple(d.strip().lower() for entry in allowed_media_domains for d in entry.split(",") if d.strip())
    media = MediaOptions(
        int(image_max_tokens),
        limit_images_per_prompt,
        domains,
        max_videos=limit_videos_per_prompt,
        max_video_seconds=video_max_seconds,
        max_video_bytes=int(video_max_mb * (1 << 20)),
    )
    state = ServerState(
        name,
        loader,
        speculative=False if off else None,
        draft_tokens=draft_tokens or None,
        model_names=names,
        media=media,
    )
    app = create_app(
        state, api_key=api_key, cors_origins=list(cors_origins), max_body_bytes=int(max_body_mb * (1 << 20))
    )
    # The engine thread and the event loop share the GIL; when the loop is busy streaming, the engine thread waits
    # up to one switch interval (5 ms by default) each time it takes the GIL back after a CUDA call. Measured on
    # the H200 (full-size checkpoint, `thorgen bench serve`, 512-token prompts): 0.2 ms raises 1,130 -> 1,202 tok/s
    # at 8 streams and 1,328 -> 1,393 at 32, the engine's host time a step at 32 streams 3.5 -> 2.6 ms.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # at the --shutdown-timeout deadline, running streams end with an error event and [DONE]
    server = GracefulServer(uvicorn.Config(app, host=host, port=port, log_level=log_level), state, shutdown_timeout)
    loading = state.load_in_background()

    def stop_if_load_fails() -> None:  # /health answers 503 while loading; a failed load ends the process
        loading.join()
        if state.load_error:
            server.should_exit = True

    threading.Thread(target=stop_if_load_fails, daemon=True).start()
    demo_note = f"  [demo model: random weights, output is gibberish; context {ctx or DEMO_CTX} tokens]"
    click.echo(
        f"thorgen: serving {', '.join(map(repr, names))} on http://{host}:{port}/ (web UI), OpenAI API at "
        f"http://{host}:{port}/v1" + (demo_note if demo else "")
    )
    try:
        server.run()
    finally:
        state.close()  # cancels what still runs and closes the engine on its own thread
    if state.load_error:
        raise click.ClickException(f"the model failed to load: {state.load_error}")
