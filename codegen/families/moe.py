"""Codegen stage: the grouped-MoE family (gate|up -> gelu_tanh(gate) * up -> down, weighted by the router).

Two kernels per token budget (mmax 1 = decode, 16 = verify and batched decode, 32 = batched decode of 17..32
sequences: two 16-row tensor-core tiles on each decoded weight step), on per-expert slabs of the t16x64 NVFP4 layout:
  moe_gateup__...  grid (2*Ie/16 units, min(E, m*K)): block row y does the step's y-th distinct expert's fused gate|up
                   for the tokens that chose it (8 a pass over its weights) and writes their act[t*K+k] rows.
  moe_down__...    (one token) grid (H/16 units): each block walks the selected experts (fixed order), multiplies
                   their down rows with the gathered act rows and the routing weights in fp32, reduces over warps in
                   shared memory -> y[t, H] f32. No atomics, no partial buffers, each expert's weights read once.
  moe_down_pairs__ (16 or 32 rows) grid (H/16 units, min(E, m*K)), like gate/up: block row y runs its expert's
                   down rows for the tokens that chose it -> ypair[t*K+k, H] f32, which ffn_tail (its PAIRS form,
                   norms.py) sums per token in slot order.
Both run a pass's tokens as the B operand of the swapped mma (moe_small.cuh: expert_tokens).
Prefill chunks (m > 16, not batched) use the grouped family (moe_grouped.py).
"""

from __future__ import annotations

import math
from functools import cache

from ...model_spec.conventions import MAX_BATCH
from ...model_spec.types import ModelSpec
from ...model_spec.weight_layout import TILE_K, TILE_N, W_LAYOUT, fits_tile, tile_params
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from ._util import require
from .matmul import (
    ACT_DTYPE,
    fp4_order,
    kind_enum,
    prefetch,
    target_warps,
    layout_bytes,
    weight_args,
    weight_bufs,
    weight_kind,
)

GATEUP_ARGS = ("w", "s", "gscale", "x", "ids", "act", "m")
# The down projections' K split (warps over the expert's intermediate size) at every row count: 1, one accumulator
# chain a slot, so that one token's moe_down and the batched moe_down_pairs sum alike (batch invariance).
DOWN_KS = 1
DOWN_ARGS = ("w", "s", "gscale", "act", "ids", "wts", "y", "m")
DOWN_PAIRS_ARGS = ("w", "s", "gscale", "act", "ids", "wts", "ypair", "m")
# An expert's pairs a pass over its weights (moe_small.cuh): 8 = one token group of the swapped mma. 16 (two groups,
# one pass where 16 verify rows share an expert) was slower on router-like routing in its first form (H200,
# 2026-12-02: the batched 16-row step 5.94 -> 6.78 ms, verify gate/up 39 -> 45 us a layer).
PASS_WIDTH = 8
# fp16 experts (ModelSpec.linear_formats.experts == "bf16"): a raw weight step is 64 B a lane (16 registers) against
# 16 + 2 B for NVFP4, so a warp holds at most this many steps in flight (the one-token down's 16 would spill)
HALF_PF = 4


def expert_kind(spec: ModelSpec, arch: ArchSpec) -> tuple[str, str]:
    """(weight kind, kernel-name suffix) of the experts: NVFP4 in the arch's byte order, or fp16 ("_half")."""
    kind = weight_kind(spec.linear_formats.experts, arch)
    return kind, "_half" if kind == "half" else ""


def _units(units: int, most: int) -> int:
    """Units a block: the largest power of two up to `most` that divides the matrix's units."""
    return max(u for u in (1, 2, 4) if u <= most and units % u == 0)


def _expert_leaders(mmax: int, topk: int, experts: int) -> int:
    """Distinct experts a step of mmax tokens can select: the block rows of gate/up and down_pairs (a block row an
    expert, moe_small.cuh block_expert), and the planner's estimate for grid fill."""
    return min(mmax * topk, experts)


