"""Runtime stage (reference backend): the engine's attention kernels in NumPy (attn_fwd's tiled online softmax, its
split-K workspace and attn_combine), with the blocking the built kernels use.

Scores are fp32 with exp2, probabilities rounded to bf16 (fp16 with fp8 caches) before P.V while the row sum keeps
them unrounded; the decode kernel's splits are merged as attn_combine does. W4A16Target (w4a16.py) and the emulated
engine (tests/emulated_kernels.py) both run these.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...model_spec.step_program import program_key
from .ops import F32, F64
from .rounding import round_to

ATTN_CHUNK = 256  # query rows per attention block (bounds the [rows, group, keys] score temporary)


@dataclass(frozen=True)
class AttnShape:
    """The blocking of one planned attention kernel (thorgen/attention.cuh): TK-key tiles, QB queries per block,
    NSPLIT key splits, the fp32 score factor scale * log2(e), and TPP: one query's parts hold at least TPP tiles."""

    tk: int
    qb: int
    nsplit: int
    scale_log2: float
    tpp: int = 1

    @classmethod
    def of(cls, params: dict) -> "AttnShape":
        """From an attn_fwd kernel's constants (mt, tk, nsplit, hq, hkv, scale_log2)."""
        g = int(params["hq"]) // int(params["hkv"])
        return cls(
            int(params["tk"]),
            16 * int(params["mt"]) // g,
            int(params["nsplit"]),
            float(params["scale_log2"]),
            int(params["tpp"]),
        )


def fma32(a, b, c) -> np.ndarray:
    """fmaf(a, b, c) of float32 operands (the product is exact in float64; one rounding to float32)."""
    a64, b64 = np.asarray(a, F32).astype(F64), np.asarray(b, F32).astype(F64)
    return (a64 * b64 + np.asarray(c, F32).astype(F64)).astype(F32)


