"""Codegen stage: the grouped (sorted-by-expert) MoE family for prefill chunks of more than 16 rows.

Three kernels per model (templates/include/thorgen/moe_grouped.cuh has the device code):
  moe_grouped_plan__...    one block: topk ids [T, K] -> offsets [E+1], pair ids (row*K + slot) grouped by expert in
                           ascending pair order, tile list int4 [max_tiles] (expert, first sorted index, rows, 0;
                           unused: expert -1). `plan_reference` below is its exact NumPy contract.
  moe_grouped_gateup__...  grid (2*Ie/16/(nwarp*upw), max_tiles): gathered x rows x the tile's expert gate|up
                           (each expert's weights streamed once per tile; a tile holds up to `tile_rows` rows)
                           -> f16 act_sorted.
  moe_grouped_down__...    grid (H/16/(nwarp*upw), max_tiles): act_sorted x down, times the routing weight -> f32 ypair
                           [T*K, H] at the pair index.
The ffn_tail after them (norms.py, its PAIRS form) sums each row's valid slots' ypair rows in slot order.
Sizes are for MAX_STEP_TOKENS rows (the prefill chunk); any T up to that works (extra tile blocks exit at once).
The params avoid the names `bm` and a `moe_gateup` template prefix, which the runtime's grid rules reserve for
kernels whose grid follows the row count; these grids are fixed (the plan's tile count is only known on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import numpy as np

from ...model_spec.types import ModelSpec
from ...model_spec.weight_layout import TILE_K, TILE_N, W_LAYOUT, fits_tile, tile_params
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import ACT_DTYPE, MAX_STEP_TOKENS
from ._util import require
from .matmul import fp4_order, kind_enum, large_smem, layout_bytes, weight_args, weight_bufs
from .moe import HALF_PF, expert_kind

TILE_ROWS = 64  # rows per tile: an expert averages T*K/E = 128 rows at T = 2048; m-tiles without rows are skipped
STAGES = 3  # cp.async depth of the A tiles
STATIC_SMEM = 46 * 1024  # static shared memory the plan kernel may use (48 KB limit, some slack)


@dataclass(frozen=True)
class GemmCfg:
    """Blocking of one grouped GEMM: warps per block, 16-column units per warp (the A fragments a warp reads from
    shared memory serve all its units), weight prefetch depth in steps, A stages, min_blocks (launch bounds:
    caps registers at 64K / (min_blocks * threads)), and swap (the decoded weights as the mma's A operand, the
    tile's rows as B, 8 at a time: moe_grouped.cuh, grouped_mainloop)."""

    nwarp: int = 4
    upw: int = 1
    pf: int = 4
    stages: int = STAGES
    min_blocks: int = 4
    swap: bool = False

    @property
    def tag(self) -> str:
        return f"w{self.nwarp}u{self.upw}p{self.pf}s{self.stages}" + ("x" if self.swap else "")


# H200, T = 512 random routing (bench_moe_grouped, graph-replayed, weights rotated past L2): 2 units per warp with
# prefetch 2 beat 1 unit with prefetch 4 (gate/up 198 vs 222 us, down 108 vs 123 us); 4 A stages: same; 32-row
# tiles: slower (217 / 113 us). ~162 registers: 3 blocks of 4 warps per SM. ncu: issue-bound (51% slots busy) with
# MOV / IMAD.MOV = half the loop's instructions (the A fragments of the non-swapped mma need regrouping).
# Swapped (H200, 2026-12-02, the same harness): gate/up 200.5 -> 193.1 us, down 108.9 -> 110.6 (noise): the
# regrouping MOVs were not what bound it; the MoE stays at ~1.5 TB/s. Other swapped blockings: 193-231 / 110-124.
# T = 2048 (H200, 2026-12-03, bench_kernels --family moe_grouped): this blocking 549 / 311 us a layer; 128-row tiles
# 593-696 / 337-387 (docs/benchmarks/h200-kernels-moe-grouped-t2048.json).
GATEUP_CFG = GemmCfg(nwarp=4, upw=2, pf=2, stages=3, min_blocks=3, swap=True)
DOWN_CFG = GemmCfg(nwarp=4, upw=2, pf=2, stages=3, min_blocks=3, swap=True)

PLAN_ARGS = ("ids", "offsets", "pairs", "tiles", "T")
GATEUP_ARGS = ("w", "s", "gscale", "x", "pairs", "tiles", "act")
DOWN_ARGS = ("w", "s", "gscale", "act", "pairs", "tiles", "wts", "ypair")


def max_tiles(rows: int, topk: int, experts: int, tile_rows: int) -> int:
    """Most tiles a chunk of `rows` rows can need: sum_e ceil(c_e / BM) over the non-empty experts, with
    sum c_e <= rows*topk, is at most (rows*topk + nonempty*(BM-1)) // BM, nonempty <= min(E, rows*topk)."""
    pairs = rows * topk
    return max(1, (pairs + min(experts, pairs) * (tile_rows - 1)) // tile_rows)


def plan_reference(ids: np.ndarray, experts: int, tile_rows: int, n_tiles: int):
    """NumPy contract of moe_grouped_plan: (offsets i32 [E+1], pairs i32 [T*K] (only the first offsets[E] are
    defined), tiles i32 [n_tiles, 4]). Ids outside 0..E-1 are skipped (no pair, no output)."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    valid = (flat >= 0) & (flat < experts)
    counts = np.bincount(flat[valid], minlength=experts)[:experts]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    order = np.nonzero(valid)[0]
    order = order[np.argsort(flat[order], kind="stable")]  # by expert, ascending pair index within one
    pairs = np.full(flat.size, -1, np.int32)
    pairs[: order.size] = order
    tiles = np.tile(np.array([-1, 0, 0, 0], np.int32), (n_tiles, 1))
    i = 0
    for e in range(experts):
        for start in range(int(offsets[e]), int(offsets[e + 1]), tile_rows):
            if i >= n_tiles:
                raise ValueError(f"routing needs more than {n_tiles} tiles")
            tiles[i] = (e, start, min(tile_rows, int(offsets[e + 1]) - start), 0)
            i += 1
    return offsets, pairs, tiles


def _gemm_kernel(
    which: str, cfg: GemmCfg, units: int, steps: int, base: dict, arch: ArchSpec, tag: str, args: tuple[str, ...]
) -> KernelSpec:
    require(
        units % (cfg.nwarp * cfg.upw) == 0,
        f"moe_grouped {which}: {cfg.nwarp} warps per block x {cfg.upw} units per warp must divide its {units} units",
    )
    require(cfg.stages >= 2 and cfg.pf >= 1 and 1 <= cfg.min_blocks <= 32, f"moe_grouped {which}: bad blocking {cfg}")
    return KernelSpec(
        f"moe_grouped_{which}__{tag}_{cfg.tag}",
        f"moe_grouped_{which}.cu.j2",
        make_params(
            nwarp=cfg.nwarp,
            upw=cfg.upw,
            pf=min(cfg.pf, steps),
            stages=cfg.stages,
            min_blocks=cfg.min_blocks,
            swap=cfg.swap,
            **base,
        ),
        grid=(units // (cfg.nwarp * cfg.upw), base["max_tiles"], 1),
        block=(32 * cfg.nwarp, 1, 1),
        smem_bytes=large_smem(base["tile_rows"], cfg.stages),
        args=args,
        family="moe_grouped",
    )


def moe_grouped_kernels(
    spec: ModelSpec,
    arch: ArchSpec,
    tile_rows: int = TILE_ROWS,
    gateup: GemmCfg = GATEUP_CFG,
    down: GemmCfg = DOWN_CFG,
    rows: int = MAX_STEP_TOKENS,
) -> list[KernelSpec]:
    """[plan, gateup, down] for `rows`-row chunks with tiles of `tile_rows` rows."""
    t = spec.target
    h, ie, e, topk = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
    require(
        fits_tile(2 * ie, h) and fits_tile(h, ie),
        f"moe_grouped: expert shapes gate/up [{2 * ie} x {h}], down [{h} x {ie}] do not fit the {W_LAYOUT} layout",
    )
    require(
        tile_rows % 16 == 0 and 16 <= tile_rows <= 128, f"moe_grouped: tile_rows {tile_rows} not in 16..128 step 16"
    )
    require(1 <= e <= 1024 and 1 <= topk <= 32, f"moe_grouped: {e} experts / top-{topk} out of range")
    kind, suffix = expert_kind(spec, arch)
    if kind == "half":  # fp16 steps are 4x the registers of NVFP4 ones (moe.HALF_PF): two blocks an SM's registers
        # (3, at most 170 a thread, spilled 300 B in the gate/up with 2 units a warp)
        gateup, down = (replace(c, pf=min(c.pf, HALF_PF), min_blocks=min(c.min_blocks, 2)) for c in (gateup, down))
    base = dict(
        experts=e, topk=topk, mmax=rows, tile_rows=tile_rows, max_tiles=max_tiles(rows, topk, e, tile_rows), pdl=True
    )
    gemm = dict(
        base,
        kind=kind,
        kind_enum=kind_enum(kind),
        ie=ie,
        h=h,
        w_layout=W_LAYOUT,
        fp4_order=fp4_order(arch),
        act_dtype=ACT_DTYPE,
        **tile_params(),
    )
    # plan block: per-warp expert counters (WARPS x (E+1) ints) in static shared memory, under the 48 KB static
    # limit; the ids stay in registers (rows*K / threads a thread)
    plan_warps = min(32, arch.max_threads_per_block // 32, (STATIC_SMEM - 16 * (e + 1)) // (4 * (e + 1)))
    require(plan_warps >= 1, f"moe_grouped: the plan's counters for {e} experts exceed static shared memory")
    require(rows * topk <= 64 * 32 * plan_warps, f"moe_grouped: the plan's {rows}x{topk} ids exceed 64 a thread")
    tag = f"e{e}_k{topk}_i{ie}_h{h}_t{tile_rows}{suffix}"
    plan = KernelSpec(
        f"moe_grouped_plan__r{rows}_e{e}_k{topk}_t{tile_rows}",
        "moe_grouped_plan.cu.j2",
        make_params(threads=32 * plan_warps, **base),
        grid=(1, 1, 1),
        block=(32 * plan_warps, 1, 1),
        args=PLAN_ARGS,
        family="moe_grouped",
    )
    gu = _gemm_kernel("gateup", gateup, 2 * ie // TILE_N, h // TILE_K, gemm, arch, tag, weight_args(GATEUP_ARGS, kind))
    dn = _gemm_kernel("down", down, h // TILE_N, ie // TILE_K, gemm, arch, tag, weight_args(DOWN_ARGS, kind))
    return [plan, gu, dn]


@cache
def plan_moe_grouped(spec: ModelSpec, arch: ArchSpec) -> tuple[KernelSpec, ...]:
    """(plan, gate/up, down) of a prefill chunk: what the step programs launch for the MoE of more than 16 rows."""
    return tuple(moe_grouped_kernels(spec, arch))


def random_routing(rng: np.random.Generator, rows: int, experts: int, topk: int) -> np.ndarray:
    """Distinct uniformly random experts per row (i32 [rows, topk])."""
    return np.argsort(rng.random((rows, experts)), axis=1)[:, :topk].astype(np.int32)


# Alternative blockings timed beside the planned one (tile_rows, gate/up cfg, down cfg): the numbers above.
# At T = 2048 an expert averages 128 rows, so 128-row tiles (each weight decoded once for twice the rows) are timed
# too: 1 unit a warp (~160 registers, 3 blocks an SM) and 2 (~240, 2 blocks).
BENCH_VARIANTS: tuple[tuple[int, GemmCfg, GemmCfg], ...] = tuple(
    (tr, GemmCfg(*c), GemmCfg(*c))
    for tr, c in (
        (64, (4, 1, 4, 3, 4, True)),
        (128, (4, 1, 2, 3, 3, True)),
        (128, (4, 1, 4, 3, 3, True)),
        (128, (4, 2, 2, 3, 2, True)),
    )
)


def _bench_set(
    spec: ModelSpec, arch: ArchSpec, ids: np.ndarray, tile_rows: int, gcfg: GemmCfg, dcfg: GemmCfg, note: str
) -> list[BenchCase]:
    t = spec.target
    h, ie, e, topk = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
    rows = ids.shape[0]
    plan, gateup, down = moe_grouped_kernels(spec, arch, tile_rows, gcfg, dcfg)
    n_tiles = plan.param("max_tiles")
    _, pairs, tiles = plan_reference(ids, e, tile_rows, n_tiles)
    used = int((tiles[:, 0] >= 0).sum())
    n_sel = len(np.unique(ids))
    npair = rows * topk
    pairs_buf = Buf("pairs", "i32", npair, values=tuple(int(v) for v in pairs))
    tiles_buf = Buf("tiles", "i32", n_tiles * 4, values=tuple(int(v) for v in tiles.reshape(-1)))
    ids_buf = Buf("ids", "i32", npair, values=tuple(int(v) for v in ids.reshape(-1)))
    kind = gateup.param("kind")
    gu_w, dn_w = weight_bufs(kind, 2 * ie, h, e), weight_bufs(kind, h, ie, e)
    gu_b, d_b = layout_bytes(kind, 2 * ie, h), layout_bytes(kind, h, ie)
    tf = f"{2 * npair * ie * h * 2 / 1e9:.1f}+{2 * npair * ie * h / 1e9:.1f} GFLOP"
    what = f"{note} T={rows} {used} tiles"
    return [
        BenchCase(
            plan,
            (
                ids_buf,
                Buf("offsets", "i32", e + 1),
                Buf("pairs", "i32", npair),
                Buf("tiles", "i32", n_tiles * 4),
                Scalar("T", "i32", rows),
            ),
            bytes_moved=npair * 8 + n_tiles * 16,
            note=what,
        ),
        BenchCase(
            gateup,
            gu_w + (Buf("x", "f16", rows * h), pairs_buf, tiles_buf, Buf("act", "f16", npair * ie)),
            bytes_moved=n_sel * gu_b + rows * h * 2 + npair * ie * 2,
            note=f"{what} {tf}",
        ),
        BenchCase(
            down,
            dn_w
            + (
                Buf("act", "f16", npair * ie),
                pairs_buf,
                tiles_buf,
                Buf("wts", "f32", npair, 0.05, 0.3),
                Buf("ypair", "f32", npair * h),
            ),
            bytes_moved=n_sel * d_b + npair * (ie * 2 + 4 + h * 4),
            note=what,
        ),
    ]


def bench_moe_grouped(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    """A full prefill chunk (MAX_STEP_TOKENS rows) with uniformly random distinct top-k routing, for the planned tiling
    and BENCH_VARIANTS (each expert's weights counted once: the compulsory bytes)."""
    t = spec.target
    ids = random_routing(np.random.default_rng(0), MAX_STEP_TOKENS, t.num_experts, t.top_k_experts)
    cases = _bench_set(spec, arch, ids, TILE_ROWS, GATEUP_CFG, DOWN_CFG, "planned")
    for tile_rows, gcfg, dcfg in BENCH_VARIANTS:
        try:
            cases += [
                c
                for c in _bench_set(spec, arch, ids, tile_rows, gcfg, dcfg, f"t{tile_rows}")
                if "gateup" in c.kernel.name or "down" in c.kernel.name
            ]
        except ValueError:  # a variant that does not fit this shape
            continue
    return cases


__all__ = [
    "plan_moe_grouped",
    "bench_moe_grouped",
    "moe_grouped_kernels",
    "plan_reference",
    "max_tiles",
    "random_routing",
    "TILE_ROWS",
    "GemmCfg",
]
