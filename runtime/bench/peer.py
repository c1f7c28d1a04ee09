"""Runtime stage (bench, the `peer` extra): HF transformers' Gemma4ForCausalLM on the same checkpoint, timed on the
same prompt as `thorgen bench`, so `thorgen bench --peer hf` prints our speed as a ratio of the peer's.

The peer gets the checkpoint's weights dequantized (NVFP4 -> float), fused the way HF holds its experts in memory:
`experts.gate_up_proj` [E, 2*Ie, H] = concat(gate, up) along the output axis, `experts.down_proj` [E, H, Ie].
It decodes greedily with a static KV cache (`cache_implementation="static"`); on a GPU, generate() then compiles
the decoding forward itself (its automatic torch.compile, "reduce-overhead"): the fastest stock configuration
transformers documents for decoding. Wrapping forward in torch.compile as well, as this module first did, made
the H200 run recompile past dynamo's limit (the cache length is a Python int). Its experts run in the fastest of
transformers' own implementations (EXPERTS), ranked by a short decode of each with compilation off (one compile
each would take minutes), all of them recorded. torch and transformers are imported here only, and only when
the peer runs (`pip install -e ".[peer]"`).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ...model_spec.checkpoint import Checkpoint
from ...model_spec.config import target_config
from ...model_spec.tensors import LAYER_NORMS, TARGET_PREFIX
from ..backend import BackendError


def hf_state_dict(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """HF Gemma4ForCausalLM parameter name -> float32 array (dequantized), from our checkpoint's target."""
    return dict(hf_tensors(ckpt))


def hf_tensors(ckpt: Checkpoint) -> Iterator[tuple[str, np.ndarray]]:
    """(HF parameter name, float32 array) one at a time, so that a caller can convert each before the next (the
    full model in float32 would need 104 GB of host memory)."""
    spec, P = ckpt.spec.target, TARGET_PREFIX
    yield "model.embed_tokens.weight", ckpt.weight_f32(P + "embed_tokens.weight")  # (lm_head is tied to it)
    yield "model.norm.weight", ckpt.weight_f32(P + "norm.weight")
    for l in range(spec.num_hidden_layers):
        p = f"layers.{l}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if n != "v_proj" or spec.layer_has_v_proj(l):
                yield f"model.{p}self_attn.{n}.weight", ckpt.linear_f32(f"{P}{p}self_attn.{n}")
        for n in ("q_norm", "k_norm"):
            yield f"model.{p}self_attn.{n}.weight", ckpt.weight_f32(f"{P}{p}self_attn.{n}.weight")
        for n in ("gate_proj", "up_proj", "down_proj"):
            yield f"model.{p}mlp.{n}.weight", ckpt.linear_f32(f"{P}{p}mlp.{n}")
        for n in LAYER_NORMS:
            yield f"model.{p}{n}.weight", ckpt.weight_f32(f"{P}{p}{n}.weight")
        yield f"model.{p}layer_scalar", ckpt.weight_f32(f"{P}{p}layer_scalar")
        for n in ("scale", "per_expert_scale", "proj.weight"):
            yield f"model.{p}router.{n}", ckpt.weight_f32(f"{P}{p}router.{n}")

        def stacked(names: tuple[str, ...]) -> np.ndarray:
            # the experts dequantize on every core (NumPy releases the GIL): 3 x 128 matrices a layer at full size
            def one(e: int) -> np.ndarray:
                return np.concatenate([ckpt.linear_f32(f"{P}{p}experts.{e}.{n}") for n in names])

            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                return np.stack(list(pool.map(one, range(spec.num_experts))))

        yield f"model.{p}experts.gate_up_proj", stacked(("gate_proj", "up_proj"))
        yield f"model.{p}experts.down_proj", stacked(("down_proj",))


def hf_model(ckpt: Checkpoint, dtype: str = "bfloat16", device: str = "cpu", attn: str = "eager") -> Any:
    """The peer model with our weights, in eval mode on `device`."""
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise BackendError(f'--peer hf needs torch and transformers: pip install -e ".[peer]" ({exc})') from None
    cfg = transformers.Gemma4TextConfig(**target_config(ckpt.spec.target)["text_config"])
    cfg._attn_implementation = attn
    torch_dtype, default = getattr(torch, dtype), torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype)  # built in the target dtype on the device (its buffers made as HF makes them)
    try:
        with torch.device(device):
            model = transformers.Gemma4ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    given, unexpected = set(), []
    for name, value in hf_tensors(ckpt):  # one tensor at a time into the model's own parameters
        unexpected += model.load_state_dict(
            {name: torch.from_numpy(np.ascontiguousarray(value, np.float32))}, strict=False
        ).unexpected_keys
        given.add(name)
    missing = [k for k, _ in model.named_parameters() if k not in given and k != "lm_head.weight"]
    if unexpected or missing:
        raise BackendError(
            f"HF Gemma4 does not take this checkpoint: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (transformers {transformers.__version__})"
        )
    model.tie_weights()
    return model.eval()