def _online(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    row_lo: np.ndarray,
    row_hi: np.ndarray,
    t0: int,
    t1: int,
    shape: AttnShape,
    kv: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attn_fwd's online softmax of rows q [Hkv, R, D] over key tiles t0..t1-1 (absolute key j = tile*TK + i; keys
    and values [n, Hkv, D] hold positions 0..n-1): per tile fp32 scores (q.k) * scale_log2, running max, p =
    exp2(s - max) in fp32, P rounded to bf16 (fp16 for fp8 caches) for the P.V mma while the row sum l takes the
    unrounded p, O and l rescaled by exp2(m_old - m_new). Returns unnormalised O [Hkv, R, D], m [Hkv, R], l [Hkv, R]
    (float32). A tile with no visible key for a row leaves that row exactly unchanged, so the result of a row does
    not depend on which other rows share its block."""
    h, r, d = q.shape
    n, tk, sl2 = keys.shape[0], shape.tk, F32(shape.scale_log2)
    pdt = "f16" if kv == "fp8" else "bf16"
    o = np.zeros((h, r, d), F32)
    m = np.full((h, r), -np.inf, F32)
    l = np.zeros((h, r), F32)
    for tile in range(t0, t1):
        j = tile * tk + np.arange(tk)
        ok = (j >= 0) & (j < n)
        jj = np.where(ok, j, 0)
        kt = np.where(ok[:, None, None], keys[jj], 0).astype(F64).transpose(1, 0, 2)  # [Hkv, TK, D]
        vt = np.where(ok[:, None, None], values[jj], 0).astype(F64).transpose(1, 0, 2)
        vis = ok[None, :] & (j[None, :] >= row_lo[:, None]) & (j[None, :] <= row_hi[:, None])  # [R, TK]
        if not vis.any():
            continue
        s = (np.matmul(q, kt.transpose(0, 2, 1)).astype(F32) * sl2).astype(F32)
        s = np.where(vis[None], s, F32(-np.inf))
        m_new = np.maximum(m, s.max(-1))
        with np.errstate(invalid="ignore"):
            p = np.where(np.isneginf(s), F32(0), np.exp2((s - m_new[..., None]).astype(F32)).astype(F32))
            alpha = np.where(np.isneginf(m_new), F32(1), np.exp2((m - m_new).astype(F32)).astype(F32))
        pr = round_to(p, pdt)
        l = fma32(l, alpha, p.astype(F64).sum(-1).astype(F32))
        o = ((o * alpha[..., None]).astype(F32) + np.matmul(pr, vt).astype(F32)).astype(F32)
        m = m_new.astype(F32)
    return o, m, l


def _bounds(qpos: np.ndarray, window: int | None) -> tuple[np.ndarray, np.ndarray]:
    lo = np.maximum(0, qpos - window + 1) if window else np.zeros_like(qpos)
    return lo, qpos


def _as_rows(q: np.ndarray, hkv: int, kv: str) -> np.ndarray:
    m, hq, d = q.shape
    q = np.asarray(q, F64)
    if kv == "fp8":  # the fp8 kernel runs fp16 mma: queries bf16 -> fp16
        q = round_to(q, "f16")
    return q.reshape(m, hkv, hq // hkv, d).transpose(1, 0, 2, 3).reshape(hkv, m * (hq // hkv), d)


def _from_rows(x: np.ndarray, m: int, hq: int) -> np.ndarray:
    hkv, _, d = x.shape
    return x.reshape(hkv, m, hq // hkv, d).transpose(1, 0, 2, 3).reshape(m, hq, d)


def attention_rows(
    q: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    p0: int,
    window: int | None,
    shape: AttnShape,
    kv: str,
    kv_hi: np.ndarray | None = None,
) -> np.ndarray:
    """Output [m, Hq, D] (fp16 values, float64) of an attn_fwd launch with NSPLIT == 1 for causal queries q
    [m, Hq, D] at positions p0.. over keys/values [n, Hkv, D] of positions 0..n-1: O * (1/l) in fp32, then fp16.
    `kv_hi` (the KV_HI kernel: a chunk holding image spans): query i sees keys up to max(p0 + i, kv_hi[i])."""
    m, hq, d = q.shape
    hkv, g = keys.shape[1], hq // keys.shape[1]
    out = np.empty((m, hq, d), F64)
    for a in range(0, m, ATTN_CHUNK):
        b = min(m, a + ATTN_CHUNK)
        lo, hi = _bounds(p0 + np.arange(a, b), window)
        if kv_hi is not None:
            hi = np.maximum(hi, np.asarray(kv_hi[a:b], np.int64))
        o, _, l = _online(
            _as_rows(q[a:b], hkv, kv),
            keys,
            values,
            np.repeat(lo, g),
            np.repeat(hi, g),
            int(lo.min()) // shape.tk,
            int(hi.max()) // shape.tk + 1,
            shape,
            kv,
        )
        with np.errstate(divide="ignore"):
            inv = np.where(l > 0, (F32(1) / l).astype(F32), F32(0))
        out[a:b] = _from_rows(round_to((o * inv[..., None]).astype(F32), "f16"), b - a, hq)
    return out


def split_chunks(t_lo: int, ntiles: int, shape: AttnShape) -> int:
    """Chunks of TPP key tiles (chunk c = tiles [c TPP, (c + 1) TPP)) that tiles t_lo .. t_lo + ntiles - 1 touch:
    one query's parts when there are at most NSPLIT (attention.cuh's nchunks)."""
    return (t_lo + ntiles - 1) // shape.tpp - t_lo // shape.tpp + 1


def _part(z: int, t_lo: int, ntiles: int, shape: AttnShape) -> int:
    """First key tile of split part z (attention.cuh's part_begin)."""
    if split_chunks(t_lo, ntiles, shape) <= shape.nsplit:
        return min(max(t_lo, (t_lo // shape.tpp + z) * shape.tpp), t_lo + ntiles)
    return t_lo + z * ntiles // shape.nsplit


def attention_partials(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, p0: int, window: int | None, shape: AttnShape, kv: str
) -> tuple[np.ndarray, np.ndarray]:
    """The flash-decoding workspace of an attn_fwd launch with NSPLIT > 1: per split unnormalised O [NS, m, Hq, D]
    and (max, sum) [NS, m, Hq, 2] (float32; an empty split: (-inf, 0), O = 0). Splits cut each query block's tile
    range [lo(first query) / TK, last visible key / TK] into parts as the kernel does: its chunks of TPP tiles (chunk c
    = tiles [c TPP, (c + 1) TPP)) when there are at most NSPLIT of them, else NSPLIT even parts."""
    m, hq, d = q.shape
    hkv, g, ns = keys.shape[1], hq // keys.shape[1], shape.nsplit
    o = np.zeros((ns, m, hq, d), F32)
    ml = np.zeros((ns, m, hq, 2), F32)
    ml[..., 0] = -np.inf
    for q0 in range(0, m, shape.qb):
        q1 = min(m, q0 + shape.qb)
        lo, hi = _bounds(p0 + np.arange(q0, q1), window)
        t_lo = int(lo[0]) // shape.tk
        ntiles = int(hi[-1]) // shape.tk - t_lo + 1
        rows = _as_rows(q[q0:q1], hkv, kv)
        for z in range(ns):
            tb, te = _part(z, t_lo, ntiles, shape), _part(z + 1, t_lo, ntiles, shape)
            if tb >= te:
                continue
            oz, mz, lz = _online(rows, keys, values, np.repeat(lo, g), np.repeat(hi, g), tb, te, shape, kv)
            o[z, q0:q1] = _from_rows(oz, q1 - q0, hq)
            ml[z, q0:q1, :, 0] = _from_rows(mz[..., None], q1 - q0, hq)[..., 0]
            ml[z, q0:q1, :, 1] = _from_rows(lz[..., None], q1 - q0, hq)[..., 0]
    return o, ml


def attention_combine(o: np.ndarray, ml: np.ndarray) -> np.ndarray:
    """attn_combine: the splits with l > 0 merged in split order in fp32 (acc / lsum), stored fp16 (float64)."""
    live = ml[..., 1] > 0
    mx = np.where(live, ml[..., 0], F32(-np.inf)).max(0)
    acc = np.zeros(o.shape[1:], F32)
    lsum = np.zeros(o.shape[1:-1], F32)
    with np.errstate(invalid="ignore"):
        for z in range(o.shape[0]):
            e = np.where(live[z], np.exp2((ml[z, ..., 0] - mx).astype(F32)).astype(F32), F32(0))
            lsum = np.where(live[z], fma32(ml[z, ..., 1], e, lsum), lsum)
            acc = np.where(live[z][..., None], fma32(o[z], e[..., None], acc), acc)
        res = np.where(lsum[..., None] > 0, (acc / lsum[..., None]).astype(F32), F32(0))
    return round_to(res, "f16")


def attention_shapes(spec, manifest, kv_dtype: str) -> dict[str, tuple[AttnShape, AttnShape]]:
    """{layer type: (decode/verify kernel shape, prefill kernel shape)} of the attention kernels the manifest's step
    programs launch (thorgen.runtime.manifest.KernelManifest): the reference follows the blocking the engine runs."""
    t, kv = spec.target, {"bf16": "bf16", "fp8": "fp8e4m3"}[kv_dtype]
    programs = manifest.programs.get(kv, {})
    try:  # a decode step, and the widest prefill chunk range
        dec, pre = programs[program_key(decode=True)][0], programs[program_key(last=True)][-1]
    except KeyError:
        raise ValueError(
            f"the kernel manifest {manifest.path} has no decode and prefill step programs for "
            f"KV {kv}; rebuild with `thorgen build`"
        ) from None
    out = {}
    for l, kind in enumerate(t.layer_types):
        if kind in out:
            continue
        shapes = []
        for prog in (dec, pre):
            name = next((op["kernel"] for op in prog["launches"] if op["label"] == f"layers.{l}.attention"), None)
            if name is None or name not in manifest.kernels:
                raise ValueError(
                    f"the kernel manifest {manifest.path}: no attention kernel of layer {l} in its "
                    f"{prog['lo']}-{prog['hi']}-row program"
                )
            shapes.append(AttnShape.of(manifest.kernels[name].params))
        out[kind] = (shapes[0], shapes[1])
    return out
