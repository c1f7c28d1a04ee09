"""Runtime stage: the repack of target linears that the checkpoint stores bf16: packed for the fp16-weight GEMMs
(`pack_bf16_linear`), or quantized to NVFP4 with thorgen's compressed-tensors quantizer (`quantize_linear`, for
`--quantize nvfp4`) together with the quantization error of each matrix.

Artifact tensor (one per stored matrix, beside the NVFP4 ones of the other roles): `<base>.weight_half`, dtype f16,
layout `half_t16x64` (names: model_spec/weight_layout.py; layouts.pack_half: step-major 16 x 64 tiles, 64 B a lane),
shape [N * K] or, for the experts, [E, N * K]; fused as the NVFP4 matrices are (q|k|v concatenated, gate/up
interleaved in 8-row tiles), so the lowering (codegen/lower.py `_weight_args`) and the kernels read one weight
pointer where NVFP4 has three.

Why fp16 and not bf16 kernels: every GEMM activation is fp16 (codegen/families ACT_DTYPE) and mma.sync / wgmma
multiply two operands of one type; bf16 weights would need the activations rounded to bf16 (3 mantissa bits
lost on every activation of every layer) or a second activation copy. The weights are converted once here
instead, which is exact for every bf16 value of magnitude 2^-14 .. 65504 (bf16's 8 mantissa bits fit fp16's 11)
and, below 2^-14, rounds to the nearest fp16 subnormal (absolute error at most 2^-25, under 3e-8; trained Gemma
linears are ~1e-2 in magnitude). A weight above the fp16 range (|w| > 65504) has no fp16 value: it is refused
(LayoutError), never clamped.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ...model_spec.nvfp4 import multiplier_of_divisor
from . import layouts as L
from .quantize import quantize_bf16

FUSIONS = ("single", "concat", "interleave8")


def pack_bf16_linear(parts: Sequence[np.ndarray], fusion: str) -> np.ndarray:
    """One stored matrix (one expert) from its parts' raw bf16 bits (uint16 [rows_i, K] each, as
    `Checkpoint.linear_bf16` returns them): fused by `fusion` ("single": one part; "concat": stacked along N, e.g.
    q|k|v; "interleave8": gate and up in alternating 8-row tiles), converted to fp16 (round to nearest even) and
    packed into the half layout -> uint16 [N * K] fp16 bits.

    The parts may be the same column slice of each part (whole 64-input steps: K and the slice start multiples of
    64): the result is then the contiguous piece of the whole matrix's layout for those columns, so a caller can
    stream a large matrix by columns."""
    if fusion not in FUSIONS:
        raise L.LayoutError(f"fusion {fusion!r}: expected one of {FUSIONS}")
    arrays = [np.asarray(p) for p in parts]
    if not arrays or any(a.dtype != np.uint16 or a.ndim != 2 for a in arrays):
        raise L.LayoutError(
            f"expected uint16 [rows, K] bf16 bits per part, got {[f'{a.dtype}{a.shape}' for a in arrays]}"
        )
    if len({a.shape[1] for a in arrays}) != 1:
        raise L.LayoutError(f"parts disagree on K: {[a.shape for a in arrays]}")
    if fusion == "single" and len(arrays) != 1 or fusion == "interleave8" and len(arrays) != 2:
        raise L.LayoutError(f"fusion {fusion!r} takes {1 if fusion == 'single' else 2} parts, got {len(arrays)}")
    halves = [L.bf16_to_f16_bits(a) for a in arrays]
    if fusion == "interleave8":
        return L.pack_half_gate_up(*halves)
    return L.pack_half(halves[0] if len(halves) == 1 else np.concatenate(halves))


def quantize_linear(w_bf16: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray, np.float32], dict]:
    """bf16 bits [N, K] -> ((packed, block scales, global multiplier), error) in the layout RedHatAI's
    compressed-tensors checkpoint gives (global = 2688/amax, one per linear); error = {"max_rel": max|Wq - W| /
    max|W|, "rms_rel": ||Wq - W|| / ||W||} of the dequantized weight against the bf16 one (convert/quantize.py)."""
    q = quantize_bf16(w_bf16, with_error=True)
    return (q.packed, q.scale, multiplier_of_divisor(q.global_scale)), q.error


__all__ = ["FUSIONS", "pack_bf16_linear", "quantize_linear"]
