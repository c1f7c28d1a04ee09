"""Test support: NumPy references of codegen's kernels (the GPU tests and the engine emulator compare against them).

Each reference states its tolerance next to it (TOL_*): normalised error ||out - ref|| / ||ref|| unless noted;
indices are exact. References compute in float64 and round where the kernel stores (f16/bf16/fp8), so the
tolerance covers only accumulation order and one output rounding.
"""

from __future__ import annotations

import numpy as np

from thorgen.model_spec.conventions import accepted_count
from thorgen.model_spec.nvfp4 import bf16_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e4m3

F32, F64 = np.float32, np.float64

# f32 outputs: accumulation order only; f16 (11-bit mantissa) and bf16 (8-bit) roundings; fp8 e4m3 (4-bit).
TOL = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3, "fp8e4m3": 6e-2}


def norm_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, F64), np.asarray(ref, F64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def store(x: np.ndarray, dtype: str) -> np.ndarray:
    """What the kernel stores for float values x: f32 as is, f16 (np.float16), bf16 / fp8 as raw bit patterns."""
    x = np.asarray(x, F32)
    if dtype == "f32":
        return x
    if dtype == "f16":
        return x.astype(np.float16)
    if dtype == "bf16":
        return f32_to_bf16(x)
    if dtype == "fp8e4m3":
        return f32_to_e4m3(x)
    raise ValueError(f"unknown dtype {dtype}")


def load(x: np.ndarray, dtype: str) -> np.ndarray:
    """Float32 values of a stored array (inverse of `store`)."""
    if dtype in ("f32", "f16"):
        return np.asarray(x, F32)
    if dtype == "bf16":
        return bf16_to_f32(x)
    if dtype == "fp8e4m3":
        return e4m3_to_f32(x)
    raise ValueError(f"unknown dtype {dtype}")


def np_dtype(dtype: str) -> type:
    return {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "fp8e4m3": np.uint8}[dtype]


# ---- embedding: exact (one float32 product per element) ----------------------------------------------------------
TOL_EMBED = 0.0


def embed_ref(ids: np.ndarray, table_bf16: np.ndarray, scale: float, mask_id: int = -1, block: int = 1) -> np.ndarray:
    """mask_id >= 0: DFlash blocks of `block` rows, each row 0 its ids entry and the others mask_id."""
    ids = np.asarray(ids).copy()
    if mask_id >= 0:
        ids[np.arange(len(ids)) % block > 0] = mask_id
    return bf16_to_f32(table_bf16[ids]) * F32(scale)


# ---- DFlash acceptance (exact: integers) -------------------------------------------------------------------------
def spec_accept_ref(
    ids: np.ndarray, targets: np.ndarray, start: int, most: int, emulate: int
) -> tuple[int, np.ndarray, np.ndarray, int]:
    """spec_accept.cu.j2 after a verify step at positions start..: ids[0..B) = [last, drafts], targets = out_ids:
    (the committed count n, the next block's positions, its sampled positions, its ids[0] = targets[n - 1])."""
    n = accepted_count([int(t) for t in ids[1:]], [int(t) for t in targets], most, None if emulate < 0 else emulate)
    nxt = start + n + np.arange(len(targets), dtype=np.int32)
    return n, nxt, nxt + 1, int(targets[n - 1])


# ---- RMSNorm variants (plain weight; eps inside the mean) -----------------------------------------------------
def rms(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    x64 = np.asarray(x, F64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, F64)


def rmsnorm_ref(x: np.ndarray, w_bf16: np.ndarray, eps: float) -> np.ndarray:
    return rms(x, bf16_to_f32(w_bf16), eps)


def add_rmsnorm_ref(x: np.ndarray, y: np.ndarray, w_bf16: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(x + y, rmsnorm(x + y) * w)."""
    s = np.asarray(x, F64) + np.asarray(y, F64)
    return s, rms(s, bf16_to_f32(w_bf16), eps)


def attn_tail_ref(o, x, w_post, w_pre1, w_pre2, eps: float):
    """(x + norm(o)*w_post, norm(x')*w_pre1, norm(x')*w_pre2)."""
    xn = np.asarray(x, F64) + rms(o, bf16_to_f32(w_post), eps)
    n = rms(xn, None, eps)
    return xn, n * bf16_to_f32(w_pre1), n * bf16_to_f32(w_pre2)


def ffn_tail_ref(mlp, moe, x, w1, w2, w, layer_scalar, w_next, eps: float):
    """(x' = (x + norm(norm(mlp)*w1 + norm(moe)*w2)*w) * layer_scalar, norm(x')*w_next or None)."""
    h = rms(rms(mlp, bf16_to_f32(w1), eps) + rms(moe, bf16_to_f32(w2), eps), bf16_to_f32(w), eps)
    xn = (np.asarray(x, F64) + h) * F64(bf16_to_f32(layer_scalar)[0])
    return xn, (None if w_next is None else rms(xn, bf16_to_f32(w_next), eps))


# ---- Q/K norm + RoPE + V norm + KV write ------------------------------------------------------------------------
def inv_freq(D: int, rot: int, theta: float) -> np.ndarray:
    """[D/2] (float64) with zeros for the non-rotating pairs (RopeSpec.inv_freq's formula)."""
    return np.array([1.0 / theta ** (2 * j / D) if j < rot else 0.0 for j in range(D // 2)], F64)


def rope(x: np.ndarray, positions: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """rotate_half RoPE on x [T, heads, D]; float64 angles, float32 cos/sin (the reference backend's tables)."""
    ang = np.asarray(positions, F64)[:, None] * freqs[None, :]
    cos, sin = np.cos(ang).astype(F32).astype(F64), np.sin(ang).astype(F32).astype(F64)
    cos, sin = np.concatenate([cos, cos], -1)[:, None, :], np.concatenate([sin, sin], -1)[:, None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def rope_kv_ref(
    q_raw, k_raw, v_raw, q_w, k_w, positions, *, HQ, HKV, D, rot, theta, has_q, v_from_k, v_norm, eps
) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
    """(q [T,HQ,D] or None, k rows [T,HKV,D], v rows [T,HKV,D]) in float64, before the cache store rounding."""
    T = len(positions)
    f = inv_freq(D, rot, theta)
    k = rope(rms(np.asarray(k_raw, F64).reshape(T, HKV, D), bf16_to_f32(k_w), eps), positions, f)
    vsrc = np.asarray(k_raw if v_from_k else v_raw, F64).reshape(T, HKV, D)
    v = rms(vsrc, None, eps) if v_norm else vsrc
    q = rope(rms(np.asarray(q_raw, F64).reshape(T, HQ, D), bf16_to_f32(q_w), eps), positions, f) if has_q else None
    return q, k, v


def cache_slots(positions: np.ndarray, slots: int) -> np.ndarray:
    return np.asarray(positions) % slots if slots else np.asarray(positions)


# ---- router -----------------------------------------------------------------------------------------------------
TOL_ROUTER_LOGITS = 1e-5
TOL_ROUTER_WEIGHTS = 1e-5


def router_logits_ref(x, scale_bf16, proj_bf16, eps: float) -> np.ndarray:
    H = x.shape[-1]
    hn = rms(x, None, eps) * bf16_to_f32(scale_bf16) * H**-0.5
    return hn @ bf16_to_f32(proj_bf16).astype(F64).T


def router_topk_ref(logits: np.ndarray, k: int, per_expert_scale_bf16: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(idx [T,k] exact: descending probability, ties -> lower id; weights [T,k])."""
    l64 = np.asarray(logits, F64)
    p = np.exp(l64 - l64.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    w = w / w.sum(-1, keepdims=True) * bf16_to_f32(per_expert_scale_bf16)[idx]
    return idx.astype(np.int32), w


# ---- lm_head epilogue -------------------------------------------------------------------------------------------
TOL_SOFTCAP = 0.0  # fp64 tanh rounded to f32 (EXACT); the fast variant is within 2 ulp


def softcap_ref(logits: np.ndarray, cap: float) -> np.ndarray:
    if not cap:
        return np.asarray(logits, F32)
    return (cap * np.tanh(np.asarray(logits, F64) / cap)).astype(F32)


def argmax_ref(capped: np.ndarray) -> np.ndarray:
    """Exact: first maximum (lowest id) of each row."""
    return np.argmax(capped, axis=-1).astype(np.int32)
