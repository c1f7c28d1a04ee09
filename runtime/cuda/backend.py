"""Runtime stage: `CudaBackend`, the compiled engine behind the Backend protocol (what `--backend cuda` opens).

Status (honest): chunked prefill and greedy / seeded-sampling decode (one captured CUDA graph per mode) are wired
against codegen's kernel plan (tests/test_runtime_cpu.py checks every launch binds); the engine refuses to start,
naming them, when built kernels are missing. `CudaRunner` (runtime/cuda/runner.py) is the engine core's ModelRunner
(runtime/engine/core.py holds the one stop / length / cancel loop); speculative (DFlash) steps run when the model
has a drafter and its kernels are built (else the request is refused, naming what is missing); their output equals
plain decoding token for token (tests/test_engine_speculative_emulated.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import time
from pathlib import Path

from ...model_spec.config import spec_from_configs
from ...model_spec.formats import HF_QUANT_CONFIG, with_checkpoint_formats
from ...model_spec.types import ALL_NVFP4
from ...model_spec.conventions import MAX_BATCH, VERIFY_ROWS
from ..backend import (
    BackendError,
    BackendFeatures,
)
from .device import Device, check, driver, gib
from .buffers import plan_activations
from .engine import Engine
from .profile import distinct_tokens
from .runner import CudaRunner
from .step_graphs import capture_step_graphs
from .vision import plan_vision
from .kv_cache import fit_kv, plan_kv
from .memory import alloc, check_fits, upload_artifact
from ..manifest import find_kernels
from ..options import EngineOptions, default_ctx
from ..convert.layouts import layout_version
from ..engine.single import EngineBackend
from ..convert.artifact import WEIGHTS_JSON, WeightsArtifact, default_artifact_dirs, find_artifact

log = logging.getLogger("thorgen.engine")


def _spec(model_dir: Path, draft_dir: Path | None):
    """The ModelSpec from the configs alone (cheap; the repacked artifact carries the weights), with the linear
    formats the checkpoint's quantization config declares."""

    def read(p: Path) -> dict:
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BackendError(f"{p}: cannot read the model config ({exc})") from exc

    draft_dir = draft_dir or (model_dir / "dflash" if (model_dir / "dflash" / "config.json").is_file() else None)
    config = read(model_dir / "config.json")
    quant = read(model_dir / HF_QUANT_CONFIG) if (model_dir / HF_QUANT_CONFIG).is_file() else None
    try:
        spec = spec_from_configs(config, read(draft_dir / "config.json") if draft_dir else None, name=model_dir.name)
        return with_checkpoint_formats(spec, config, quant)
    except ValueError as exc:  # SpecError: a config thorgen cannot run
        raise BackendError(f"{model_dir}: {exc}") from exc


def _served_spec(spec, model_dir: Path, weights_dir: Path | None):
    """The spec the repacked weights serve: the checkpoint's linear formats, or all NVFP4 where `repack-weights
    --quantize nvfp4` rewrote its bf16 linears (the artifact header's linear_formats; the kernels must match)."""
    if spec.linear_formats == ALL_NVFP4:
        return spec
    quantized = dataclasses.replace(spec, linear_formats=ALL_NVFP4)
    dirs = (
        [weights_dir]
        if weights_dir
        else [d for s in (spec, quantized) for d in default_artifact_dirs(model_dir, s.spec_hash)]
    )
    for d in dirs:
        try:
            formats = json.loads((d / WEIGHTS_JSON).read_text()).get("linear_formats")
        except (OSError, json.JSONDecodeError):
            continue  # (no artifact there: find_artifact / WeightsArtifact.open say so below)
        return quantized if formats == dataclasses.asdict(ALL_NVFP4) else spec
    return spec


