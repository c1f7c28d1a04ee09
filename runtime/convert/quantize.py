"""Runtime stage: bf16 weights -> compressed-tensors NVFP4 (and the quantization error) in cache-sized row blocks.

Same arithmetic and bytes as model_spec/nvfp4.py `quantize_nvfp4` on the widened weight (tests/test_quantize_bf16.py
checks it against a float64 reference of the NVFP4 rules), organised for the ~25e9 values of the full model on many
processes at once:
  * the absolute maxima (global and per 16-block) come from the bf16 bit patterns (finite bf16 values order like
    their bits with the sign cleared), so no float copy of the matrix exists for them;
  * everything per element runs over blocks of rows of at most BLOCK_ELEMENTS values, through buffers allocated once
    per matrix (in place, `out=`): the temporaries stay in the core's cache instead of streaming whole-matrix arrays
    through memory and page-faulting fresh allocations, which is what stops many worker processes from scaling;
  * the error statistics accumulate per block in float64 with NumPy's own reductions; no BLAS call (np.dot /
    np.linalg.norm), whose thread pool in every one of 16 worker processes oversubscribes the cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ...model_spec.nvfp4 import (
    E2M1_MAX,
    E2M1_VALUES,
    ZERO_BLOCK_SCALE,
    bf16_to_f32,
    e4m3_to_f32,
    f32_to_e4m3,
    global_scale_for,
)
from ...model_spec.weight_layout import GROUP

BLOCK_ELEMENTS = 1 << 16  # values per row block: its float32 temporaries (256 KiB each) stay in L2
_BF16_ABS = np.uint16(0x7FFF)
_BF16_INF = 0x7F80  # |bits| >= this: inf or NaN
# E2M1 magnitude index = how many of these the magnitude passes (compressed-tensors' ties: > at 0.25, 1.25, 2.5,
# 5.0 rounds ties down to the even code, >= at 0.75, 1.75, 3.5 rounds them up).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
# byte -> its two decoded E2M1 values (low nibble first) as one 8-byte word: one gather decodes a packed byte.
_PAIR_VALUES = np.ascontiguousarray(
    np.stack([E2M1_VALUES[np.arange(256) & 0xF], E2M1_VALUES[np.arange(256) >> 4]], axis=1)
).view(np.uint64)[:, 0]


@dataclass
class QuantizedBf16:
    """One quantized matrix: packed e2m1 codes u8 [N, K/2], e4m3 block scales u8 [N, K/16], the divisor global
    scale, and (when asked for; else empty) the error of the dequantized weight against the bf16 one:
    {"max_rel": max|Wq - W| / max|W|, "rms_rel": ||Wq - W|| / ||W||}."""

    packed: np.ndarray
    scale: np.ndarray
    global_scale: np.float32
    error: dict[str, float]


def block_amax_bits(w_bits: np.ndarray) -> np.ndarray:
    """bf16 bits [N, K] -> the bit pattern of each 16-block's absolute max, uint16 [N, K/16] (row blocks)."""
    n, k = w_bits.shape
    out = np.empty((n, k // GROUP), np.uint16)
    rows = _block_rows(k)
    buf = np.empty(rows * k, np.uint16)
    for r in range(0, n, rows):
        m = min(rows, n - r)
        a = buf[: m * k].reshape(m, k)
        np.bitwise_and(w_bits[r : r + m], _BF16_ABS, out=a)
        # A column at a time (strided over the blocks), not a reduction over each block's 16 values: NumPy runs
        # a reduction's inner loop once per 16-value block, which costs more than the maxima themselves.
        cols, top = a.reshape(m * k // GROUP, GROUP), out[r : r + m].reshape(-1)
        np.maximum(cols[:, 0], cols[:, 1], out=top)
        for j in range(2, GROUP):
            np.maximum(top, cols[:, j], out=top)
    return out


def quantize_bf16(w_bits: np.ndarray, global_scale: float | None = None, with_error: bool = False) -> QuantizedBf16:
    """bf16 bits [N, K] (uint16, any strides: a memory-mapped checkpoint tensor or a column slice of one) ->
    NVFP4 exactly as `quantize_nvfp4(bf16_to_f32(w_bits), global_scale)` gives it (global scale 2688/amax(W)
    unless one is given), plus the quantization error when with_error. ValueError on a bad shape or inf/NaN."""
    w_bits = np.asarray(w_bits)
    if w_bits.dtype != np.uint16 or w_bits.ndim != 2 or w_bits.shape[1] % GROUP:
        raise ValueError(
            f"quantize_bf16: expected uint16 bf16 bits [N, K] with K a multiple of {GROUP}, "
            f"got {w_bits.dtype}{w_bits.shape}"
        )
    n, k = w_bits.shape
    amax_bits = block_amax_bits(w_bits)
    top = int(amax_bits.max()) if amax_bits.size else 0
    if top >= _BF16_INF:
        raise ValueError("quantize_bf16: weight contains NaN or inf")
    amax = float(bf16_to_f32(np.array([top], np.uint16))[0])
    g = global_scale_for(amax) if global_scale is None else np.float32(global_scale)
    if not (np.isfinite(g) and g > 0):
        raise ValueError(f"quantize_bf16: global scale {g} must be finite and > 0")
    scale = block_scale_codes(bf16_to_f32(amax_bits), g)
    eff = (e4m3_to_f32(scale) / g).astype(np.float32)  # scale / global, formed first as compressed-tensors does
    packed = np.empty((n, k // 2), np.uint8)
    stats = _ErrorSums() if with_error else None
    work = _Work(_block_rows(k), k)
    for r in range(0, n, work.rows):
        m = min(work.rows, n - r)
        x = work.widen(w_bits[r : r + m])
        codes = work.codes(x, eff[r : r + m])
        work.pack(codes, packed[r : r + m])
        if stats is not None:
            stats.add(work, x, packed[r : r + m], eff[r : r + m])
    error: dict[str, float] = {}
    if stats is not None:
        error = {
            "max_rel": stats.max_abs / amax if amax else 0.0,
            "rms_rel": math.sqrt(stats.diff_sq) / math.sqrt(stats.w_sq) if stats.w_sq else 0.0,
        }
    return QuantizedBf16(packed, scale, np.float32(g), error)


def block_scale_codes(amax: np.ndarray, global_scale: np.float32) -> np.ndarray:
    """e4m3 block-scale bytes of blocks with these absolute maxima (float32 >= 0): e4m3(float32(amax / 6) *
    global), round-to-nearest-even, saturating at 448, a zero replaced by 0.125, i.e. model_spec/nvfp4.py
    `block_scales`; its f32_to_e4m3 in a third of the passes, as every scale here is finite and non-negative."""
    s = (np.asarray(amax, np.float32) / np.float32(E2M1_MAX)).astype(np.float32)
    s *= np.float32(global_scale)
    bits = s.view(np.uint32)
    # Normal range: round the mantissa to 3 bits (ties to even) on the bit pattern; then (exponent, mantissa) >> 20
    # minus the bias difference (127 - 7) << 3 is the e4m3 code, saturated at 0x7E (448).
    code = (bits >> np.uint32(20)) & np.uint32(1)
    code += bits
    code += np.uint32(0x7FFFF)
    code >>= np.uint32(20)
    code -= np.uint32((127 - 7) << 3)  # (wraps below the normal range; those are replaced next)
    np.minimum(code, np.uint32(0x7E), out=code)
    out = code.astype(np.uint8)
    small = s < np.float32(2.0**-6)  # e4m3 subnormals: multiples of 2^-9, rint ties to even
    out[small] = np.rint(s[small] * np.float32(512.0)).astype(np.uint8)
    out[out == 0] = f32_to_e4m3(np.float32(ZERO_BLOCK_SCALE))  # compressed-tensors: no zero divisor
    return out


def _block_rows(k: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(k, 1))


class _Work:
    """The per-matrix buffers one row block works in (allocated once, reused for every block)."""

    def __init__(self, rows: int, k: int) -> None:
        self.rows, self.k = rows, k
        size = rows * k
        self.x = np.empty(size, np.uint32)  # the block widened to float32 bits
        self.v = np.empty(size, np.float32)  # w / (scale / global); then |v|
        self.idx = np.empty(size, np.uint8)  # e2m1 codes
        self.flag = np.empty(size, np.bool_)
        self.pair = np.empty(size // 2, np.uint16)
        self.pairs = np.empty(size // 2, np.uint64)  # dequantized pairs (two float32 each)
        self.wide = np.empty(size, np.float64)

    def widen(self, bits: np.ndarray) -> np.ndarray:
        """bf16 bits [m, K] -> float32 [m, K] (exact), in the block's buffer."""
        m = bits.shape[0]
        x = self.x[: m * self.k].reshape(m, self.k)
        np.copyto(x, bits)
        np.left_shift(x, 16, out=x)
        return x.view(np.float32)

    def codes(self, x: np.ndarray, eff: np.ndarray) -> np.ndarray:
        """E2M1 codes [m, K] of x / eff (per 16-block), rounded to nearest even and saturated at +-6 as
        model_spec/nvfp4.py round_e2m1(clip(x / eff)) does; the sign bit set for every negative quotient."""
        m, k = x.shape
        v = self.v[: m * k].reshape(m, k // GROUP, GROUP)
        np.divide(x.reshape(m, k // GROUP, GROUP), eff[:, :, None], out=v)
        v = v.reshape(m, k)
        idx, flag = self.idx[: m * k].reshape(m, k), self.flag[: m * k].reshape(m, k)
        np.less(v, 0, out=flag)  # before |v| overwrites v: -0.0 is not negative, a tiny negative value is
        np.left_shift(flag.view(np.uint8), 3, out=idx)
        np.abs(v, out=v)
        # Saturation needs no clip: a magnitude above 6 passes all seven steps, which is code 7 (6.0) either way.
        for step, inclusive in _E2M1_STEPS:
            (np.greater_equal if inclusive else np.greater)(v, np.float32(step), out=flag)
            np.add(idx, flag.view(np.uint8), out=idx)
        return idx

    def pack(self, codes: np.ndarray, out: np.ndarray) -> None:
        """codes [m, K] -> bytes [m, K/2], element 2k in the low nibble: each code pair read as one little-endian
        uint16 c0 | c1 << 8, whose low byte after `| (pair >> 4)` is c0 | c1 << 4."""
        m, k = codes.shape
        pair = codes.view("<u2")
        tmp = self.pair[: m * k // 2].reshape(m, k // 2)
        np.right_shift(pair, 4, out=tmp)
        np.bitwise_or(tmp, pair, out=tmp)
        np.copyto(out, tmp, casting="unsafe")  # keeps the low byte


class _ErrorSums:
    """Running max |Wq - W|, sum (Wq - W)^2 and sum W^2 over a matrix's row blocks (float64 sums of exact squares)."""

    def __init__(self) -> None:
        self.max_abs, self.diff_sq, self.w_sq = 0.0, 0.0, 0.0

    def add(self, work: _Work, x: np.ndarray, packed: np.ndarray, eff: np.ndarray) -> None:
        m, k = x.shape
        wide = work.wide[: m * k].reshape(m, k)
        np.square(x, out=wide, dtype=np.float64)  # a float32 squared is exact in float64
        self.w_sq += float(np.add.reduce(wide, axis=None))
        pairs = work.pairs[: m * k // 2].reshape(m, k // 2)
        np.take(_PAIR_VALUES, packed, out=pairs, mode="clip")  # a byte always indexes 256 entries: no bounds check
        deq = pairs.view(np.float32).reshape(m, k // GROUP, GROUP)
        deq *= eff[:, :, None]  # e2m1 * (scale / global) in float32, as dequantize_nvfp4 forms it
        diff = np.subtract(deq.reshape(m, k), x, out=deq.reshape(m, k))  # float32, as quantize_linear measured it
        self.max_abs = max(self.max_abs, float(diff.max()), -float(diff.min()))
        np.square(diff, out=wide, dtype=np.float64)
        self.diff_sq += float(np.add.reduce(wide, axis=None))


__all__ = ["BLOCK_ELEMENTS", "QuantizedBf16", "block_amax_bits", "block_scale_codes", "quantize_bf16"]