@cache
def moe_kernels(spec: ModelSpec, arch: ArchSpec, mmax: int) -> tuple[KernelSpec, KernelSpec]:
    """(gate/up, down) of a step of up to `mmax` rows: the one-token down, or for more rows the down per slot."""
    t = spec.target
    h, ie, e, topk = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
    require(
        fits_tile(2 * ie, h) and fits_tile(h, ie),
        f"moe: expert shapes gate/up [{2 * ie} x {h}], down [{h} x {ie}] do not fit the {W_LAYOUT} layout",
    )
    kind, suffix = expert_kind(spec, arch)
    leaders = _expert_leaders(mmax, topk, e)
    units_gu, steps_gu = 2 * ie // TILE_N, h // TILE_K
    # Every row count splits K alike (the one-token step's KS, whatever mmax), so that a token's act row sums in one
    # order whatever else the step holds (moe_small.cuh; batch invariance of the gate/up).
    ks = max(min(2, steps_gu), min(16, steps_gu, math.ceil(target_warps(arch) / (units_gu * topk))))
    pf = prefetch(math.ceil(steps_gu / ks), arch)
    # Many rows on a deep-prefetch arch: 2 steps in flight a warp (16 rows, H200, router-like routing, 2026-12-01:
    # 107.8 us a layer vs 128.0 with 4; fewer registers, more warps resident; 8 no better than 4).
    # Warps (KS) x units (UN) a block, over each expert's own tokens (moe_small.cuh). H200 sweep (8 distinct
    # experts a token, 2026-12-02, kernel bench): 16 rows KS 4 x UN 2 70.7 us a
    # layer (2.7 TB/s; UN 1 the same, UN 4 or PF 4 slower), 32 rows KS 4 x UN 2 94.7 (KS 2 x UN 4 101.7, KS 5 x
    # UN 1 x PF 4, the one-token step's former blocking, 139; the one-token step measured the same at KS 4 x
    # PF 2, 280.6 us a step either way).
    un = 1
    if arch.prefetch_depth >= 4:
        ks, pf = min(4, steps_gu), min(pf, 2)
        un = _units(units_gu, 2) if mmax > 1 else 1
    if kind == "half":
        pf = min(pf, HALF_PF)
    common = dict(
        kind=kind,
        kind_enum=kind_enum(kind),
        ie=ie,
        h=h,
        experts=e,
        topk=topk,
        mmax=mmax,
        w_layout=W_LAYOUT,
        fp4_order=fp4_order(arch),
        act_dtype=ACT_DTYPE,
        **tile_params(),
    )
    gateup = KernelSpec(
        f"moe_gateup__m{mmax}_e{e}_k{topk}_i{ie}_h{h}{suffix}",
        "moe_gateup.cu.j2",
        make_params(ks=ks, pf=pf, un=un, pw=PASS_WIDTH, ROW_GRID=(1, topk, 1, leaders), **common),
        grid=(units_gu // un, leaders, 1),
        block=(32 * ks, 1, 1),
        args=weight_args(GATEUP_ARGS, kind),
        family="moe",
    )
    steps_d = ie // TILE_K
    units_d = h // TILE_N
    if mmax > 1:
        # a block per (unit, expert), like gate/up (against moe_down, 2026-12-01: 100.9 -> 66.8 us a layer at 16
        # rows). One warp a block with 2 steps in flight is fastest (more blocks resident beat deeper prefetch).
        # The same sweep as gate/up (2026-12-02): 2 units a block, 16 rows 40.3 us, 32 rows 55.6 (one unit 64.3;
        # 2 warps, 4 units or PF 4-11 slower); all m rows as A tiles: 55.5 and 118.2 us.
        kp, upd = DOWN_KS, _units(units_d, 2) if arch.prefetch_depth >= 4 else 1
        pairs = KernelSpec(
            f"moe_down_pairs__m{mmax}_e{e}_k{topk}_i{ie}_h{h}{suffix}",
            "moe_down_pairs.cu.j2",
            make_params(
                ks=kp,
                pf=min(2, prefetch(steps_d, arch)),
                un=upd,
                pw=PASS_WIDTH,
                ROW_GRID=(1, topk, 1, leaders),
                **common,
            ),
            grid=(units_d // upd, leaders, 1),
            block=(32 * kp, 1, 1),
            args=weight_args(DOWN_PAIRS_ARGS, kind),
            family="moe",
        )
        return gateup, pairs
    # One token: warps per block at most 8 (a 512-thread block held one block per SM: two waves over the H/16
    # units, measured 15 us); a warp a slot. Batch invariance: each slot's sum is one chain over the expert's K, as
    # in moe_down_pairs (DOWN_KS), and the block adds the slots in slot order from 0, as ffn_tail adds the pair rows,
    # so a token's MoE output has the same bits in a one-row step as in a batched one (a K split here, which the
    # tiny preset had, summed the partials in another order).
    groups, ksd = leaders, DOWN_KS
    require(groups <= 8, f"moe: the one-token down runs a warp a slot, at most 8 ({leaders} slots)")
    nw = groups * ksd
    pfd = prefetch(math.ceil(steps_d / ksd), arch)
    if arch.prefetch_depth >= 4:  # a warp's whole expert slab in flight (H200 sweep: 11 steps 7.6 us, 4 steps 10.1)
        pfd = min(16, math.ceil(steps_d / ksd))
    if kind == "half":  # (the whole slab of the tiny preset's 2 steps in flight spilled 4 B on sm_90a)
        pfd = max(1, min(pfd, HALF_PF, steps_d - 1))
    down = KernelSpec(
        f"moe_down__m{mmax}_e{e}_k{topk}_i{ie}_h{h}{suffix}",
        "moe_down.cu.j2",
        make_params(nw=nw, ksd=ksd, pf=pfd, swap=True, **common),
        grid=(units_d, 1, 1),
        block=(32 * nw, 1, 1),
        args=weight_args(DOWN_ARGS, kind),
        family="moe",
    )
    return gateup, down


def expert_bytes(spec: ModelSpec, kind: str = "nvfp4") -> tuple[int, int]:
    """Layout bytes of one expert's gate|up and down for weight kind `kind`."""
    t = spec.target
    h, ie = t.hidden_size, t.moe_intermediate_size
    return layout_bytes(kind, 2 * ie, h), layout_bytes(kind, h, ie)


def bench_moe(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    """M = 1 with K distinct experts (ids 0, E/K, 2E/K, ...), and M = 16 (random routing, bytes an upper bound)."""
    t = spec.target
    h, ie, e, topk = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
    kind = expert_kind(spec, arch)[0]
    gu_b, d_b = expert_bytes(spec, kind)
    cases = []
    for mmax in (1, 16, MAX_BATCH):
        gateup, down = moe_kernels(spec, arch, mmax)
        m = mmax
        n_sel = topk if m == 1 else min(e, m * topk)  # upper bound; random routing at M = 16 repeats some
        # M = 1: distinct experts spread over the table (the counted bytes); M = 16: random routing (repeats)
        ids = (
            Buf("ids", "i32", m * topk, values=tuple(range(0, e, max(1, e // topk)))[:topk])
            if m == 1
            else Buf("ids", "i32", m * topk, 0, e)
        )
        gu_args = (
            *weight_bufs(kind, 2 * ie, h, e),
            Buf("x", "f16", m * h),
            ids,
            Buf("act", "f16", m * topk * ie),
            Scalar("m", "i32", m),
        )
        d_args = (
            *weight_bufs(kind, h, ie, e),
            Buf("act", "f16", m * topk * ie),
            ids,
            Buf("wts", "f32", m * topk, 0.0, 0.3),
            Buf("y", "f32", m * h),
            Scalar("m", "i32", m),
        )
        note = f"M={m}, {n_sel} experts" + (" (ids must be distinct)" if m == 1 else " (at most)")
        cases.append(
            BenchCase(
                gateup,
                gu_args,
                bytes_moved=n_sel * gu_b + m * h * 2 + m * topk * ie * 2,
                note=note,
                weight_streaming=m == 1,
            )
        )
        if m > 1:  # moe_down_pairs: one output row per slot
            d_args = d_args[:-2] + (Buf("ypair", "f32", m * topk * h), d_args[-1])
        out_rows = m * topk if m > 1 else m
        cases.append(
            BenchCase(
                down,
                d_args,
                bytes_moved=n_sel * d_b + m * topk * ie * 2 + out_rows * h * 4,
                note=note,
                weight_streaming=m == 1,
            )
        )
    return cases


__all__ = ["bench_moe", "moe_kernels"]
