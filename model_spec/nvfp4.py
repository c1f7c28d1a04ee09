"""Model spec stage: NumPy NVFP4 (compressed-tensors `nvfp4-pack-quantized` and ModelOpt) and bf16 / fp8-e4m3 bits.

Convention (compressed-tensors 0.20, checked against its own functions in tests/test_nvfp4.py):
  * E2M1 code: sign = bit 3, magnitude index bits 0-2 into [0, .5, 1, 1.5, 2, 3, 4, 6].
  * Packing: element 2k of a row is the LOW nibble of byte k, element 2k+1 the high nibble.
  * One E4M3 (e4m3fn) block scale per 16 consecutive inputs (K), row-major [N, K/16].
  * One float32 global scale per projection, stored as a DIVISOR: global = 448*6 / amax(W).
  * Dequant: w = e2m1 * (e4m3(scale) / global), the quotient formed first in float32 as compressed-tensors does.
ModelOpt (NVFP4QTensor) differs only in its scalars: weight_scale_2 = amax/2688 is a MULTIPLIER, block scales are
clamped to [2^-9, 448] (an all-zero block gets 1.0), and w = e2m1 * (e4m3(scale) * weight_scale_2).
All conversions are vectorised (lookup tables and integer bit operations): they run over ~25e9 values for the
full model, so nothing here loops in Python over elements.
"""

from __future__ import annotations

import numpy as np

from .weight_layout import GROUP

E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32
)
# compressed-tensors replaces an all-zero block's scale (which would divide by zero) with this e4m3 value.
ZERO_BLOCK_SCALE = 0.125
MODELOPT_MIN_BLOCK_SCALE = 2.0**-9  # ModelOpt clamps block scales to [2^-9, 448] before the e4m3 cast
MODELOPT_ZERO_BLOCK_SCALE = 1.0


# ---- bf16 ---------------------------------------------------------------------------------------------------------


def bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), round-to-nearest-even; NaN stays a (quiet) NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # the rounding add could carry a NaN's payload into the sign/inf pattern
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


# ---- fp8 e4m3fn ---------------------------------------------------------------------------------------------------


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    exp, man, sign = (codes >> 3) & 0xF, codes & 7, np.where(codes & 0x80, -1.0, 1.0)
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    table = (sign * mag).astype(np.float32)
    table[[0x7F, 0xFF]] = np.nan  # e4m3fn has no infinities; only S.1111.111 is NaN
    return table


E4M3_TABLE = _e4m3_table()
E4M3_TABLE.flags.writeable = False


def e4m3_to_f32(u8: np.ndarray) -> np.ndarray:
    """e4m3fn bytes -> float32 (exact; 0x7F/0xFF -> NaN)."""
    return E4M3_TABLE[np.asarray(u8, dtype=np.uint8)]


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3fn bytes, round-to-nearest-even, saturating at +-448 (satfinite); NaN -> 0x7F|sign."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
    a = np.abs(x)
    # Normal range (>= 2^-6): round the 23-bit mantissa to 3 bits, ties to even, on the integer bit pattern.
    ab = a.view(np.uint32)
    r = (ab + (np.uint32(0x7FFFF) + ((ab >> np.uint32(20)) & np.uint32(1)))) & np.uint32(0xFFF00000)
    e = (r >> np.uint32(23)).astype(np.int32) - 127 + 7
    normal = (e << 3) | ((r >> np.uint32(20)) & np.uint32(7)).astype(np.int32)
    # Subnormal range: multiples of 2^-9; rint is round-half-even, and q == 8 is exactly the code of 2^-6.
    small = a < np.float32(2.0**-6)
    sub = np.rint(np.where(small, a, 0) * np.float32(512.0)).astype(np.int32)
    code = np.where(small, sub, normal)
    code = np.where(a > np.float32(E4M3_MAX), 0x7E, code)  # satfinite (also catches +-inf)
    code = np.where(np.isnan(x), 0x7F, np.clip(code, 0, 0x7E))
    return code.astype(np.uint8) | sign


# ---- E2M1 ---------------------------------------------------------------------------------------------------------


