"""Runtime stage: the repack of target linears that the checkpoint stores bf16: kept bf16 in their kernel layout
(`pack_bf16_linear`), or quantized to NVFP4 with thorgen's compressed-tensors quantizer (`quantize_linear`, for
`--quantize nvfp4`) together with the quantization error of each matrix."""

from __future__ import annotations

import numpy as np

from ...model_spec.nvfp4 import bf16_to_f32, dequantize_nvfp4, multiplier_of_divisor, quantize_nvfp4
from . import layouts as L

BF16_LAYOUT = "bf16_t16x64"  # bf16 bits in the half-precision step-major tiling of layouts.pack_half


def pack_bf16_linear(parts: list[np.ndarray], fusion: str) -> np.ndarray:
    """The stored form of one bf16 matrix (one expert) from its parts' raw bf16 bits [rows_i, K]: the bits
    unchanged, tiled like the drafter's fp16 weights (layouts.pack_half works on any 16-bit pattern), q|k|v
    concatenated and gate/up interleaved in 8-row tiles as the NVFP4 matrices are. Flattened uint16."""
    if fusion == "interleave8":
        return L.pack_half_gate_up(*parts)
    return L.pack_half(parts[0] if len(parts) == 1 else np.ascontiguousarray(np.concatenate(parts)))


def quantize_linear(w_bf16: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray, np.float32], dict]:
    """bf16 bits [N, K] -> ((packed, block scales, global multiplier), error) in the layout RedHatAI's
    compressed-tensors checkpoint gives (global = 2688/amax, one per linear); error = {"max_rel": max|Wq - W| /
    max|W|, "rms_rel": ||Wq - W|| / ||W||} of the dequantized weight against the bf16 one."""
    w = bf16_to_f32(w_bf16)
    packed, scale, g = quantize_nvfp4(w)
    diff = (dequantize_nvfp4(packed, scale, g) - w).astype(np.float64)
    amax, norm = float(np.abs(w).max()), float(np.linalg.norm(w.astype(np.float64)))
    error = {"max_rel": float(np.abs(diff).max()) / amax if amax else 0.0,
             "rms_rel": float(np.linalg.norm(diff)) / norm if norm else 0.0}
    return (packed, scale, multiplier_of_divisor(g)), error
