"""What every benchmark shares: the synthetic prompt, a timed greedy generation, the host copy probe, and
opening a model for a benchmark (prefix cache off) through the one backend registry."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ...model_spec.formats import HF_QUANT_CONFIG, detect_format, with_checkpoint_formats
from ...model_spec.types import ModelSpec
from ..api import EngineConfig, EngineOptions, OpenedModel, open_backend
from ..backend import BackendError, GenerationResult, ImageSpan, SamplingParams


def synthetic_prompt(spec: ModelSpec, n: int, seed: int = 0) -> list[int]:
    """<bos> then n-1 pseudo-random ordinary token ids (above the special-token range of the real vocab)."""
    rng = np.random.default_rng(seed)
    lo = min(256, spec.target.vocab_size // 2)
    return [spec.target.bos_token_id] + rng.integers(lo, spec.target.vocab_size, n - 1).tolist()


def timed_stream(
    backend: Any,
    prompt: list[int],
    gen: int,
    speculative: bool = False,
    stop_ids: frozenset[int] = frozenset(),
    images: Sequence[ImageSpan] = (),
) -> dict:
    """One greedy generation, timed at each step's arrival: ttft_s (call -> first token), decode_s (first ->
    last token), steps after the first token, the tokens and, for speculative decoding, the accepted lengths.
    `images`: the prompt's image spans (their encoding counts in the TTFT)."""
    result = GenerationResult()
    t0 = time.perf_counter()
    first = last = None
    steps = 0
    for _ in backend.generate_stream(
        prompt,
        gen,
        SamplingParams(),
        stop_ids=stop_ids,
        speculative=speculative,
        result=result,
        **({"images": tuple(images)} if images else {}),
    ):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            steps += 1
        last = now
    if first is None:
        raise BackendError("the backend produced no token")
    return {
        "ttft_s": first - t0,
        "decode_s": last - first,
        "steps": steps,
        "token_ids": result.token_ids,
        "accepted_lengths": result.accepted_lengths,
    }


def timed_run(backend: Any, prompt: list[int], gen: int) -> tuple[float, float, int]:
    """(ttft seconds, decode seconds after the first token, tokens) of one plain greedy generation."""
    r = timed_stream(backend, prompt, gen)
    return r["ttft_s"], r["decode_s"], len(r["token_ids"])


def host_copy_gb_s(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Host memcpy bandwidth (read + write bytes per second), best of `repeats`."""
    a = np.ones(nbytes, np.uint8)
    b = np.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def open_model_for_bench(
    name: str,
    model: Path,
    ctx: int | None,
    kv_dtype: str,
    weights: Path | None = None,
    kernel_dir: Path | None = None,
    max_num_seqs: int = 1,
    options: EngineOptions = EngineOptions(),
    sms: int | None = None,
) -> tuple[OpenedModel, dict]:
    """(the opened model, facts about its backend for the report), through the one backend registry. `sms`: the
    cuda backend runs on that many multiprocessors (a green context)."""
    if sms is not None and name != "cuda":
        raise BackendError("--sms restricts the cuda backend's GPU (use --backend cuda)")
    # No prefix cache: every run must prefill its prompt, or TTFT would measure a cache hit.
    opened = open_backend(
        EngineConfig(
            model,
            name,
            ctx,
            kv_dtype,
            weights=weights,
            kernels=kernel_dir,
            prefix_cache=False,
            max_num_seqs=max_num_seqs,  # (KV lanes: cuda)
            options=options,
            sms=sms,
        )
    )
    b = opened.backend
    if name == "cuda":
        return opened, {
            "gpu": b.device.info.name,
            "lm_head": b.lm_head,
            "sms": b.device.sms,
            "device_sms": b.device.info.sm_count,
            "weights_format": weights_format(model, b.spec),
        }
    cpu = platform.processor() or platform.machine()
    return opened, {"gpu": f"none (cpu: {cpu})", "lm_head": "bf16", "weights_format": weights_format(model, b.spec)}


def weights_format(model: Path, served: ModelSpec) -> str:
    """How the served weights are stored, for the report: the checkpoint's format, each role's linear format, and
    whether `repack-weights --quantize nvfp4` rewrote the checkpoint's bf16 linears."""
    try:
        config = json.loads((model / "config.json").read_text())
        hq = model / HF_QUANT_CONFIG
        quant = json.loads(hq.read_text()) if hq.is_file() else None
        source = detect_format(config, quant).source
        stored = with_checkpoint_formats(served, config, quant).linear_formats
    except (OSError, ValueError) as exc:
        return f"unknown ({exc})"
    f = served.linear_formats
    roles = f"attention {f.attention}, dense MLP {f.dense_mlp}, experts {f.experts}"
    quantized = " (bf16 linears quantized by repack-weights --quantize nvfp4)" if stored != f else ""
    return f"{source}: {roles}{quantized}"


def open_for_bench(
    name: str,
    model: Path,
    ctx: int | None,
    kv_dtype: str,
    weights: Path | None = None,
    kernel_dir: Path | None = None,
    max_num_seqs: int = 1,
    options: EngineOptions = EngineOptions(),
    sms: int | None = None,
) -> tuple[Any, dict]:
    """(backend, facts about it for the report)."""
    opened, facts = open_model_for_bench(name, model, ctx, kv_dtype, weights, kernel_dir, max_num_seqs, options, sms)
    return opened.backend, facts