EXPERTS = ("grouped_mm", "batched_mm", "eager")  # transformers' MoE experts implementations that need no extra


def pick_experts(model: Any, ids: Any, tokens: int = 8) -> tuple[str, dict]:
    """(the fastest of EXPERTS on this model and device, {name: decode tok/s or why it could not run})."""
    import torch

    if not hasattr(model, "set_experts_implementation"):  # a transformers without the experts interface
        return "default", {}
    rates: dict = {}
    for name in EXPERTS:
        try:
            model.set_experts_implementation(name)
            with torch.inference_mode():
                for n in (2, tokens):  # the first call warms up (kernels, caches)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.generate(
                        ids,
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        cache_implementation="static",
                        disable_compile=True,
                    )
                    torch.cuda.synchronize()
            rates[name] = round((tokens - 1) / (time.perf_counter() - t0), 2)  # (prefill included: a ranking only)
        except Exception as exc:  # an implementation this torch/transformers/GPU lacks
            rates[name] = f"unavailable: {type(exc).__name__}: {str(exc)[:160]}"
    timed = {k: v for k, v in rates.items() if isinstance(v, float)}
    if not timed:
        raise BackendError(f"no experts implementation of transformers ran: {rates}")
    best = max(timed, key=timed.get)
    model.set_experts_implementation(best)
    return best, rates


def bench_peer(
    model_dir: Path, prompt: list[int], gen: int, runs: int, device: str | None = None, compile: bool | None = None
) -> dict:
    """TTFT and decode tok/s of HF's greedy generate on `prompt` (median of `runs`, after a warm-up run that also
    compiles): {peer, device, dtype, compiled, ttft_ms, decode_tok_s, tokens}."""
    import statistics

    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compile = device == "cuda" if compile is None else compile
    dtype = "bfloat16" if device == "cuda" else "float32"  # (bf16 matmuls on a CPU are slow, not representative)
    t_load = time.perf_counter()
    model = hf_model(Checkpoint.open(model_dir), dtype, device, "sdpa" if device == "cuda" else "eager")
    load_s = time.perf_counter() - t_load
    say = lambda what: print(f"peer: {what} at {time.perf_counter() - t_load:.0f} s", file=sys.stderr)  # noqa: E731
    say("weights loaded")  # (a full-size run takes minutes: these lines show where they go)
    ids = torch.tensor([prompt], device=device)
    experts, tried = pick_experts(model, ids) if device == "cuda" else ("eager", {})
    say(f"experts {experts} ({tried})")
    kw = dict(do_sample=False, cache_implementation="static", disable_compile=not compile)

    def run(n: int) -> tuple[float, float, int]:
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        with torch.inference_mode():
            sync()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            sync()
            t1 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
            sync()
            t2 = time.perf_counter()
        # the second call repeats the prefill: its decode time is its time less the first call's
        return t1 - t0, (t2 - t1) - (t1 - t0), int(out.shape[1] - ids.shape[1])

    run(gen)  # warm-up and compilation, at the timed runs' own cache lengths (so they never recompile)
    say("warm-up (compilation) done")
    ttfts, rates = [], []
    for _ in range(runs):
        ttft, rest, n = run(gen)
        ttfts.append(ttft)
        rates.append((n - 1) / rest if n > 1 and rest > 0 else float("nan"))
    return {
        "peer": f"hf transformers {__import__('transformers').__version__} Gemma4ForCausalLM",
        "device": device,
        "dtype": dtype,
        "compiled": compile,
        "cache": "static",
        "experts": experts,
        "experts_tried": tried,
        "load_s": round(load_s, 1),
        "ttft_ms": round(1e3 * statistics.median(ttfts), 3),
        "decode_tok_s": round(statistics.median(rates), 3),
        "tokens": gen,
    }
