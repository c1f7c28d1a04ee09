"""NumPy references of the matmul helper's kernels (NVFP4 GEMMs, grouped MoE, attention, drafter fp16 GEMMs), with
the tolerances the GPU tests apply next to each, plus random-input builders. Not a test module.

Every reference computes in float64 from exactly the values the kernel reads (fp16 activations, dequantized NVFP4
weights, bf16 / fp8 K/V) and rounds where the kernel stores, so a tolerance only covers fp32 accumulation order,
the kernel's internal roundings named next to it, and the final store.
"""

from __future__ import annotations

import math

import numpy as np

from thorgen.model_spec.nvfp4 import (
    bf16_to_f32,
    dequantize_nvfp4,
    e4m3_to_f32,
    f32_to_bf16,
    f32_to_e4m3,
    multiplier_of_divisor,
    quantize_nvfp4,
)
from thorgen.runtime.convert import layouts as L

F64 = np.float64

# NVFP4 / fp16 GEMMs: decoded weights are exact (e2m1 * e4m3 in fp16), products exact, fp32 accumulation
# (tensor-core alignment truncation ~1e-6), so f32 outputs sit far inside 1e-4; f16 outputs add one rounding (2^-11).
TOL_GEMM = {"f32": 1e-4, "f16": 1e-3}
# MoE: gate/up writes f16 act (one rounding); down reads the act the test gives it and sums in fp32.
TOL_MOE_ACT = 1e-3
TOL_MOE_OUT = 1e-4
# Attention: probabilities are rounded to bf16 (8-bit mantissa) / fp16 (fp8 caches) before P.V, fp16 output.
TOL_ATTN = {"bf16": 1e-2, "fp8e4m3": 3e-3}


def norm_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, F64), np.asarray(ref, F64)
    if not np.isfinite(out).all():
        return math.inf
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


# ---- activations ----------------------------------------------------------------------------------------------
def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F64)
    return x / (1.0 + np.exp(-x))


ACT = {"gelu_mul": gelu_tanh, "silu_mul": silu}


# ---- NVFP4 weights ------------------------------------------------------------------------------------------------
class Fp4Weight:
    """A random NVFP4 weight: checkpoint tensors, its dequantized float64 matrix and its kernel layout."""

    def __init__(self, rng: np.random.Generator, n: int, k: int, order: str, amp: float = 1.0):
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(amp)
        w *= rng.uniform(0.25, 1.0, size=(n, 1)).astype(np.float32)  # rows of different magnitude
        self.packed, self.scale, self.gs = quantize_nvfp4(w)
        self.n, self.k = n, k
        self.dense = dequantize_nvfp4(self.packed, self.scale, self.gs).astype(F64)
        self.w, self.s = L.pack_nvfp4(self.packed, self.scale, order)
        self.mul = multiplier_of_divisor(self.gs)  # the global multiplier Checkpoint.nvfp4_parts hands out
        self.gscale = L.tile_gscales([(n, float(self.mul))])


# ---- bf16 checkpoint weights (the fp16-weight kernels: runtime/convert/linears.py) -----------------------------------
# The kernels read the bf16 weight converted to fp16 once (exact from 2^-14 up), so the references multiply by the
# bf16 values themselves and the fp16-weight kernels share TOL_GEMM / TOL_MOE_* with the NVFP4 ones.
class Bf16Weight:
    """A random bf16 weight [n, k]: the checkpoint's raw bits and their float64 values (rows of different size)."""

    def __init__(self, rng: np.random.Generator, n: int, k: int, amp: float = 0.05):
        w = rng.standard_normal((n, k)).astype(np.float32) * np.float32(amp)
        w *= rng.uniform(0.25, 1.0, size=(n, 1)).astype(np.float32)
        self.bits = f32_to_bf16(w)
        self.dense = bf16_to_f32(self.bits).astype(F64)
        self.n, self.k = n, k


def gate_up_weight(rng: np.random.Generator, n: int, k: int, order: str, amp: float = 1.0):
    """(gate, up, (w, s, gscale) of the interleaved fused layout)."""
    g, u = Fp4Weight(rng, n, k, order, amp), Fp4Weight(rng, n, k, order, amp)
    fused = L.pack_nvfp4_gate_up((g.packed, g.scale, g.mul), (u.packed, u.scale, u.mul), order)
    return g, u, fused


def act_f16(rng: np.random.Generator, m: int, k: int, std: float = 1.0) -> np.ndarray:
    return (rng.standard_normal((m, k)) * std).astype(np.float16)


