"""Runtime stage: `CudaBackend`, the compiled engine behind the Backend protocol (what `--backend cuda` opens).

Status (honest): chunked prefill and greedy / seeded-sampling decode (one captured CUDA graph per mode) are wired
against codegen's kernel plan (tests/test_runtime_cpu.py checks every launch binds); the engine refuses to start,
naming them, when built kernels are missing. `CudaRunner` is the engine core's ModelRunner (runtime/engine_core.py
holds the one stop / length / cancel loop); speculative (DFlash) steps run when the model has a drafter and its
kernels are built (else the request is refused, naming what is missing); their output equals plain decoding
token for token (tests/test_engine_speculative_emulated.py).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

from ..model_spec.config import spec_from_configs
from .backend import BackendError, GenerationResult, SamplingParams, StepOutput, StreamingBackend, check_token_ids
from .device import Device, check, driver, gib
from .engine import Engine
from .kv_cache import default_ctx, plan_kv
from .memory import alloc, check_fits
from .modules import KernelManifest, load_manifest
from .repack import layout_version
from .engine_core import generate_one
from .spec_decode import BLOCK
from .weights import WeightsArtifact, find_artifact, upload


def _spec(model_dir: Path, draft_dir: Path | None):
    """The ModelSpec from the configs alone (cheap; the repacked artifact carries the weights)."""
    def read(p: Path) -> dict:
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BackendError(f"{p}: cannot read the model config ({exc})") from exc
    draft_dir = draft_dir or (model_dir / "dflash" if (model_dir / "dflash" / "config.json").is_file() else None)
    try:
        return spec_from_configs(read(model_dir / "config.json"),
                                 read(draft_dir / "config.json") if draft_dir else None, name=model_dir.name)
    except ValueError as exc:  # SpecError: a config thorgen cannot run
        raise BackendError(f"{model_dir}: {exc}") from exc


def find_kernels(model_dir: Path, spec_name: str, arch: str, kernels_dir: Path | None) -> KernelManifest:
    """The built kernels: --kernels DIR, $THORGEN_KERNELS, ./thorgen-build/<model>/<arch> (thorgen build's
    default), or <model>/thorgen-build/<arch>."""
    cands = [kernels_dir] if kernels_dir else []
    if os.environ.get("THORGEN_KERNELS"):
        cands.append(Path(os.environ["THORGEN_KERNELS"]))
    cands += [Path("thorgen-build") / spec_name / arch, model_dir / "thorgen-build" / arch]
    for c in cands:
        if (c / "manifest.json").is_file():
            return load_manifest(c)
    raise BackendError(f"no built kernels for {arch} (looked in {', '.join(map(str, cands))}); run "
                       f"`thorgen build --model {model_dir} --arch {arch}` or pass --kernels DIR")


class CudaBackend(StreamingBackend):
    """Backend protocol over an Engine (one request at a time, like the reference backend)."""

    def __init__(self, engine: Engine, load_s: float = 0.0) -> None:
        self.engine, self.spec, self.device = engine, engine.spec, engine.device
        self.max_context = engine.ctx
        self.lm_head = engine.art.lm_head
        self.load_s = load_s
        self._peak_used = self._used()

    def _used(self) -> int:
        free, total = self.device.mem_info()
        return total - free

    def runner(self, max_num_seqs: int = 1, kv_tokens: int | None = None) -> "CudaRunner":
        """The engine core's ModelRunner: one sequence at a time until batched decode graphs exist."""
        return CudaRunner(self)

    def generate_stream(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                        stop_ids: frozenset[int] = frozenset(), speculative: bool = False,
                        cancelled: Callable[[], bool] | None = None,
                        result: GenerationResult | None = None) -> Iterator[StepOutput]:
        return generate_one(self.runner(), list(prompt_ids), max_tokens, sampling, frozenset(stop_ids),
                            speculative, cancelled, GenerationResult() if result is None else result)

    @property
    def drafter(self):
        """The drafter's DFlashSpec when speculative decoding can run, else None (what `thorgen generate` checks)."""
        return self.spec.drafter if self.engine.speculative else None

    @property
    def speculative_available(self) -> bool:
        """True when generate_stream(speculative=True) can run (a drafter and its kernels are present)."""
        return self.engine.speculative

    # ---- bench hooks ------------------------------------------------------------------------------------------
    def peak_gpu_mem_bytes(self) -> int:
        """Peak device memory in use seen at request ends (driver view: includes the CUDA context)."""
        return max(self._peak_used, self._used())

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
        from .profile import profile_step

        rows = profile_step(self.engine, 0, rows=rows)
        agg: dict[str, dict] = {}
        for r in rows:
            a = agg.setdefault(r["kernel"], {"kernel": r["kernel"], "us": 0.0, "count": 0})
            a["us"] += r["us"]
            a["count"] += 1
        return sorted(agg.values(), key=lambda a: -a["us"])

    def close(self) -> None:
        self.engine.close()


