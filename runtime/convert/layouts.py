"""Runtime stage: NumPy packers from checkpoint weights into the GPU kernels' weight layouts (and unpackers).

NVFP4 tile layout "t16x64" (the NVFP4 GEMM / GEMV / MoE kernels; KernelSpec param `w_layout`; its sizes and byte
orders are model_spec/weight_layout.py's, which codegen renders into the kernels too):
  A weight W [N, K] (checkpoint: packed u8 [N, K/2], element 2k in the low nibble; e4m3 scales u8 [N, K/16]) is
  cut into units of 16 output rows x 64 inputs ("steps"). Unit u, step s is 512 contiguous bytes: 32 lanes x 16 B,
  stored step-major ([K/64][N/16][32][16 B]): warps of neighbouring units run at about the same step, so together they
  stream contiguous megabytes (DRAM page locality), not thousands of scattered 512-B chunks.
  Lane L = 4*gid + t4 holds, for rows n0 = 16u + gid (tile 0) and n0 + 8 (tile 1), the 16 codes of inputs
  k = 64s + 16*t4 + e (e = 0..15): exactly one e4m3 scale block per row, so the lane needs 2 scale bytes per step.
  The kernel feeds code e = 4j + 2h + {0, 1} to k-tile j, fragment register h of mma.m16n8k16; the activations are
  read with the same permutation of k inside each 16-block (the dot product does not care about the order).
  Byte order inside a lane's 8 bytes of one tile, per `order`:
    "nat"   : the checkpoint's own 8 bytes (byte b = codes 2b | 2b+1 << 4): one hardware cvt.e2m1x2 per byte (sm_100+).
    "shift" : two little-endian words, word w for codes 8w..8w+7; register r of the word = codes (8w+2r, 8w+2r+1),
              element 0 in the low 16 bits, element 1 in the high 16; per half, r's 3-bit magnitude / sign bit sit at
              bits (9, 15), (6, 12), (3, 14), (0, 13) for r = 0..3, so sm_90 decodes with one mask (r=0), a shift and
              a mask (r=1) or two shifts and a LOP3 (r=2, 3) into fp16 bits whose value is e2m1 * 2^-14 (exact).
  Scales: [K/64][N/16][32 lanes][2 B] = (scale of tile-0 row, scale of tile-1 row) for the lane's 16-block.
  Global scales: f32 per 8-row tile, the part's global MULTIPLIER as Checkpoint.nvfp4_parts hands it out
  (compressed-tensors: float32(1)/weight_global_scale; ModelOpt: weight_scale_2); fused weights (q|k|v, interleaved
  gate/up) carry each part's own multiplier, so nothing is rescaled and nothing here inverts a scale.
Half-precision tile layout (drafter bf16 linears): fp16 (converted from bf16 once) in the same step-major tiling,
[K/64][N/16][32 lanes][64 B]: lane L's 64 B = row 16u+gid, inputs 64s+16*t4 .. +16 (32 B), then row 16u+8+gid.
Gate/up pairs of both kinds are fused by interleaving 8-row tiles (gate tile i, up tile i, ...), so one 16-row unit
yields gate and up of the same 8 outputs.
"""

from __future__ import annotations

import numpy as np

from ...model_spec.nvfp4 import bf16_to_f32, pack_e2m1, unpack_e2m1
from ...model_spec.weight_layout import FP4_ORDERS, GROUP, GSCALE_ROWS, SHIFT_POS, TILE_K, TILE_N, W_LAYOUT, fits_tile

LAYOUT_VERSION = 2  # bump on any change of the bytes these packers produce (2: step-major units)
PLAN_VERSION = 3  # bump when convert/plan.py changes which tensors it writes or how it fuses them


def layout_version() -> int:
    """Version of everything that decides the bytes of weights.bin: these packers and convert/plan.py."""
    return PLAN_VERSION * 1000 + LAYOUT_VERSION


class LayoutError(ValueError):
    """A weight that does not fit a kernel layout (shape not divisible, wrong dtype or order)."""


