// thorgen half-precision weight GEMMs (the DFlash drafter's bf16 linears, converted to fp16 once at load, so the
// activations stay fp16 as everywhere else: bf16 inputs would lose 3 mantissa bits of every activation).
// Same tile engine as the NVFP4 GEMMs (WeightKind HALF): a lane reads its 32 contiguous bytes of a weight row per
// 64-input step straight from the row-major [N][K] matrix, so no repack beyond the dtype conversion is needed.
#pragma once
#include "thorgen/gemm_nvfp4.cuh"
