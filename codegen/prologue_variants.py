"""Codegen stage: the bench-only prologue forms of the one-row decode GEMVs, built beside the plan with
`thorgen build --prologue-variants` and timed against the planned kernels in a dependent chain by
`thorgen bench kernels --chain N` (runtime/bench/kernel_chain.py). The step programs never launch them.

A planned one-row GEMV (nvfp4_gemm.cu.j2, M = 1: the q|k|v GEMV with rope_kv folded in, o_proj with the attention
tail, dense gate|up and down) loads PF weight steps a warp before griddepcontrol.wait in its PTX, with
ld.global.nc; ptxas (CUDA 13.0, sm_90a) schedules the wait above those loads, so in the SASS no weight load issues
before the previous kernel has finished (codegen/sass.py weight_loads_before_wait: 0 in each). Two forms of each,
with the same K split, the same sums in the same order (so the same bits):
  <name>_early  the same PF steps, loaded with coherent loads, which ptxas keeps before the wait;
  <name>_slice  coherent loads of the warp's WHOLE K slice (PF = its step count) before the wait. The slice lives
                in registers, and only resident blocks prefetch: __launch_bounds__ asks for the whole grid resident
                at once (min blocks = ceil(grid / SMs)) where that leaves 64 registers a thread (REGS_FLOOR). The
                grid stays the plan's: more blocks would split K differently (other sums). sm_90a, gemma-4-26b-a4b:
                the full layers' q|k|v (576 blocks of 256 threads) keeps 4 blocks an SM, 528 at once, and the
                full layers' o_proj (K 8192, 8 steps a warp) spills 40 B a thread at 64 registers (ptxas; fewer than
                2 blocks an SM would leave 44 of its 176 blocks to a second wave).
Left out: the lm_head's width (more blocks than fit the GPU at once: only the first wave could prefetch), fp16
weights (a step is 16 registers a lane), and the MoE kernels, whose weights depend on the routing read after the
wait (an expert's id is an input of the step); they run as planned.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from ..model_spec.weight_layout import TILE_K, TILE_N
from .arch import ArchSpec
from .kernel_spec import BenchCase, KernelSpec, make_params

PROLOGUES = ("early", "slice")
MAX_RING = 16  # unit_steps_rows' largest prefetch depth (its static_assert)
REGS_FLOOR = 64  # registers a thread the slice form's residency request leaves at least (today's GEMVs use 40-51)
REGS_AN_SM = 65536


def decode_gemvs(kernels: Iterable[KernelSpec], arch: ArchSpec) -> list[KernelSpec]:
    """The one-row NVFP4 GEMVs among `kernels` that get prologue forms (not the lm_head's width: matmul.gemm_small's
    "very wide" rule)."""
    return [
        k
        for k in kernels
        if k.template == "nvfp4_gemm.cu.j2"
        and k.param("mmax") == 1
        and k.param("kind") != "half"
        and k.param("prologue", None) is None
        and k.param("n") // TILE_N < 8 * arch.sm_count
    ]


def prologue_variant(kernel: KernelSpec, prologue: str, arch: ArchSpec) -> KernelSpec | None:
    """`kernel`'s `prologue` form ("early" or "slice"), or None where the warp's slice exceeds the ring's depth."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue {prologue!r}: expected one of {PROLOGUES}")
    steps_a_warp = math.ceil(kernel.param("k") // TILE_K / kernel.param("ks"))  # the most steps a warp has
    params = dict(kernel.param_dict, prologue=prologue, variant_of=kernel.name)
    if prologue == "slice":
        if steps_a_warp * kernel.param("un") > MAX_RING:
            return None
        resident = max(1, REGS_AN_SM // (kernel.threads * REGS_FLOOR))
        params.update(pf=steps_a_warp, min_blocks=min(math.ceil(kernel.grid[0] / arch.sm_count), resident))
    return replace(kernel, name=f"{kernel.name}_{prologue}", params=make_params(**params))


def prologue_variants(kernels: Iterable[KernelSpec], arch: ArchSpec) -> list[KernelSpec]:
    """Both prologue forms of every decode GEMV among `kernels` (the plan), in plan order."""
    out = []
    for k in decode_gemvs(kernels, arch):
        out += [v for p in PROLOGUES if (v := prologue_variant(k, p, arch)) is not None]
    return out


def variant_cases(cases: Iterable[BenchCase], variants: Iterable[KernelSpec]) -> list[BenchCase]:
    """Each variant's bench case: its planned kernel's case (the same arguments), on the variant."""
    by_kernel = {c.kernel.name: c for c in cases}
    return [
        replace(by_kernel[v.param("variant_of")], kernel=v)
        for v in variants
        if v.param("variant_of", None) in by_kernel
    ]