class CudaRunner:
    """ModelRunner over the Engine, whose KV cache holds one sequence: max_num_seqs 1, whole-prompt prefill
    (the engine chunks it itself). Plain steps decode the token the previous step left in out_ids[0] when they
    follow a plain step of the same sequence; otherwise the input token is staged (4 bytes).

    One-slot prefix cache: the K/V of the last finished sequence stays in the cache, so a request that starts
    with its tokens (a chat's next turn) prefills only the rest, while the rings still hold what the new
    positions need (KVPlan.prefix_intact) and, for a speculative request, the drafter context was built too."""

    max_num_seqs = 1
    prefill_chunk = None

    def __init__(self, backend: CudaBackend) -> None:
        self.backend, self.engine = backend, backend.engine
        self.max_context = self.kv_tokens = backend.max_context
        self.verify_block = BLOCK if self.engine.speculative else 1
        self._on_device: tuple[str, int] | None = None  # (request, position) whose token is in out_ids[0]
        self._cached: list[int] = []  # tokens at positions 0.. whose K/V the cache holds (the last sequence's)
        self._last_written = -1  # the highest position written since (rejected drafts included)
        self._with_taps = False  # the drafter context covers `_cached` too

    def check(self, seq) -> None:
        check_token_ids(seq.prompt, self.backend.spec.target.vocab_size)
        if seq.speculative and not self.engine.speculative:
            raise BackendError("cuda backend: speculative (DFlash) decoding is unavailable: "
                               + "; ".join(self.engine.spec_missing) + "; use --no-speculative")
        if seq.sampling.extended:  # the GPU sampler has no logits processing or logprobs output yet
            raise BackendError(f"{seq.sampling.describe_extended()} is not supported on the cuda backend yet "
                               "(use --backend reference)")

    def admit(self, seq, limit: int) -> int:
        s = seq.sampling
        if not s.greedy:
            self.engine.set_sampling(s.temperature, s.top_k, s.top_p, s.min_p, s.seed)
        want = seq.tokens[:seq.prefill_target]
        n = 0
        while n < min(len(self._cached), len(want), limit) and self._cached[n] == want[n]:
            n += 1
        if n and (not self.engine.kv.plan.prefix_intact(n, self._last_written)
                  or (seq.speculative and not self._with_taps)):
            n = 0
        self._cached, self._last_written = [], -1  # from here on the cache belongs to `seq`
        return n

    def prefill(self, seq, start: int, end: int, sample: bool, launched=None) -> int | None:
        tok = self.engine.prefill(seq.tokens[:end], seq.sampling.greedy, taps=seq.speculative, launched=launched,
                                  begin=start)  # (start < end: the core skips a fully cached chunk)
        self._with_taps = seq.speculative and (start == 0 or self._with_taps)
        self._last_written = end - 1
        self._on_device = (seq.request_id, end) if sample else None
        return tok if sample else None

    def decode(self, seqs: list, launched=None) -> list[tuple[list[int], bool]]:
        (seq,) = seqs
        pos, tok, greedy = seq.num_tokens - 1, seq.output[-1], seq.sampling.greedy
        room = seq.room(self.max_context)
        if seq.speculative and pos + BLOCK <= self.max_context:  # else a verify block would run past the cache
            drafts, target = self.engine.spec_step(pos, tok, greedy, launched)
            self._last_written = max(self._last_written, pos + BLOCK - 1)
            new = [target[0]]
            while len(new) < BLOCK and drafts[len(new) - 1] == new[-1]:
                new.append(target[len(new)])
            self._on_device = None  # out_ids[0] now holds a verify row
            return [(new[:room], True)]
        staged = None if self._on_device == (seq.request_id, pos) else tok
        new = self.engine.decode(pos, greedy, token=staged, launched=launched)
        self._last_written = max(self._last_written, pos)
        self._with_taps = False  # a plain step leaves the drafter context behind
        self._on_device = (seq.request_id, pos + 1)
        return [([new], False)]

    def release(self, seq, finished: bool) -> None:
        self._on_device = None
        # the positions whose K/V a committed token wrote (a step's tokens after a stop id wrote some too)
        self._cached = seq.tokens[:min(seq.num_cached, len(seq.tokens))] if finished else []
        self.backend._peak_used = max(self.backend._peak_used, self.backend._used())


def open_backend(model_dir: str | os.PathLike, ctx: int | None = None, kv_dtype: str = "bf16",
                 draft_dir: str | os.PathLike | None = None, weights_dir: str | os.PathLike | None = None,
                 kernels_dir: str | os.PathLike | None = None, device: int = 0, verify: bool = False) -> CudaBackend:
    """Open the GPU, check kernels and repacked weights against the model and the GPU, upload, build the engine.

    Every mismatch or shortage is a BackendError that says what to run (no GPU -> --backend reference; stale
    artifacts -> repack/build; too little memory -> needed vs free)."""
    t0 = time.perf_counter()
    model_dir = Path(model_dir)
    spec = _spec(model_dir, Path(draft_dir) if draft_dir else None)
    ctx = default_ctx(spec.target.max_position_embeddings, ctx)
    dev = Device.open(device)
    arch = dev.info.arch
    manifest = find_kernels(model_dir, spec.name, arch, Path(kernels_dir) if kernels_dir else None)
    manifest.check(spec_hash=spec.spec_hash, device_arch=arch)
    folder = Path(weights_dir) if weights_dir else find_artifact(model_dir, spec.spec_hash)
    art = WeightsArtifact.open(folder, spec_hash=spec.spec_hash, layout_version=layout_version(), arch=arch)
    if verify:
        art.verify()
    drafter = spec.drafter is not None and "draft.fc.weight" in art.tensors  # the engine's own probe may still say no
    kv = plan_kv(spec, ctx, kv_dtype, drafter=drafter, conventions=manifest.conventions)
    need = art.total_bytes + kv.nbytes + (256 << 20)  # + activations, logits and graph/launch slack
    free, _ = dev.mem_info()
    check_fits(need, free, f"weights ({gib(art.total_bytes)} GiB) + KV cache ({gib(kv.nbytes)} GiB, --ctx {ctx})")
    weights = upload(art, dev)
    try:
        engine = Engine(spec, dev, manifest, art, weights, ctx, kv_dtype)
    except BaseException:
        weights.free()
        raise
    return CudaBackend(engine, time.perf_counter() - t0)
