"""Codegen stage: the weight prologue of the one-row NVFP4 decode GEMVs — the form the plan launches on each arch,
and the parameters of each register form ("nc", "early", "slice").

A one-row GEMV (nvfp4_gemm.cu.j2, M = 1: q|k|v with rope_kv folded in, o_proj with the attention tail, dense
gate|up and down) issues its first weight loads before griddepcontrol.wait, so that its weights stream while the
previous kernel of the PDL chain finishes. Its forms, all with the K split, sums and sum order of gemm_small (the
same bits):
  nc     PF steps a warp loaded with ld.global.nc; ptxas (CUDA 13.0, sm_90a) schedules the wait above those loads,
         so no weight byte is in flight before the previous kernel ends (codegen/sass.py weight_loads_before_wait:
         0). The plan launched it until the chain benchmark below; now it is a bench-only ablation.
  early  the same PF steps with coherent loads, which ptxas keeps before the wait.
  slice  coherent loads of the warp's WHOLE K slice (PF = its step count) before the wait, in registers. Only
         resident blocks prefetch: __launch_bounds__ asks for the whole grid resident at once (min blocks =
         ceil(grid / SMs)) where that leaves REGS_FLOOR registers a thread. The grid stays gemm_small's: more
         blocks would split K differently (other sums).
The plan (planned_gemv, applied by matmul.target_gemm to every one-row GEMV it gives) launches `slice` where the
warp's slice fits its register budget without spilling (slice_fits), else `early`. H200, a dependent chain in decode
step order over 300 layers (docs/BENCHMARKS.md): nc 7.00 us a launch, early 6.26, slice 5.81.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..model_spec.weight_layout import TILE_K, TILE_N
from .arch import ArchSpec
from .kernel_spec import KernelSpec, make_params

REGISTER_FORMS = ("nc", "early", "slice")
MAX_RING = 16  # unit_steps_rows' largest prefetch depth (its static_assert)
REGS_FLOOR = 64  # registers a thread the slice form's residency request leaves at least (the nc GEMVs use 40-57)
REGS_AN_SM = 65536
REGS_A_STEP = 5  # a lane's share of a weight step: 16 B of e2m1 codes and its e4m3 scales (4 + 1 registers)
# The most weight steps (x units) a lane of the slice form holds at REGS_FLOOR registers without spilling, by weight
# kind, from ptxas (CUDA 13.0) on gemma-4-26b-a4b's one-row GEMVs. shift (sm_90a): 6 steps fit (q|k|v, rope_kv
# folded in), 8 spill 40 B (the K = 8,192 o_proj). nat (sm_100a, sm_120a; sm_110a shares the kind): 3 and 4 fit,
# 6 spill 4 B in the full layers' q|k|v (D 512 rope_kv) though 8 fit in the K = 8,192 o_proj: 4 is the most that
# fit in every one.
SLICE_STEPS_AT_FLOOR = {"shift": 6, "nat": 4}


def is_decode_gemv(kernel: KernelSpec, arch: ArchSpec) -> bool:
    """Whether `kernel` is a one-row NVFP4 GEMV whose weight prologue the plan chooses: not fp16 weights (a step is
    16 registers a lane) and not the lm_head's width (more blocks than fit the GPU at once: only the first wave could
    prefetch; matmul.gemm_small's "very wide" rule), nor a bench-only form of one."""
    return (
        kernel.template == "nvfp4_gemm.cu.j2"
        and kernel.param("mmax") == 1
        and kernel.param("kind") != "half"
        and kernel.param("variant_of", None) is None
        and kernel.param("n") // TILE_N < 8 * arch.sm_count
    )


def steps_a_warp(kernel: KernelSpec) -> int:
    """The most K steps a warp of `kernel` has (gemm_small's split of K / 64 steps over KS warps)."""
    return math.ceil(kernel.param("k") // TILE_K / kernel.param("ks"))


def slice_min_blocks(kernel: KernelSpec, arch: ArchSpec) -> int:
    """Blocks an SM the slice form asks ptxas for: the whole grid resident at once, at most what REGS_FLOOR
    registers a thread allow."""
    resident = max(1, REGS_AN_SM // (kernel.threads * REGS_FLOOR))
    return min(math.ceil(kernel.grid[0] / arch.sm_count), resident)


def slice_registers(kernel: KernelSpec, arch: ArchSpec) -> int:
    """Registers a thread of the slice form may take under its residency request (ptxas allocates 8 at a time, at
    most 255)."""
    return min(255, REGS_AN_SM // (kernel.threads * slice_min_blocks(kernel, arch)) // 8 * 8)


def slice_fits(kernel: KernelSpec, arch: ArchSpec) -> bool:
    """Whether the warp's whole K slice of `kernel` (steps x units a lane) fits the slice form's registers without
    spilling: SLICE_STEPS_AT_FLOOR of its weight kind at REGS_FLOOR, a step more for every REGS_A_STEP registers
    above it, and within the ring's depth."""
    held = steps_a_warp(kernel) * kernel.param("un")
    room = SLICE_STEPS_AT_FLOOR[kernel.param("kind")] + (slice_registers(kernel, arch) - REGS_FLOOR) // REGS_A_STEP
    return held <= min(room, MAX_RING)


def planned_prologue(kernel: KernelSpec, arch: ArchSpec) -> str:
    """The weight prologue the plan gives one-row GEMV `kernel` on `arch`: "slice" where it fits, else "early"."""
    return "slice" if slice_fits(kernel, arch) else "early"


def register_form(kernel: KernelSpec, prologue: str, stream_pf: int, arch: ArchSpec) -> dict[str, object]:
    """`kernel`'s params in register form `prologue` (REGISTER_FORMS), `stream_pf` the PF steps a warp of the nc and
    early forms (gemm_small's streaming depth). The slice form's params exist even where its slice does not fit
    (the bench-only ablation of the K = 8,192 o_proj)."""
    if prologue not in REGISTER_FORMS:
        raise ValueError(f"prologue {prologue!r}: expected one of {REGISTER_FORMS}")
    params = {key: val for key, val in kernel.param_dict.items() if key not in ("prologue", "min_blocks")}
    params.update(prologue=prologue, pf=stream_pf)
    if prologue == "slice":
        params.update(pf=steps_a_warp(kernel), min_blocks=slice_min_blocks(kernel, arch))
    return params


def planned_gemv(kernel: KernelSpec, arch: ArchSpec) -> KernelSpec:
    """`kernel` (gemm_small's one-row form, PF its streaming depth) with the weight prologue the plan launches, under
    its own name; any other kernel as it is."""
    if not is_decode_gemv(kernel, arch):
        return kernel
    form = register_form(kernel, planned_prologue(kernel, arch), kernel.param("pf"), arch)
    return replace(kernel, params=make_params(**form))
