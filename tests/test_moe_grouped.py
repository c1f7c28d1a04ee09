"""CPU tests of the grouped (sorted-by-expert) prefill MoE: the plan's NumPy contract (grouping, stable order, tile
list, tile bound), the dataflow (gather -> act_sorted -> per-pair rows -> slot-order sum, which ffn_tail does)
against the per-row MoE formula, the planner's kernels, the bench cases and the runtime's choice of path by rows."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import matmul_reference as R  # noqa: E402

from thorgen.codegen.arch import ARCHS, get_arch
from thorgen.codegen.families import MAX_STEP_TOKENS
from thorgen.codegen.families import matmul as MM
from thorgen.codegen.families import moe_grouped as MG
from thorgen.codegen.plan import PlanError, plan
from thorgen.model_spec.presets import get_preset

PRESETS = ("tiny", "gemma-4-26b-a4b")


def _brute_groups(ids: np.ndarray, experts: int) -> list[list[int]]:
    """For each expert, the pair indices p = row*K + slot that name it, ascending (the definition, by loops)."""
    flat = ids.reshape(-1)
    return [[p for p in range(flat.size) if flat[p] == e] for e in range(experts)]


def _routing(rng, rows, experts, topk, kind):
    if kind == "random":
        return MG.random_routing(rng, rows, experts, topk)
    if kind == "skewed":  # expert 0 in every row, the rest from a small pool: most experts get zero rows
        ids = MG.random_routing(rng, rows, min(experts, topk + 2), topk)
        ids[~(ids == 0).any(1), 0] = 0
        return ids.astype(np.int32)
    ids = MG.random_routing(rng, rows, experts, topk)  # "invalid": corrupt ids are skipped
    ids[rng.random(ids.shape) < 0.05] = experts + 3
    ids[0, 0] = -1
    return ids


@pytest.mark.parametrize("kind", ["random", "skewed", "invalid"])
@pytest.mark.parametrize("rows,experts,topk,bm", [(17, 16, 4, 64), (100, 128, 8, 64), (512, 128, 8, 32), (3, 5, 2, 16)])
def test_plan_reference_groups_pairs_stably_and_tiles_cover_them(kind, rows, experts, topk, bm):
    rng = np.random.default_rng(rows * 7 + bm)
    ids = _routing(rng, rows, experts, topk, kind)
    n_tiles = MG.max_tiles(rows, topk, experts, bm)
    off, pairs, tiles = MG.plan_reference(ids, experts, bm, n_tiles)
    groups = _brute_groups(ids, experts)
    assert off[0] == 0 and list(np.diff(off)) == [len(g) for g in groups]
    for e, g in enumerate(groups):
        assert list(pairs[off[e] : off[e + 1]]) == g, f"expert {e}: pairs not grouped in ascending pair order"
    assert (pairs[off[-1] :] == -1).all()
    used = tiles[tiles[:, 0] >= 0]
    assert (tiles[len(used) :, 0] == -1).all(), "unused tiles must all come after the real ones"
    assert len(used) == sum(-(-len(g) // bm) for g in groups) <= n_tiles
    covered = []
    for e, start, n, pad in used:
        assert pad == 0 and 1 <= n <= bm and off[e] <= start and start + n <= off[e + 1]
        covered += list(range(start, start + n))
    assert covered == list(range(off[-1])), "tiles must cover the sorted pairs once, in order"
    again = MG.plan_reference(ids.copy(), experts, bm, n_tiles)
    assert all(np.array_equal(a, b) for a, b in zip((off, pairs, tiles), again))


def test_max_tiles_is_a_bound_and_is_reached():
    rng = np.random.default_rng(5)
    for rows, experts, topk, bm in [(512, 128, 8, 64), (512, 128, 8, 32), (40, 16, 4, 16), (2, 128, 8, 64)]:
        bound = MG.max_tiles(rows, topk, experts, bm)
        for _ in range(20):
            ids = MG.random_routing(rng, rows, experts, topk)
            _, _, tiles = MG.plan_reference(ids, experts, bm, bound)
            assert (tiles[:, 0] >= 0).sum() <= bound
    # 5 rows x top-4 of 16 experts, 16-row tiles: every expert non-empty -> 16 tiles = (20 + 16*15) // 16
    ids = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [0, 1, 2, 3]], np.int32)
    _, _, tiles = MG.plan_reference(ids, 16, 16, MG.max_tiles(5, 4, 16, 16))
    assert MG.max_tiles(5, 4, 16, 16) == 16 == (tiles[:, 0] >= 0).sum()
    with pytest.raises(ValueError, match="more than"):
        MG.plan_reference(ids, 16, 16, 15)


def _grouped_moe(x, ids, wts, gates, ups, downs, bm):
    """The three kernels' dataflow in NumPy: act_sorted (f16) per sorted pair, f32 per-pair rows at the pair index,
    f32 sum in slot order over valid slots (ffn_tail's PAIRS form)."""
    rows, topk = ids.shape
    experts = len(gates)
    off, pairs, tiles = MG.plan_reference(ids, experts, bm, MG.max_tiles(rows, topk, experts, bm))
    act = np.full((rows * topk, gates[0].shape[0]), np.nan, np.float16)
    ypair = np.full((rows * topk, downs[0].shape[0]), np.nan, np.float32)
    for e, start, n, _ in tiles[tiles[:, 0] >= 0]:
        p = pairs[start : start + n]
        xr = x[p // topk].astype(np.float64)
        act[start : start + n] = R.gelu_tanh(xr @ gates[e].T) * (xr @ ups[e].T)
    for e, start, n, _ in tiles[tiles[:, 0] >= 0]:
        p = pairs[start : start + n]
        ypair[p] = (act[start : start + n].astype(np.float64) @ downs[e].T) * wts.reshape(-1)[p, None]
    y = np.zeros((rows, downs[0].shape[0]), np.float32)
    for k in range(topk):
        ok = (ids[:, k] >= 0) & (ids[:, k] < experts)
        y[ok] += ypair.reshape(rows, topk, -1)[ok, k]
    return y, act, pairs[: off[-1]]


@pytest.mark.parametrize("kind", ["random", "skewed", "invalid"])
def test_grouped_dataflow_is_the_per_row_moe(kind):
    rng = np.random.default_rng(11)
    rows, experts, topk, h, ie = 37, 8, 3, 64, 32
    gates = [rng.standard_normal((ie, h)) * 0.1 for _ in range(experts)]
    ups = [rng.standard_normal((ie, h)) * 0.1 for _ in range(experts)]
    downs = [rng.standard_normal((h, ie)) * 0.1 for _ in range(experts)]
    ids = _routing(rng, rows, experts, topk, kind)
    wts = rng.uniform(0.05, 0.6, (rows, topk)).astype(np.float32)
    x = R.act_f16(rng, rows, h)
    y, act, pairs = _grouped_moe(x, ids, wts, gates, ups, downs, bm=16)
    safe = np.where((ids >= 0) & (ids < experts), ids, 0)
    keep = np.where((ids >= 0) & (ids < experts), wts, 0.0).astype(np.float32)
    act_rows = R.moe_gateup_ref(x, safe, gates, ups).astype(np.float16)  # per (row, slot), one f16 rounding
    np.testing.assert_array_equal(act[: len(pairs)], act_rows[pairs])
    ref = R.moe_down_ref(act_rows, safe, keep, downs)
    assert R.norm_err(y, ref) < 1e-6
    assert np.isfinite(y).all()


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("arch_name", sorted(ARCHS))
def test_planner_kernels(preset, arch_name):
    spec, arch = get_preset(preset), get_arch(arch_name)
    t = spec.target
    ks = {k.template: k for k in MG.plan_moe_grouped(spec, arch)}
    assert set(ks) == {"moe_grouped_plan.cu.j2", "moe_grouped_gateup.cu.j2", "moe_grouped_down.cu.j2"}
    tiles = MG.max_tiles(MAX_STEP_TOKENS, t.top_k_experts, t.num_experts, MG.TILE_ROWS)
    gu, dn = ks["moe_grouped_gateup.cu.j2"], ks["moe_grouped_down.cu.j2"]
    assert gu.grid == (2 * t.moe_intermediate_size // (16 * gu.param("nwarp") * gu.param("upw")), tiles, 1)
    assert dn.grid == (t.hidden_size // (16 * dn.param("nwarp") * dn.param("upw")), tiles, 1)
    assert ks["moe_grouped_plan.cu.j2"].grid == (1, 1, 1) and ks["moe_grouped_plan.cu.j2"].param("max_tiles") == tiles
    for k in ks.values():
        assert k.param("pdl") is True and k.family == "moe_grouped" and k.smem_bytes <= arch.smem_per_block_max
        assert "bm" not in k.param_dict and not k.template.startswith(
            "moe_gateup"
        )  # runtime grid rules (forward._grid)
        assert k.param("mmax") == MAX_STEP_TOKENS and k.param("tile_rows") == MG.TILE_ROWS
    for k in (gu, dn):
        assert k.smem_bytes == k.param("stages") * MG.TILE_ROWS * MM.LARGE_PITCH * 2
    names = [k.name for k in plan(spec, arch)]
    assert all(k.name in names for k in ks.values()) and len(names) == len(set(names))


def test_planner_rejects_shapes_it_cannot_tile():
    spec, arch = get_preset("tiny"), get_arch("sm_90a")
    bad = dataclasses.replace(spec, target=dataclasses.replace(spec.target, moe_intermediate_size=96))
    with pytest.raises(PlanError, match="moe_grouped"):
        MG.plan_moe_grouped(bad, arch)
    with pytest.raises(PlanError, match="tile_rows"):
        MG.moe_grouped_kernels(spec, arch, tile_rows=24)
    with pytest.raises(PlanError, match="warps per block"):
        MG.moe_grouped_kernels(spec, arch, gateup=MG.GemmCfg(nwarp=3))


def test_bench_cases_carry_a_valid_plan():
    spec, arch = get_preset("gemma-4-26b-a4b"), get_arch("sm_90a")
    cases = MG.bench_moe_grouped(spec, arch)
    gu = next(c for c in cases if c.kernel.template == "moe_grouped_gateup.cu.j2" and "planned" in c.note)
    args = {a.name: a for a in gu.args}
    ids = np.asarray(next(c for c in cases if c.kernel.template == "moe_grouped_plan.cu.j2").args[0].values, np.int32)
    t = spec.target
    ids = ids.reshape(MAX_STEP_TOKENS, t.top_k_experts)
    assert all(len(set(r)) == t.top_k_experts for r in ids)
    _, pairs, tiles = MG.plan_reference(ids, t.num_experts, MG.TILE_ROWS, gu.kernel.grid[1])
    assert np.array_equal(np.asarray(args["tiles"].values), tiles.reshape(-1))
    assert np.array_equal(np.asarray(args["pairs"].values), pairs)
    assert args["tiles"].count == 4 * gu.kernel.grid[1]


@pytest.mark.parametrize("preset", PRESETS)
def test_forward_uses_the_grouped_kernels_above_16_rows(preset, tmp_path):
    from thorgen.codegen.manifest import build_manifest
    from thorgen.runtime.cuda.programs import Forward, _grid
    from thorgen.runtime.manifest import load_manifest

    spec, arch = get_preset(preset), get_arch("sm_90a")
    (tmp_path / "manifest.json").write_text(json.dumps(build_manifest(spec, arch, plan(spec, arch), {}, "t", [])))
    fwd = Forward(spec, load_manifest(tmp_path), "bf16", MAX_STEP_TOKENS)
    layers = spec.target.num_hidden_layers
    for rows in (16, 17, 300):
        ops = [op for op in fwd.ops(rows, decode=False, last=True) if hasattr(op, "entry")]
        grouped = [op for op in ops if op.entry.template.startswith("moe_grouped")]
        sliced = [op for op in ops if op.entry.template in ("moe_gateup.cu.j2", "moe_down_pairs.cu.j2")]
        tails = [op for op in ops if op.entry.template == "ffn_tail.cu.j2"]
        # more than one row: the MoE writes a row per slot and every layer's ffn_tail sums them itself
        assert len(tails) == layers and all(op.entry.params["PAIRS"] == spec.target.top_k_experts for op in tails)
        if rows <= 16:  # the 16-row pair
            assert not grouped and len(sliced) == 2 * layers
            continue
        assert not sliced and len(grouped) == 3 * layers
        order = [op.entry.template.split(".")[0] for op in grouped[:3]]
        assert order == ["moe_grouped_plan", "moe_grouped_gateup", "moe_grouped_down"]
        for op in grouped:
            assert _grid(op.entry, rows) == (op.entry.grid if "ROW_AXIS" not in op.entry.params else (rows, 1, 1))
