"""Codegen stage: the DFlash drafter's bf16 linears as fp16 tensor-core GEMMs (weights converted bf16 -> fp16 once).

The drafter is precision-sensitive (the seed lost acceptance with FP8/FP4 drafter weights), so its linears stay
16-bit; they run on the same tile engine as the NVFP4 kernels (WeightKind HALF, plain row-major fp16 [N][K]):
  bf16_gemm16__n{N}_k{K}[_silu]  the 16-slot block (fused q|k|v, o, fused gate|up with SiLU epilogue, down) and the
                                 incremental context fc / context K|V of <= 16 new positions
  bf16_gemmL__n{N}_k{K}          context chunks (fc over the concatenated taps, context K|V projections)
The shared lm_head of the draft logits is the target's NVFP4 lm_head (matmul family).
"""

from __future__ import annotations

from functools import cache

from ...model_spec.conventions import VERIFY_ROWS
from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ..kernel_spec import BenchCase, KernelSpec
from .matmul import gemm_bench_case, gemm_large, gemm_small


@cache
def drafter_gemm(n: int, k: int, rows: int, epi: str, arch: ArchSpec) -> KernelSpec:
    """The drafter linear [n, k] for a launch of `rows` rows: the 16-row GEMM, or for more (context chunks) the
    prefill one."""
    if rows > VERIFY_ROWS:
        return gemm_large(n, k, epi, arch, kind="half", prefix="bf16", family="drafter_gemm")
    return gemm_small(n, k, VERIFY_ROWS, epi, arch, kind="half", prefix="bf16", family="drafter_gemm")


def drafter_shapes(spec: ModelSpec) -> list[tuple[str, int, int, str]]:
    """(role, N, K, epilogue) of the drafter's linears, each launched at up to 16 rows (fc and kv2, the context's,
    also on prefill chunks)."""
    d = spec.drafter
    if d is None:
        return []
    h, hd = d.hidden_size, d.head_dim
    nq, nkv = d.num_attention_heads * hd, d.num_key_value_heads * hd
    taps = len(d.target_layer_ids) * spec.target.hidden_size
    # the block's q|k|v as one GEMM over the repack's fused matrix; the context's k|v as one over its k|v rows
    return [
        ("qkv", nq + 2 * nkv, h, "store"),
        ("kv2", 2 * nkv, h, "store"),
        ("o", h, nq, "store"),
        ("gate_up", 2 * d.intermediate_size, h, "silu_mul"),
        ("down", h, d.intermediate_size, "store"),
        ("fc", h, taps, "store"),
    ]


def bench_drafter_gemm(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    kernels = {
        kern.name: kern
        for kern in (drafter_gemm(n, k, VERIFY_ROWS, epi, arch) for _, n, k, epi in drafter_shapes(spec))
    }
    return [gemm_bench_case(kern, 16) for kern in kernels.values()]
