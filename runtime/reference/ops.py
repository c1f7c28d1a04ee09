"""Runtime stage (reference backend): the NumPy numerical primitives shared by the target and drafter forwards.

Numerics policy: activations are stored as float32, but every reduction (matmul dot products, RMSNorm means,
softmax sums) is accumulated in float64 and rounded once to float32. That makes a row's result independent of
how many rows are computed together (prefill vs one-token decode vs a 16-token verify), so speculative and
plain decoding see the same logits up to a final float32 rounding, and the reference stays well inside the
1e-4 tolerance against HF's float32 forward.
"""

from __future__ import annotations

import math

import numpy as np

F32 = np.float32
F64 = np.float64


MM_CHUNK = 8192  # output rows converted to float64 at a time (bounds the temporary for the 262144-row lm_head)


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`x @ w.T` for a Linear weight w [out, in]; float64 accumulation, float32 result."""
    x64 = x.astype(F64)
    if w.shape[0] <= MM_CHUNK:
        return (x64 @ w.astype(F64).T).astype(F32)
    out = np.empty(x.shape[:-1] + (w.shape[0],), dtype=F32)
    for s in range(0, w.shape[0], MM_CHUNK):
        out[..., s : s + MM_CHUNK] = x64 @ w[s : s + MM_CHUNK].astype(F64).T
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """x * (mean(x^2) + eps)^-0.5 * weight over the last axis (plain weight, no 1 + w; None: no weight)."""
    x64 = x.astype(F64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    out = (x64 * inv).astype(F32)
    if weight is not None:
        out = out * weight.astype(F32)
    return out


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (gelu_pytorch_tanh)."""
    x64 = x.astype(F64)
    inner = math.sqrt(2.0 / math.pi) * (x64 + 0.044715 * x64**3)
    return (0.5 * x64 * (1.0 + np.tanh(inner))).astype(F32)


def silu(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(F64)
    return (x64 / (1.0 + np.exp(-x64))).astype(F32)


def softcap(logits: np.ndarray, cap: float | None) -> np.ndarray:
    """cap * tanh(logits / cap); identity when cap is None or 0."""
    if not cap:
        return logits.astype(F32)
    return (cap * np.tanh(logits.astype(F64) / cap)).astype(F32)


def rope_cos_sin(positions: np.ndarray, inv_freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [T, D] for rotate_half pairing (i, i + D/2); angles in float64 (exact positions).

    inv_freq has length D/2; zero entries (proportional RoPE's non-rotating pairs) give cos 1, sin 0.
    """
    ang = positions.astype(F64)[:, None] * inv_freq.astype(F64)[None, :]
    ang = np.concatenate([ang, ang], axis=-1)
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, heads, D] rotated NeoX-style: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (x * cos[:, None, :] + rot * sin[:, None, :]).astype(F32)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray, scale: float) -> np.ndarray:
    """Grouped-query attention, one query row at a time over exactly its visible keys.

    q [Tq, Hq, D], k/v [Tk, Hkv, D], visible bool [Tq, Tk]. Looping over rows and slicing the visible keys
    (instead of adding -inf) keeps each row's arithmetic identical whatever else is in the batch.
    Returns [Tq, Hq * D] float32.
    """
    tq, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = np.empty((tq, hq, v.shape[-1]), dtype=F32)
    k64, v64 = k.astype(F64), v.astype(F64)
    for i in range(tq):
        idx = np.flatnonzero(visible[i])
        if idx.size == 0:
            raise ValueError(f"attention row {i} sees no key")
        if idx[-1] - idx[0] + 1 == idx.size:  # causal/window/bidirectional masks are one contiguous run
            kk, vv = k64[idx[0] : idx[-1] + 1], v64[idx[0] : idx[-1] + 1]  # [n, Hkv, D] views, no copy
        else:
            kk, vv = k64[idx], v64[idx]
        qi = q[i].astype(F64).reshape(hkv, group, d)
        scores = np.einsum("hgd,nhd->hgn", qi, kk) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
        out[i] = np.einsum("hgn,nhd->hgd", p, vv).reshape(hq, -1).astype(F32)
    return out.reshape(tq, -1)


def window_visible(
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    causal: bool,
    window: int | None,
    q_block: np.ndarray | None = None,
    k_block: np.ndarray | None = None,
) -> np.ndarray:
    """Visibility [Tq, Tk]: causal -> j <= i; window W -> i - j < W (inclusive of self: W keys).

    q_block / k_block (block id per position, -1 for text): a query also sees the later keys of its own block
    (an image's tokens see each other both ways), still subject to the window: (causal OR same block) AND window.
    """
    diff = q_pos[:, None] - k_pos[None, :]
    vis = np.ones(diff.shape, dtype=bool)
    if causal:
        vis &= diff >= 0
        if q_block is not None and k_block is not None:
            vis |= (q_block[:, None] == k_block[None, :]) & (q_block[:, None] >= 0)
    if window is not None:
        vis &= diff < window
    return vis