def round_e2m1(v: np.ndarray) -> np.ndarray:
    """float32 -> 4-bit E2M1 codes (uint8 0..15), round-to-nearest-even, clamped to +-6.

    Tie rule = compressed-tensors `cast_to_fp4` (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4:
    each tie goes to the code with an even mantissa). The sign bit is set for every value < 0, so a small
    negative value that rounds to zero is code 8 (-0) while an input -0.0 is code 0, exactly as
    compressed-tensors' `cast_to_fp4` + `pack_fp4_to_uint8` (and its Triton kernel) produce.
    """
    v = np.asarray(v, dtype=np.float32)
    m = np.abs(v)
    idx = (m > 0.25).astype(np.uint8) + (m >= 0.75) + (m > 1.25) + (m >= 1.75) + (m > 2.5) + (m >= 3.5) + (m > 5.0)
    return idx.astype(np.uint8) | ((v < 0).astype(np.uint8) << 3)


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[N, K] codes -> [N, K/2] bytes, element 2k in the low nibble."""
    codes = np.asarray(codes, dtype=np.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dimension {codes.shape[-1]} must be even")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[N, K/2] bytes -> [N, K] codes (uint8 0..15)."""
    packed = np.asarray(packed, dtype=np.uint8)
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = packed & 0xF
    out[..., 1::2] = packed >> 4
    return out


# ---- NVFP4 --------------------------------------------------------------------------------------------------------


def global_scale_for(amax: float) -> np.float32:
    """compressed-tensors `generate_gparam`: 448*6/amax in float32 (1.0 when it is not finite, e.g. amax 0)."""
    amax32 = max(np.float32(abs(amax)), np.finfo(np.float32).tiny)
    with np.errstate(over="ignore", invalid="ignore"):
        # torch evaluates `2688 / t` as `t.reciprocal() * 2688` (two float32 roundings); match it bit for bit.
        g = np.float32(E4M3_MAX * E2M1_MAX) * (np.float32(1.0) / np.float32(amax32))
    return np.float32(g) if np.isfinite(g) else np.float32(1.0)


