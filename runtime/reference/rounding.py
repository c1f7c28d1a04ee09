"""Runtime stage (reference backend): a float64 value rounded as the CUDA engine stores it (f32, f16, bf16, fp8)."""

from __future__ import annotations

import numpy as np

from ...model_spec.nvfp4 import bf16_to_f32, e4m3_to_f32, f32_to_bf16, f32_to_e4m3
from .ops import F32, F64


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values of x stored as `dtype` ("f32", "f16", "bf16", "fp8"), converted through float32."""
    x32 = np.asarray(x, dtype=F32)
    if dtype == "f32":
        return x32.astype(F64)
    if dtype == "f16":
        return x32.astype(np.float16).astype(F64)
    if dtype == "bf16":
        return bf16_to_f32(f32_to_bf16(x32)).astype(F64)
    if dtype == "fp8":
        return e4m3_to_f32(f32_to_e4m3(x32)).astype(F64)
    raise ValueError(f"unknown storage type {dtype!r}")
