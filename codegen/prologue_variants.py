"""Codegen stage: the bench-only prologue forms of the one-row decode GEMVs, built beside the plan with
`thorgen build --prologue-variants` and timed against the planned kernels in a dependent chain by
`thorgen bench kernels --chain N` (runtime/bench/kernel_chain.py). The step programs never launch them.

The plan's one-row GEMVs (nvfp4_gemm.cu.j2, M = 1: the q|k|v GEMV with rope_kv folded in, o_proj with the attention
tail, dense gate|up and down) load weights before griddepcontrol.wait in a register form that codegen/gemv_prologue.py
chooses per arch: "slice" (the warp's whole K slice, coherent loads) where it fits its registers without spilling,
else "early" (PF steps, coherent loads): on sm_90a, gemma-4-26b-a4b, every one but the full layers' o_proj (K 8192,
8 steps a warp, which spills 40 B a thread at 64 registers as a slice). Four bench-only forms of each, with the same K
split, the same sums in the same order (so the same bits), named <name>_<form>; the planned kernel equals its early or
its slice form under its own name, so the chain times the plan against each:
  <name>_nc     the PF steps loaded with ld.global.nc, which ptxas (CUDA 13.0, sm_90a) schedules after the wait:
                no weight load issues before the previous kernel has finished (codegen/sass.py
                weight_loads_before_wait: 0). The plan launched this form until the H200 chain below.
  <name>_early  the same PF steps, loaded with coherent loads, which ptxas keeps before the wait;
  <name>_slice  coherent loads of the warp's WHOLE K slice (PF = its step count) before the wait. The slice lives
                in registers, and only resident blocks prefetch: __launch_bounds__ asks for the whole grid resident
                at once (min blocks = ceil(grid / SMs)) where that leaves 64 registers a thread (REGS_FLOOR). The
                grid stays the plan's: more blocks would split K differently (other sums). sm_90a, gemma-4-26b-a4b:
                the full layers' q|k|v (576 blocks of 256 threads) keeps 4 blocks an SM, 528 at once, and the
                full layers' o_proj (K 8192, 8 steps a warp) spills 40 B a thread at 64 registers (ptxas; fewer than
                2 blocks an SM would leave 44 of its 176 blocks to a second wave); built here all the same.
  <name>_smem   each warp copies its first P weight steps (codes and scales) into dynamic shared memory with cp.async
                before the wait (P = its whole K range where the budget allows), computes them from there after it
                and streams the rest as the nc form does. For the copies to overlap the previous kernel, two
                consecutive kernels' blocks must share an SM: a block takes UN units (the planned per-unit sums, so
                the same bits; UN in 1..4) so that every SM holds at most 512 threads of a kernel where UN = 4 allows
                it (half the registers at 64 a thread); the blocks most SMs hold (blocks_an_sm) get at most half an
                SM's shared memory, static included, the staged weights at most SMEM_BLOCK_BUDGET a block
                (smem_plan), and min_blocks asks ptxas for twice them. sm_90a, gemma-4-26b-a4b: every form but
                the K = 8,192 o_proj's (5 of its 8 steps a warp) stages its whole slice.
H200, a dependent chain in decode step order over 300 layers (docs/BENCHMARKS.md, before the plan took the slice
and early forms): nc (then planned) 7.00 us a launch, early 6.26, slice 5.81, smem 7.05.
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
from .families.matmul import small_split
from .gemv_prologue import MAX_RING, REGS_AN_SM, REGS_FLOOR, REGISTER_FORMS, is_decode_gemv, register_form, steps_a_warp
from .kernel_spec import BenchCase, KernelSpec, make_params

PROLOGUES = (*REGISTER_FORMS, "smem")
MAX_UN = 4  # gemm_small's most units a block
SMEM_BLOCK_BUDGET = 100 << 10  # a smem form block's staged weights at most (H100: 227 KB of shared memory a block)
SMEM_RESERVED = 1024  # shared memory the SM keeps a block (sm_90)
SMEM_EPILOGUE = 2048  # the fused epilogues' static arrays at most (rope_kv's cos/sin, attn_tail's scratch)
STEP_BYTES = 16 * 64 // 2 + 16 * 64 // 16  # a unit's step: e2m1 codes and e4m3 block scales (576 B)


def decode_gemvs(kernels: Iterable[KernelSpec], arch: ArchSpec) -> list[KernelSpec]:
    """The planned one-row NVFP4 GEMVs among `kernels` that get prologue forms (gemv_prologue.is_decode_gemv)."""
    return [k for k in kernels if is_decode_gemv(k, arch)]


def stream_pf(kernel: KernelSpec, arch: ArchSpec) -> int:
    """The PF steps a warp of `kernel`'s nc and early forms: gemm_small's streaming depth for its shape."""
    return small_split(kernel.param("n") // TILE_N, kernel.param("k") // TILE_K, kernel.param("kind"), arch)[1]


def blocks_an_sm(grid: int, arch: ArchSpec) -> int:
    """The blocks most SMs hold of a `grid`-block kernel resident at once (the grid % SMs others hold one more or
    one fewer; the next kernel's blocks take the SMs with room)."""
    return max(1, round(grid / arch.sm_count))


def smem_units(kernel: KernelSpec, arch: ArchSpec) -> int:
    """Units a block of `kernel`'s smem form: the fewest (dividing the matrix's units and, with rope_kv folded in,
    a head's) that leave at most 512 threads of a kernel on every SM, else the most."""
    units = kernel.param("n") // TILE_N
    head = kernel.param("D") // TILE_N if kernel.param("epi") == "rope_kv" else units
    allowed = [un for un in range(1, MAX_UN + 1) if units % un == 0 and head % un == 0]
    most = [math.ceil(units // un / arch.sm_count) for un in allowed]  # the blocks the fullest SM holds
    fits = [un for un, b in zip(allowed, most) if b * kernel.threads * 2 * REGS_FLOOR <= REGS_AN_SM]
    return (fits or allowed[-1:])[0]


def smem_plan(kernel: KernelSpec, un: int, arch: ArchSpec) -> tuple[int, int] | None:
    """(steps a warp staged in shared memory, dynamic bytes) of `kernel`'s smem form at `un` units a block: the
    warp's whole K range where the budget allows, else as many steps as fit; None where not even one does."""
    steps, ks = kernel.param("k") // TILE_K, kernel.param("ks")
    blocks = kernel.param("n") // TILE_N // un
    sm_smem = arch.smem_per_block_max + SMEM_RESERVED
    static = ks * 8 * 16 * 4 + SMEM_EPILOGUE + SMEM_RESERVED  # gemm_small's reduction tile [KS][8][16] f32
    budget = min(SMEM_BLOCK_BUDGET, sm_smem // 2 // blocks_an_sm(blocks, arch) - static)

    def staged_bytes(smem_steps: int) -> int:  # SliceSmem's slots: the block's steps, or smem_steps a warp
        return min(steps, ks * smem_steps) * un * STEP_BYTES

    fitting = [p for p in range(1, math.ceil(steps / ks) + 1) if staged_bytes(p) <= budget]
    return (fitting[-1], staged_bytes(fitting[-1])) if fitting else None


def smem_variant(kernel: KernelSpec, arch: ArchSpec) -> KernelSpec | None:
    """`kernel`'s smem form (module docstring), or None where no weight step fits its budget."""
    un = smem_units(kernel, arch) * kernel.param("un")
    planned = smem_plan(kernel, un, arch)
    if planned is None:
        return None
    smem_steps, smem_bytes = planned
    grid = kernel.param("n") // TILE_N // un
    params = dict(
        register_form(kernel, "nc", stream_pf(kernel, arch), arch),
        prologue="smem",
        variant_of=kernel.name,
        un=un,
        smem_steps=smem_steps,
        min_blocks=2 * blocks_an_sm(grid, arch),
    )
    return replace(
        kernel,
        name=f"{kernel.name}_smem",
        params=make_params(**params),
        grid=(grid, 1, 1),
        smem_bytes=smem_bytes,
    )


def prologue_variant(kernel: KernelSpec, prologue: str, arch: ArchSpec) -> KernelSpec | None:
    """Planned GEMV `kernel`'s bench-only `prologue` form (PROLOGUES), or None where the warp's slice exceeds the
    ring's depth (slice) or no step fits the shared-memory budget (smem)."""
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue {prologue!r}: expected one of {PROLOGUES}")
    if prologue == "smem":
        return smem_variant(kernel, arch)
    if prologue == "slice" and steps_a_warp(kernel) * kernel.param("un") > MAX_RING:
        return None
    params = dict(register_form(kernel, prologue, stream_pf(kernel, arch), arch), variant_of=kernel.name)
    return replace(kernel, name=f"{kernel.name}_{prologue}", params=make_params(**params))


def prologue_variants(kernels: Iterable[KernelSpec], arch: ArchSpec) -> list[KernelSpec]:
    """Every bench-only prologue form of every planned decode GEMV among `kernels` (the plan), in plan order."""
    out = []
    for k in decode_gemvs(kernels, arch):
        out += [v for p in PROLOGUES if (v := prologue_variant(k, p, arch)) is not None]
    return out


def variant_cases(cases: Iterable[BenchCase], variants: Iterable[KernelSpec]) -> list[BenchCase]:
    """Each variant's bench case: its planned kernel's case (the same arguments), on the variant, launched on the
    variant's own grid (the case's grid is None: the manifest's)."""
    by_kernel = {c.kernel.name: c for c in cases}
    out = []
    for v in variants:
        base = by_kernel.get(str(v.param("variant_of", "")))
        if base is None:
            continue
        if base.grid is not None and v.grid != base.kernel.grid:
            raise ValueError(f"{v.name}: its grid {v.grid} differs from {base.kernel.name}'s launch grid {base.grid}")
        out.append(replace(base, kernel=v))
    return out