class CudaBackend(EngineBackend):
    """Backend protocol over an Engine (generate_stream: one request; the engine core batches through runner())."""

    def __init__(self, engine: Engine, load_s: float = 0.0) -> None:
        self.engine, self.spec, self.device = engine, engine.spec, engine.device
        self.max_context = engine.ctx
        self.lm_head = engine.art.lm_head
        self.load_s = load_s
        self.device.used()  # (the device keeps the peak seen: at load, at each request's end)

    def runner(self, max_num_seqs: int = 1, kv_tokens: int | None = None) -> CudaRunner:
        """The engine core's ModelRunner over up to `max_num_seqs` of the engine's KV lanes and `kv_tokens`
        positions of its pages (default: all of them)."""
        runner = CudaRunner(self.engine, max_num_seqs, kv_tokens=kv_tokens)
        if self.engine.options.capture_graphs:
            count, seconds = capture_step_graphs(runner)
            if count:
                log.info("captured %d step graphs in %.2f s", count, seconds)
        return runner

    @property
    def features(self) -> BackendFeatures:
        """Speculative decoding when a drafter and its kernels are present; grammars when the logits-processing
        kernels are built (lm_process applies the mask on the GPU) and llguidance, which computes it, is
        installed."""
        return BackendFeatures(
            speculative=self.engine.speculative,
            grammar=not self.engine.ext_missing and importlib.util.find_spec("llguidance") is not None,
        )

    def _emulate(self, k: int | None) -> None:
        # the drafts are then distinct tokens past the block's start, so the verify reads what real drafts would
        steps, vocab = self.engine.dflash, self.spec.target.vocab_size
        steps.emulate_acceptance = k
        steps.draft_hook = (
            None if k is None else (lambda start, last: distinct_tokens(VERIFY_ROWS - 1, vocab, first=start + 1))
        )

    # ---- bench hooks ------------------------------------------------------------------------------------------
    def peak_gpu_mem_bytes(self) -> int:
        """Peak device memory in use seen at request ends (driver view: includes the CUDA context)."""
        return self.device.peak_used()

    def copy_bandwidth_gb_s(self, nbytes: int = 1 << 30, repeats: int = 5) -> float:
        """Device-to-device copy bandwidth (read + write bytes / s), best of `repeats`, measured now."""
        a = alloc(self.device, nbytes, "bandwidth probe")
        b = alloc(self.device, nbytes, "bandwidth probe")
        s, e0, e1 = self.engine.stream, self.device.event(), self.device.event()
        best = float("inf")
        try:
            for _ in range(repeats):
                e0.record(s)
                check(driver().cuMemcpyDtoDAsync(b.ptr, a.ptr, nbytes, s.handle), "bandwidth probe")
                e1.record(s)
                e1.synchronize()
                best = min(best, e1.elapsed_ms(e0) / 1e3)
        finally:
            a.free()
            b.free()
            e0.destroy()
            e1.destroy()
        return 2 * nbytes / best / 1e9

    def kernel_breakdown(self, rows: int = 1) -> list[dict]:
        """One decode step's (or `rows`-token prefill chunk's) launches with their GPU time, summed per kernel
        (largest first)."""
        from .profile import per_kernel, profile_step

        return per_kernel(profile_step(self.engine, 0, rows=rows))

    def encode_breakdown(self, image) -> list[dict]:
        """The vision tower's launches on `image` with their GPU time, summed per kernel (largest first)."""
        from .profile import per_kernel, profile_encode

        return per_kernel(profile_encode(self.engine, image))

    @property
    def encoder_cache(self):
        """The engine's encoded-image rows in front of the device tower (None without one): what the bench times."""
        return self.engine.encoder_cache

    def close(self) -> None:
        """Free the engine, then release the contexts open_backend took (its green context, if any), the latter
        also when the former fails (after a fault on the device the context is reset: Device.close)."""
        try:
            self.engine.close()
        finally:
            self.device.close()


def open_backend(
    model_dir: str | os.PathLike,
    ctx: int | None = None,
    kv_dtype: str = "bf16",
    draft_dir: str | os.PathLike | None = None,
    weights_dir: str | os.PathLike | None = None,
    kernels_dir: str | os.PathLike | None = None,
    device: int = 0,
    verify: bool = False,
    max_num_seqs: int = 1,
    kv_cache_gib: float | None = None,
    options: EngineOptions = EngineOptions(),
    sms: int | None = None,
) -> CudaBackend:
    """Open the GPU, check kernels and repacked weights against the model and the GPU, upload, build the engine.

    Every mismatch or shortage is a BackendError that says what to run (no GPU -> --backend reference; stale
    artifacts -> repack/build; too little memory -> needed vs free). The KV cache holds `max_num_seqs` sequences
    of up to `ctx` tokens (fewer when their rings and one full context do not fit), whose paged layers share the
    pages that fit beside them (kv_cache.fit_kv). `sms`: every kernel runs on that many multiprocessors (Device.open's
    green context), the copy probe too."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    spec = _served_spec(
        _spec(model_dir, Path(draft_dir) if draft_dir else None), model_dir, Path(weights_dir) if weights_dir else None
    )
    ctx = default_ctx(spec.target.max_position_embeddings, ctx)
    dev = Device.open(device, sms)
    arch = dev.info.arch
    manifest = find_kernels(arch, spec.name, model_dir, Path(kernels_dir) if kernels_dir else None)
    manifest.check(spec_hash=spec.spec_hash, device_arch=arch)
    folder = Path(weights_dir) if weights_dir else find_artifact(model_dir, spec.spec_hash)
    art = WeightsArtifact.open(folder, spec_hash=spec.spec_hash, layout_version=layout_version(), arch=arch)
    if verify:
        art.verify()
    drafter = spec.drafter is not None and "draft.fc.weight" in art.tensors  # the engine's own probe may still say no
    if not 1 <= max_num_seqs <= MAX_BATCH:
        raise BackendError(
            f"--max-num-seqs {max_num_seqs}: the cuda backend decodes 1..{MAX_BATCH} sequences at "
            "once (more requests queue)"
        )
    # the activations (the plan's own size, at the build's step rows, every optional part counted), then slack for
    # graphs, the drafter's split weights and launch lists
    slack = plan_activations(spec, manifest, manifest.max_step_tokens, ctx, True, drafter).total + (512 << 20)
    if spec.vision is not None and "vision.patch_proj" in art.tensors:  # the tower's activations (VisionEncoder)
        slack += plan_vision(spec).total
    free, _ = dev.mem_info()
    one = plan_kv(spec, ctx, kv_dtype, drafter=drafter, conventions=manifest.conventions)
    lanes, pages = fit_kv(one, max_num_seqs, free - art.total_bytes - slack, kv_cache_gib)
    kv = plan_kv(spec, ctx, kv_dtype, drafter=drafter, conventions=manifest.conventions, lanes=lanes, pages=pages)
    need = art.total_bytes + kv.nbytes + slack
    check_fits(need, free, f"weights ({gib(art.total_bytes)} GiB) + KV cache ({gib(kv.nbytes)} GiB, --ctx {ctx})")
    weights = upload_artifact(art, dev)
    try:
        engine = Engine(spec, dev, manifest, art, weights, ctx, kv_dtype, lanes=lanes, pages=pages, options=options)
    except BaseException:
        weights.free()
        raise
    return CudaBackend(engine, time.perf_counter() - t0)