def gemm_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x @ w.T in float64 (x: the fp16 activations the kernel reads)."""
    return np.asarray(x, F64) @ np.asarray(w, F64).T


def gated_ref(x: np.ndarray, gate: np.ndarray, up: np.ndarray, epi: str) -> np.ndarray:
    return ACT[epi](gemm_ref(x, gate)) * gemm_ref(x, up)


# ---- MoE ----------------------------------------------------------------------------------------------------------
def moe_routing(rng: np.random.Generator, m: int, experts: int, topk: int, pool: int | None = None):
    """Distinct top-k ids per token (drawn from the first `pool` experts to force sharing) and positive weights."""
    pool = pool or experts
    ids = np.stack([rng.choice(pool, size=topk, replace=False) for _ in range(m)]).astype(np.int32)
    wts = rng.uniform(0.05, 0.6, size=(m, topk)).astype(np.float32)
    return ids, wts


def moe_gateup_ref(x: np.ndarray, ids: np.ndarray, gates: list, ups: list) -> np.ndarray:
    """act [(t*K + k), Ie] = gelu(gate_e x_t) * (up_e x_t), e = ids[t, k] (float64)."""
    m, topk = ids.shape
    out = np.zeros((m * topk, gates[int(ids[0, 0])].shape[0]), F64)
    for t in range(m):
        for k in range(topk):
            e = ids[t, k]
            out[t * topk + k] = gated_ref(x[t : t + 1], gates[e], ups[e], "gelu_mul")[0]
    return out


def moe_down_ref(act: np.ndarray, ids: np.ndarray, wts: np.ndarray, downs: list) -> np.ndarray:
    """y[t] = sum_k wts[t, k] * down_{ids[t,k]} act[t*K+k] (float64)."""
    m, topk = ids.shape
    y = np.zeros((m, downs[int(ids[0, 0])].shape[0]), F64)
    for t in range(m):
        for k in range(topk):
            y[t] += float(wts[t, k]) * gemm_ref(act[t * topk + k : t * topk + k + 1], downs[ids[t, k]])[0]
    return y


# ---- attention -----------------------------------------------------------------------------------------------------
def kv_store(x: np.ndarray, kv: str) -> np.ndarray:
    return f32_to_bf16(x) if kv == "bf16" else f32_to_e4m3(x)


def kv_load(bits: np.ndarray, kv: str) -> np.ndarray:
    return bf16_to_f32(bits) if kv == "bf16" else e4m3_to_f32(bits)


def attention_ref(
    q_bits: np.ndarray,
    kc: np.ndarray,
    vc: np.ndarray,
    kv: str,
    p0: int,
    ring: int,
    window: int,
    causal: bool,
    scale: float,
    kv_hi: np.ndarray | None = None,
) -> np.ndarray:
    """out [m, Hq, D] (float64) for queries at p0..p0+m-1 over cache slots (pos % ring, or pos when ring == 0);
    `kv_hi` (causal): query i sees keys up to max(its position, kv_hi[i]) (an image span's queries see the span)."""
    q = bf16_to_f32(q_bits).astype(F64)
    m, hq, d = q.shape
    hkv = kc.shape[1]
    g = hq // hkv
    end = p0 + m
    qpos = p0 + np.arange(m)
    lo = max(0, p0 - window + 1) if window else 0
    pos = np.arange(lo, end)
    slots = pos % ring if ring else pos
    hi = qpos if kv_hi is None else np.maximum(qpos, kv_hi)
    vis = pos[None, :] <= (hi[:, None] if causal else end - 1)
    if window:
        vis &= qpos[:, None] - pos[None, :] < window
    out = np.zeros((m, hq, d), F64)
    for h in range(hkv):
        k = kv_load(kc[slots, h], kv).astype(F64)  # [keys, D]
        v = kv_load(vc[slots, h], kv).astype(F64)
        s = np.einsum("mgd,nd->mgn", q[:, h * g : (h + 1) * g], k) * scale
        s = np.where(vis[:, None, :], s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        out[:, h * g : (h + 1) * g] = np.einsum("mgn,nd->mgd", s / s.sum(axis=-1, keepdims=True), v)
    return out


# ---- big random layout weights (full-size tests check a sample of units) -------------------------------------------
class LayoutWeight:
    """Random bytes in the t16x64 layout (every byte pattern is a valid NVFP4 code set), sane e4m3 block scales and
    per-tile inverse global scales; `rows(units)` dequantizes a few 16-row units for the reference."""

    def __init__(self, rng: np.random.Generator, n: int, k: int, order: str, experts: int = 1, gmax: float = 0.02):
        self.n, self.k, self.order, self.experts = n, k, order, experts
        self.w = rng.integers(0, 256, size=experts * n * k // 2, dtype=np.uint8)
        # e4m3 codes 0x20..0x47 = 0.125 .. 3.75: no NaN, realistic range
        self.s = rng.integers(0x20, 0x48, size=experts * n * k // 16, dtype=np.uint8)
        self.gscale = rng.uniform(gmax / 4, gmax, size=experts * n // 8).astype(np.float32)

    def rows(self, units: np.ndarray, expert: int = 0) -> np.ndarray:
        """Dequantized float64 rows [len(units)*16, K] of the given 16-row units of one expert."""
        n, k = self.n, self.k
        units = np.asarray(units)
        steps, nu = k // 64, n // 16
        wb, sb = n * k // 2, n * k // 16
        # step-major slab [steps][units][512 B] / [steps][units][64 B]: the selected units form a smaller layout
        w = self.w[expert * wb : (expert + 1) * wb].reshape(steps, nu, 512)[:, units].reshape(-1)
        s = self.s[expert * sb : (expert + 1) * sb].reshape(steps, nu, 64)[:, units].reshape(-1)
        packed, scale = L.unpack_nvfp4(w, s, 16 * len(units), k, self.order)
        dense = dequantize_nvfp4(packed, scale, 1.0).astype(F64).reshape(len(units), 2, 8, k)
        inv = self.gscale[expert * (n // 8) : (expert + 1) * (n // 8)].reshape(nu, 2)[units].astype(F64)
        return (dense * inv[:, :, None, None]).reshape(-1, k)

    def dense(self, expert: int = 0) -> np.ndarray:
        return self.rows(np.arange(self.n // 16), expert)