def _check_nvfp4(packed: np.ndarray, scale: np.ndarray, order: str) -> tuple[int, int]:
    if order not in FP4_ORDERS:
        raise LayoutError(f"unknown fp4 order {order!r} (expected one of {FP4_ORDERS})")
    packed = np.asarray(packed)
    scale = np.asarray(scale)
    if packed.dtype != np.uint8 or scale.dtype != np.uint8 or packed.ndim != 2 or scale.ndim != 2:
        raise LayoutError(
            f"expected uint8 packed [N, K/2] and scale [N, K/16], got {packed.dtype}{packed.shape} "
            f"and {scale.dtype}{scale.shape}"
        )
    n, k = packed.shape[0], packed.shape[1] * 2
    if scale.shape != (n, k // GROUP):
        raise LayoutError(f"scale shape {scale.shape} does not match packed {packed.shape} (want {(n, k // GROUP)})")
    if not fits_tile(n, k):
        raise LayoutError(f"NVFP4 layout {W_LAYOUT} needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got N={n} K={k}")
    return n, k


def _shift_words(codes: np.ndarray) -> np.ndarray:
    """codes [..., 8] (uint8 0..15) -> uint32 [...] in the "shift" bit order."""
    c = codes.astype(np.uint32)
    word = np.zeros(codes.shape[:-1], dtype=np.uint32)
    for r, (mpos, spos) in enumerate(SHIFT_POS):
        for half, elem in ((0, 2 * r), (16, 2 * r + 1)):
            x = c[..., elem]
            word |= ((x & 7) << np.uint32(mpos + half)) | ((x >> 3) << np.uint32(spos + half))
    return word


def _unshift_words(words: np.ndarray) -> np.ndarray:
    """Inverse of _shift_words: uint32 [...] -> codes [..., 8]."""
    w = words.astype(np.uint32)
    out = np.empty(words.shape + (8,), dtype=np.uint8)
    for r, (mpos, spos) in enumerate(SHIFT_POS):
        for half, elem in ((0, 2 * r), (16, 2 * r + 1)):
            mag = (w >> np.uint32(mpos + half)) & 7
            sign = (w >> np.uint32(spos + half)) & 1
            out[..., elem] = (mag | (sign << 3)).astype(np.uint8)
    return out


def pack_nvfp4(packed: np.ndarray, scale: np.ndarray, order: str) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint NVFP4 (packed u8 [N, K/2], scale u8 [N, K/16]) -> (weights u8 [N*K/2], scales u8 [N*K/16])."""
    n, k = _check_nvfp4(packed, scale, order)
    units, steps = n // TILE_N, k // TILE_K
    # [unit, tile, gid, step, t4, 8 bytes] -> [step, unit, gid, t4, tile, 8 bytes] (lane = 4*gid + t4); the 8 bytes
    # of a lane group move as one uint64 element, not eight byte elements
    lanes = np.ascontiguousarray(packed).view(np.uint64).reshape(units, 2, 8, steps, 4).transpose(3, 0, 2, 4, 1)
    w = np.ascontiguousarray(lanes).reshape(-1).view(np.uint8)
    if order == "shift":
        codes = unpack_e2m1(w.reshape(-1, 8)).reshape(-1, 2, 8)  # [.., word, 8 codes]
        w = _shift_words(codes).view(np.uint8).reshape(-1)
    s = np.asarray(scale).reshape(units, 2, 8, steps, 4).transpose(3, 0, 2, 4, 1)
    return w, np.ascontiguousarray(s).reshape(-1)


def unpack_nvfp4(w: np.ndarray, s: np.ndarray, n: int, k: int, order: str) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_nvfp4: (weights, scales) of an [N, K] matrix -> (packed u8 [N, K/2], scale u8 [N, K/16])."""
    if order not in FP4_ORDERS:
        raise LayoutError(f"unknown fp4 order {order!r} (expected one of {FP4_ORDERS})")
    if not fits_tile(n, k):
        raise LayoutError(f"N={n} K={k} not divisible by the {W_LAYOUT} tile")
    w = np.asarray(w, dtype=np.uint8).reshape(-1)
    s = np.asarray(s, dtype=np.uint8).reshape(-1)
    if w.size != n * k // 2 or s.size != n * k // GROUP:
        raise LayoutError(f"sizes {w.size}/{s.size} do not match N={n} K={k}")
    units, steps = n // TILE_N, k // TILE_K
    if order == "shift":
        codes = _unshift_words(np.ascontiguousarray(w).view(np.uint32).reshape(-1, 2)).reshape(-1, 16)
        w = pack_e2m1(codes).reshape(-1)
    packed = w.reshape(steps, units, 8, 4, 2, 8).transpose(1, 4, 2, 0, 3, 5).reshape(n, k // 2)
    scale = s.reshape(steps, units, 8, 4, 2).transpose(1, 4, 2, 0, 3).reshape(n, k // GROUP)
    return np.ascontiguousarray(packed), np.ascontiguousarray(scale)


def tile_gscales(parts: list[tuple[int, float]]) -> np.ndarray:
    """Per-8-row-tile global multipliers for a weight made of consecutive parts [(rows, multiplier), ...]."""
    out = []
    for rows, m in parts:
        if rows % GSCALE_ROWS:
            raise LayoutError(f"a fused part of {rows} rows is not a multiple of {GSCALE_ROWS}")
        if not np.isfinite(m) or m <= 0:
            raise LayoutError(f"global multiplier {m} must be positive and finite")
        out.append(np.full(rows // GSCALE_ROWS, np.float32(m), dtype=np.float32))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


def interleave8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Rows of a and b (same shape [N, ...]) interleaved in 8-row tiles: a[0:8], b[0:8], a[8:16], b[8:16], ..."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.shape[0] % 8:
        raise LayoutError(f"interleave8 needs equal shapes with rows % 8 == 0, got {a.shape} and {b.shape}")
    n = a.shape[0]
    return np.stack([a.reshape(n // 8, 8, *a.shape[1:]), b.reshape(n // 8, 8, *b.shape[1:])], axis=1).reshape(
        2 * n, *a.shape[1:]
    )


def deinterleave8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of interleave8."""
    x = np.asarray(x)
    if x.shape[0] % 16:
        raise LayoutError(f"deinterleave8 needs rows % 16 == 0, got {x.shape}")
    t = x.reshape(x.shape[0] // 16, 2, 8, *x.shape[1:])
    return (
        np.ascontiguousarray(t[:, 0]).reshape(-1, *x.shape[1:]),
        np.ascontiguousarray(t[:, 1]).reshape(-1, *x.shape[1:]),
    )


def pack_nvfp4_gate_up(
    gate: tuple[np.ndarray, np.ndarray, float], up: tuple[np.ndarray, np.ndarray, float], order: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fused gate/up weight (gate tile, up tile, ...) from (packed, scale, multiplier) parts -> (weights, scales,
    per-tile multipliers: gate's and up's alternating)."""
    (gp, gs, gm), (up_, us, um) = gate, up
    w, s = pack_nvfp4(interleave8(gp, up_), interleave8(gs, us), order)
    n = np.asarray(gp).shape[0]
    tiles = np.empty(n // 4, dtype=np.float32)
    tiles[0::2] = np.float32(gm)
    tiles[1::2] = np.float32(um)
    return w, s, tiles


def pack_nvfp4_concat(
    parts: list[tuple[np.ndarray, np.ndarray, float]], order: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Several projections of one input stacked along N (e.g. q|k|v), each (packed, scale, multiplier) ->
    (weights, scales, per-tile multipliers)."""
    packed = np.concatenate([np.asarray(p) for p, _, _ in parts], axis=0)
    scale = np.concatenate([np.asarray(s) for _, s, _ in parts], axis=0)
    w, s = pack_nvfp4(packed, scale, order)
    return w, s, tile_gscales([(np.asarray(p).shape[0], float(g)) for p, _, g in parts])


# ---- half-precision weights (drafter) -------------------------------------------------------------------------------


def bf16_to_f16_bits(w_bf16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns [N, K] -> fp16 bit patterns (uint16), round to nearest even; LayoutError on overflow."""
    f = bf16_to_f32(w_bf16)
    with np.errstate(over="ignore"):
        h = f.astype(np.float16)
    if not np.isfinite(h[np.isfinite(f)]).all():
        raise LayoutError("a bf16 weight exceeds the fp16 range (|w| > 65504); it cannot use the fp16 GEMM")
    return h.view(np.uint16)


def pack_half(w_bits: np.ndarray) -> np.ndarray:
    """fp16 bits [N, K] -> the half GEMM layout (uint16, flattened; N % 16 == 0, K % 64 == 0)."""
    w = np.asarray(w_bits)
    if w.ndim != 2 or w.dtype != np.uint16:
        raise LayoutError(f"expected uint16 [N, K] fp16 bits, got {w.dtype}{w.shape}")
    n, k = w.shape
    if not fits_tile(n, k):
        raise LayoutError(f"half layout needs N % {TILE_N} == 0 and K % {TILE_K} == 0, got {w.shape}")
    # [unit, tile, gid, step, t4, 16 halves] -> [step, unit, gid, t4, tile, 16 halves]
    t = w.reshape(n // TILE_N, 2, 8, k // TILE_K, 4, 16).transpose(3, 0, 2, 4, 1, 5)
    return np.ascontiguousarray(t).reshape(-1)


def unpack_half(flat: np.ndarray, n: int, k: int) -> np.ndarray:
    """Inverse of pack_half -> fp16 bits [N, K]."""
    t = np.asarray(flat, dtype=np.uint16).reshape(k // TILE_K, n // TILE_N, 8, 4, 2, 16).transpose(1, 4, 2, 0, 3, 5)
    return np.ascontiguousarray(t).reshape(n, k)


def pack_half_gate_up(gate_bits: np.ndarray, up_bits: np.ndarray) -> np.ndarray:
    """Fused gate/up fp16 weight in 8-row tiles (gate tile, up tile, ...), flattened."""
    return pack_half(interleave8(gate_bits, up_bits))
