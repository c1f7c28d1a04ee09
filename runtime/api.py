"""Runtime stage: opening engines: what to open (`EngineConfig`), the one backend registry (`open_backend`) that
`generate`, `bench` and `serve` all open engines through, and the engine option flags of their commands.

runtime/client.py's `EngineClient` opens a backend through it on the thread that then drives the device. Importing
this module loads no backend: each opener imports its own when it runs (tests/test_layering.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .backend import BackendError
from .engine.interface import Backend
from .options import DraftOptions, EngineOptions, default_ctx

if TYPE_CHECKING:
    from ..model_spec.checkpoint import Checkpoint


@dataclass(frozen=True)
class EngineConfig:
    """What to open. `ctx` None: min(the model's max_position_embeddings, DEFAULT_CTX) (runtime/options.py)."""

    model: Path
    backend: str = "reference"
    ctx: int | None = None
    kv_dtype: str = "bf16"
    draft: Path | None = None
    weights: Path | None = None  # cuda: repacked weights folder (default: found from the model)
    kernels: Path | None = None  # cuda: built kernels folder (default: $THORGEN_KERNELS, ./thorgen-build/...)
    prefix_cache: bool = True  # reference: finished sequences serve prefix-cache hits (bench: off, so TTFT never hits)
    max_num_seqs: int = 8  # sequences decoded together (cuda: KV lanes, at most forward.MAX_BATCH)
    kv_cache_gib: float | None = None  # cuda: the KV cache's size (default: what fits beside the weights)
    max_step_tokens: int | None = None  # a step's token budget (default: engine_core.default_step_tokens)
    options: EngineOptions = EngineOptions()  # cuda: how the engine launches its work (EngineOptions' defaults)
    drafts: DraftOptions = DraftOptions()  # the draft policy of every engine core over it (adaptive by default)
    sms: int | None = None  # cuda: run on this many multiprocessors (a green context; None: the whole GPU)
    # the server's engine runs in a child process (runtime/process), so that a device fault, which no context
    # reset clears, is recovered from by starting a fresh process; False: on a thread of the calling process
    engine_process: bool = False


@dataclass(frozen=True)
class ModelFiles:
    """What the text side reads from the checkpoint an engine opened: tokenizer, chat template, defaults."""

    tokenizer_path: Path
    chat_template: str | None
    generation_config: dict[str, Any]
    model_dir: Path


@dataclass(frozen=True)
class OpenedModel:
    """A backend plus what the text side needs from the same checkpoint (tokenizer, template, defaults)."""

    backend: Backend
    tokenizer_path: Path
    chat_template: str | None
    generation_config: dict[str, Any]
    model_dir: Path

    @property
    def files(self) -> ModelFiles:
        return ModelFiles(self.tokenizer_path, self.chat_template, self.generation_config, self.model_dir)


def _open_reference(config: EngineConfig, ckpt: Checkpoint) -> Backend:
    if config.kv_dtype != "bf16":
        raise BackendError("--kv-dtype fp8 needs --backend cuda (the reference backend keeps K/V in float32)")
    from .reference.backend import ReferenceBackend

    ctx = default_ctx(ckpt.spec.target.max_position_embeddings, config.ctx)
    return ReferenceBackend(ckpt, max_context=ctx, prefix_cache=config.prefix_cache)


def _open_cuda(config: EngineConfig, ckpt: Checkpoint) -> Backend:
    from .cuda.backend import open_backend as open_cuda

    return open_cuda(
        ckpt.model_dir,
        ctx=config.ctx,
        kv_dtype=config.kv_dtype,
        draft_dir=ckpt.draft_dir,
        weights_dir=config.weights,
        kernels_dir=config.kernels,
        max_num_seqs=config.max_num_seqs,
        kv_cache_gib=config.kv_cache_gib,
        options=config.options,
        sms=config.sms,
    )


BACKENDS: dict[str, Callable[[EngineConfig, Checkpoint], Backend]] = {"reference": _open_reference, "cuda": _open_cuda}


def engine_option_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a click command one `--X/--no-X` switch per EngineOptions field (--no-pdl, --no-fork,
    --no-launch-ahead, --no-rowwise-splits, --prefill-pieces); the command receives them as one `engine_options`
    value."""
    import functools

    import click

    names = [name for name, _, _, _ in EngineOptions.flags()]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["engine_options"] = EngineOptions(**{n: kwargs.pop(n) for n in names})
        return command(*args, **kwargs)

    for name, flag, help, default in reversed(EngineOptions.flags()):
        run = click.option(f"--{flag}/--no-{flag}", name, default=default, show_default=True, help=help)(run)
    return run


def open_backend(config: EngineConfig) -> OpenedModel:
    """Open the checkpoint and the named backend on the calling thread; BackendError says what is wrong."""
    from ..model_spec.checkpoint import Checkpoint, CheckpointError

    opener = BACKENDS.get(config.backend)
    if opener is None:
        raise BackendError(f"unknown backend {config.backend!r}: choose one of {', '.join(sorted(BACKENDS))}")
    try:
        ckpt = Checkpoint.open(config.model, config.draft)
    except CheckpointError as exc:
        raise BackendError(str(exc)) from exc
    backend = opener(config, ckpt)
    backend.draft_options = config.drafts
    if config.drafts.emulate_acceptance is not None:
        backend.emulate_acceptance(config.drafts.emulate_acceptance)
    return OpenedModel(
        backend,
        Path(ckpt.tokenizer_path),
        ckpt.chat_template,
        dict(ckpt.generation_config or {}),
        Path(ckpt.model_dir),
    )