def block_scales(w: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """e4m3 block-scale bytes [N, K/16] of float32 w [N, K] for a given global scale (zero blocks -> 0.125)."""
    n, k = w.shape
    amax = np.abs(w.reshape(n, k // GROUP, GROUP)).max(axis=2)
    s = (amax / np.float32(E2M1_MAX)).astype(np.float32) * np.float32(global_scale)
    codes = f32_to_e4m3(s)
    # Like compressed-tensors, a scale that is 0 after rounding to e4m3 becomes 0.125 (no division by zero).
    return np.where((codes & 0x7F) == 0, f32_to_e4m3(np.float32(ZERO_BLOCK_SCALE)), codes).astype(np.uint8)


def quantize_nvfp4(w: np.ndarray, global_scale: float | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """float32 W [N, K] -> (packed u8 [N, K/2], scale e4m3 u8 [N, K/16], global_scale f32).

    Same arithmetic as compressed-tensors (generate_gparam -> calculate_qparams -> NVFP4PackedCompressor):
    global = 2688/amax(W); block scale = e4m3(global * block_amax/6); q = rne_e2m1(w / (scale / global)).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantize_nvfp4: expected [N, K] with K a multiple of {GROUP}, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_nvfp4: weight contains NaN or inf")
    if global_scale is None:
        g = global_scale_for(float(np.abs(w).max()) if w.size else 0.0)
    else:
        g = np.float32(global_scale)
    scale_u8 = block_scales(w, g)
    n, k = w.shape
    eff = (e4m3_to_f32(scale_u8) / g).astype(np.float32)  # scale / global, formed first as compressed-tensors does
    v = w.reshape(n, k // GROUP, GROUP) / eff[:, :, None]
    codes = round_e2m1(np.clip(v, -E2M1_MAX, E2M1_MAX).reshape(n, k))
    return pack_e2m1(codes), scale_u8, np.float32(g)


def multiplier_of_divisor(global_scale: float) -> np.float32:
    """The multiplier a compressed-tensors divisor global scale stands for: float32(1) / float32(g), the one place
    where thorgen turns a divisor into the per-part multiplier the kernels and ModelOpt use."""
    return np.float32(np.float32(1.0) / np.float32(global_scale))


def dequantize_nvfp4(packed: np.ndarray, scale_u8: np.ndarray, global_scale: float) -> np.ndarray:
    """(packed u8 [N, K/2], scale u8 [N, K/16], global f32) -> float32 W [N, K] = e2m1 * (e4m3 / global)."""
    return _dequantize_with(packed, scale_u8, lambda s: (s / np.float32(global_scale)).astype(np.float32))


def dequantize_nvfp4_mul(packed: np.ndarray, scale_u8: np.ndarray, multiplier: float) -> np.ndarray:
    """(packed u8 [N, K/2], scale u8 [N, K/16], multiplier f32) -> float32 W = e2m1 * (e4m3 * multiplier), the
    ModelOpt dequantization (and the kernels' arithmetic: they multiply by a per-tile multiplier)."""
    return _dequantize_with(packed, scale_u8, lambda s: (s * np.float32(multiplier)).astype(np.float32))


def _dequantize_with(packed: np.ndarray, scale_u8: np.ndarray, effective) -> np.ndarray:
    packed = np.asarray(packed, dtype=np.uint8)
    scale_u8 = np.asarray(scale_u8, dtype=np.uint8)
    n, half = packed.shape
    k = half * 2
    if scale_u8.shape != (n, k // GROUP):
        raise ValueError(f"dequantize_nvfp4: scale shape {scale_u8.shape} does not match packed {packed.shape}")
    eff = effective(e4m3_to_f32(scale_u8))
    # byte -> (low value, high value) as one 8-byte table entry: a single flat gather decodes both nibbles.
    vals = np.take(_PAIR_TABLE, packed).view(np.float32).reshape(n, k // GROUP, GROUP)
    vals *= eff[:, :, None]
    return vals.reshape(n, k)


def modelopt_scale_2(amax: float) -> np.float32:
    """ModelOpt's weight_scale_2 of a tensor with this absolute max: amax / (6 * 448) in float32."""
    return np.float32(np.float32(abs(amax)) / np.float32(E4M3_MAX * E2M1_MAX))


def quantize_nvfp4_modelopt(w: np.ndarray, scale_2: float | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """float32 W [N, K] -> (packed u8 [N, K/2], scale e4m3 u8 [N, K/16], weight_scale_2 f32), ModelOpt's
    NVFP4QTensor arithmetic: scale_2 = amax/2688 (or the one given: gate and up share one);
    block scale = e4m3(clamp(block_amax / (6 * scale_2), 2^-9, 448)), an all-zero block 1.0;
    codes = rne_e2m1(w / (e4m3(block scale) * scale_2))."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"quantize_nvfp4_modelopt: expected [N, K] with K a multiple of {GROUP}, got {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize_nvfp4_modelopt: weight contains NaN or inf")
    s2 = modelopt_scale_2(float(np.abs(w).max()) if w.size else 0.0) if scale_2 is None else np.float32(scale_2)
    if not (np.isfinite(s2) and s2 > 0):
        raise ValueError(f"quantize_nvfp4_modelopt: weight_scale_2 {s2} must be finite and > 0 (an all-zero weight?)")
    n, k = w.shape
    blocks = w.reshape(n, k // GROUP, GROUP)
    amax = np.abs(blocks).max(axis=2)
    raw = (amax / (np.float32(E2M1_MAX) * s2)).astype(np.float32)
    scale = f32_to_e4m3(np.clip(raw, np.float32(MODELOPT_MIN_BLOCK_SCALE), np.float32(E4M3_MAX)))
    scale = np.where(amax == 0, f32_to_e4m3(np.float32(MODELOPT_ZERO_BLOCK_SCALE)), scale).astype(np.uint8)
    eff = (e4m3_to_f32(scale) * s2).astype(np.float32)
    codes = round_e2m1(np.clip(blocks / eff[:, :, None], -E2M1_MAX, E2M1_MAX).reshape(n, k))
    return pack_e2m1(codes), scale, np.float32(s2)


_PAIR_TABLE = (
    np.ascontiguousarray(np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=1))
    .view(np.uint64)
    .reshape(256)
)
