"""GPU tests: NVFP4 GEMV / verify GEMM / prefill GEMM (matmul family), the o_proj GEMV with the attention tail
folded in, the q|k|v GEMV with rope_kv folded in, and the drafter's fp16 GEMMs against NumPy.

Tiny preset: weights go through the real path (float -> quantize_nvfp4 -> runtime.layouts packers). Full size:
random layout bytes (any byte pattern is a valid code set) with a sample of units checked, so the CPU reference
stays cheap even for the 262144 x 2816 lm_head. Outputs are poisoned (NaN) first, so unwritten rows fail.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402
from thorgen.codegen import reference_kernels as RK
from thorgen.codegen.families.matmul import FOLDS, target_shapes
from thorgen.model_spec.nvfp4 import f32_to_bf16
from thorgen.runtime import layouts as L

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    # (norms: attn_tail, rope_kv: the folds' second kernels, for their pairs)
    return GpuRunner(request.param, ("matmul", "drafter_gemm", "norms", "rope_kv"))


def _ms(kern) -> list[int]:
    if kern.name.split("__")[0].endswith("gemv"):
        return [1]
    if "gemmL" in kern.name:
        return [kern.param("bm") + 37, 3]  # a partial last block, and fewer rows than a block
    if kern.param("mmax") > 16:
        return [32, 21]  # both 16-row tiles full, and a part-full second one
    return [16, 5]


def _poison(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


def _out(kern, m):
    n, epi = kern.param("n"), kern.param("epi")
    width = n if epi == "store" else n // 2
    dt = np.float32 if kern.param("out_dtype") == "f32" else np.float16
    return width, dt


def _launch(runner, kern, inputs, m, width, dt):
    grid = None
    if "gemmL" in kern.name:
        grid = (kern.grid[0], -(-m // kern.param("bm")), 1)
    inputs = dict(inputs, m=np.int32(m), y=_poison((m, width), dt))
    return runner.run(kern, inputs, {"y": ((m, width), dt)}, grid)["y"]


def test_nvfp4_kernels(runner):
    rng = np.random.default_rng(11)
    kernels = [k for k in runner.find("nvfp4_") if k.param("epi") not in FOLDS]  # (the folds: their own tests)
    assert kernels, "matmul family planned no NVFP4 kernels"
    failures = []
    for kern in kernels:
        n, k, epi, order = kern.param("n"), kern.param("k"), kern.param("epi"), kern.param("fp4_order")
        big = n * k > 64 * 1024 * 1024 // 2 or runner.spec.name != "tiny"
        for m in _ms(kern):
            width, dt = _out(kern, m)
            x = R.act_f16(rng, m, k)
            if not big:
                if epi == "store":
                    wt = R.Fp4Weight(rng, n, k, order)
                    w, s, gsc, ref = wt.w, wt.s, wt.gscale, R.gemm_ref(x, wt.dense)
                else:
                    g, u, (w, s, gsc) = R.gate_up_weight(rng, n // 2, k, order, amp=0.5)
                    ref = R.gated_ref(x, g.dense, u.dense, epi)
                y = _launch(runner, kern, {"w": w, "s": s, "gscale": gsc, "x": x}, m, width, dt)
                err = R.norm_err(y, ref)
            else:
                lw = R.LayoutWeight(rng, n, k, order)
                y = _launch(runner, kern, {"w": lw.w, "s": lw.s, "gscale": lw.gscale, "x": x}, m, width, dt)
                if not np.isfinite(y).all():
                    failures.append(f"{kern.name} m={m}: unwritten or non-finite outputs")
                    continue
                units = np.unique(np.concatenate([[0, n // 16 - 1], rng.integers(0, n // 16, 30)]))
                dense = lw.rows(units)
                if epi == "store":
                    cols = (units[:, None] * 16 + np.arange(16)).reshape(-1)
                    ref = R.gemm_ref(x, dense)
                else:  # rows of a unit: 8 gate rows then 8 up rows -> 8 output columns
                    d3 = dense.reshape(len(units), 2, 8, k)
                    cols = (units[:, None] * 8 + np.arange(8)).reshape(-1)
                    ref = R.gated_ref(x, d3[:, 0].reshape(-1, k), d3[:, 1].reshape(-1, k), epi)
                err = R.norm_err(y[:, cols], ref)
            tol = R.TOL_GEMM[kern.param("out_dtype")]
            if not err <= tol:
                failures.append(f"{kern.name} m={m}: error {err:.2e} > {tol}")
    assert not failures, "\n".join(failures)


def test_fused_qkv_scales_are_per_part(runner):
    """A fused q|k|v weight with different global scales per part gives each part's own product."""
    rng = np.random.default_rng(12)
    t = runner.spec.target
    h = t.hidden_size
    cands = [kern for kern in runner.find("nvfp4_gemm16__") if kern.param("k") == h and kern.param("epi") == "store"
             and kern.param("n") % 64 == 0]
    if not cands or runner.spec.name != "tiny":
        pytest.skip("checked on the tiny preset")
    kern = cands[0]
    n, order = kern.param("n"), kern.param("fp4_order")
    sizes = (n // 2, n // 4, n // 4)
    parts = [R.Fp4Weight(rng, rows, h, order, amp=a) for rows, a in zip(sizes, (1.0, 0.01, 30.0))]
    w, s, gsc = L.pack_nvfp4_concat([(p.packed, p.scale, p.gs) for p in parts], order)
    x = R.act_f16(rng, 16, h)
    y = _launch(runner, kern, {"w": w, "s": s, "gscale": gsc, "x": x}, 16, n, np.float32)
    starts = np.cumsum((0,) + sizes)
    for i, p in enumerate(parts):
        err = R.norm_err(y[:, starts[i]:starts[i + 1]], R.gemm_ref(x, p.dense))
        assert err <= R.TOL_GEMM["f32"], f"part {i}: {err:.2e}"


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _units(rng, n: int) -> np.ndarray:
    """The 16-row units of an n-row GEMV to check: all of a small one, a sample (first, last, 30 more) of a big one."""
    return np.arange(n // 16) if n // 16 <= 64 else np.unique(np.concatenate([[0, n // 16 - 1],
                                                                              rng.integers(0, n // 16, 30)]))


def test_gemv_attn_tail(runner):
    """The o_proj GEMV whose last block runs the attention tail (one row), on every o_proj shape: o against the GEMV
    reference (sampled units at full size) and x / a1 / a2 against attn_tail's reference on that o; bit for bit the
    plain GEMV then attn_tail (the two launches it replaces); and a second launch on the same counter runs the tail
    again (the last block left it zeroed)."""
    rng = np.random.default_rng(14)
    folds = [k for k in runner.find("nvfp4_gemv__") if k.param("epi") == "attn_tail"]
    (tail,) = runner.find("attn_tail__")
    o_shapes = [k for role, _, k, _ in target_shapes(runner.spec) if role == "o"]
    assert sorted(kern.param("k") for kern in folds) == sorted(o_shapes), "an o_proj shape without its fold"
    for kern in folds:
        n, k = kern.param("n"), kern.param("k")
        plain = runner.kernels[kern.name.removesuffix("_attn_tail")]
        knobs = (kern.param("ks"), kern.param("pf"), kern.param("tail_threads"))
        assert knobs == (plain.param("ks"), plain.param("pf"), tail.threads), kern.name
        lw = R.LayoutWeight(rng, n, k, kern.param("fp4_order"))
        ws = [f32_to_bf16(rng.normal(1.0, 0.3, n).astype(np.float32)) for _ in range(3)]
        gemv = {"w": lw.w, "s": lw.s, "gscale": lw.gscale, "x": R.act_f16(rng, 1, k), "m": np.int32(1),
                "y": _poison((1, n), np.float32)}
        resid = rng.normal(0, 2, (1, n)).astype(np.float32)
        norms = {"w_post": ws[0], "w_pre1": ws[1], "w_pre2": ws[2], "a1": _poison((1, n), np.float16),
                 "a2": _poison((1, n), np.float16)}
        fold_in = dict(gemv, **norms, resid=resid, counters=np.zeros(1, np.uint32))
        outs = {"y": ((1, n), np.float32), "resid": ((1, n), np.float32), "a1": ((1, n), np.float16),
                "a2": ((1, n), np.float16), "counters": ((1,), np.uint32)}
        got = runner.run(kern, fold_in, outs)
        units = _units(rng, n)
        cols = (units[:, None] * 16 + np.arange(16)).reshape(-1)
        err = R.norm_err(got["y"][:, cols], R.gemm_ref(gemv["x"], lw.rows(units)))
        assert err <= R.TOL_GEMM["f32"], f"{kern.name}: o error {err:.2e}"
        xr, a1r, a2r = RK.attn_tail_ref(got["y"], resid, *ws, kern.param("eps"))
        assert RK.norm_err(got["resid"], xr) <= RK.TOL["f32"], kern.name
        assert RK.norm_err(got["a1"], a1r) <= RK.TOL["f16"] and RK.norm_err(got["a2"], a2r) <= RK.TOL["f16"], kern.name
        assert got["counters"][0] == 0, f"{kern.name}: counter left at {got['counters'][0]}"
        # the pair it replaces: the plain GEMV, then attn_tail on its o (one row: one block, as the runtime launches)
        o = runner.run(plain, gemv, {"y": ((1, n), np.float32)})["y"]
        pair = runner.run(tail, {"o": o, "x": resid, **norms, "T": np.int32(1)},
                          {"x": outs["resid"], "a1": outs["a1"], "a2": outs["a2"]}, (1, 1, 1))
        for what, theirs in (("y", o), ("resid", pair["x"]), ("a1", pair["a1"]), ("a2", pair["a2"])):
            assert np.array_equal(_bits(got[what]), _bits(theirs)), f"{kern.name}: {what} differs from the pair's"
        # two launches on one counter: the second one's tail runs again, from the first one's residual
        twice = runner.run_seq([(kern, None), (kern, None)], fold_in, outs)
        again = runner.run(kern, dict(fold_in, resid=got["resid"]), outs)
        for what in ("resid", "a1", "a2"):
            assert np.array_equal(_bits(twice[what]), _bits(again[what])), f"{kern.name}: second launch's {what}"
        assert twice["counters"][0] == 0, kern.name


def _kv_case(rng, p: dict, HKV: int, D: int):
    """Where a one-token rope_kv launch writes, on lane 1: (rope inputs less the row and weights, cache rows, the
    cache row of each position, the first position). A ring: two lanes of SLOTS rows, lane_bytes apart, at a far
    position (RoPE range reduction near 2.6e5 rad); paged: lane 1's row of a scrambled page table over a pool with
    spare pages (row 0 points at a spare one) at a near position."""
    eb = np.dtype(RK.np_dtype(p["KV"])).itemsize
    if p["SLOTS"]:
        slots, pos = p["SLOTS"], int(rng.integers(250_000, 262_000))
        ins = {"lanes": np.ones(1, np.int32), "lane_bytes": np.int64(slots * HKV * D * eb)}
        return ins, 2 * slots, lambda j: slots + j % slots, pos
    page, pos = p["PAGE"], int(rng.integers(0, 3000))
    n = -(-(pos + 2) // page)
    order = rng.permutation(n + 2)
    table = np.full((2, p["PITCH"]), order[n], np.int32)
    table[1, :n] = order[:n]
    ins = {"lanes": np.ones(1, np.int32), "lane_bytes": np.int64(0), "pages": table}
    return ins, (n + 2) * page, lambda j: int(table[1, j // page]) * page + j % page, pos


def test_gemv_rope_kv(runner):
    """The q|k|v GEMV whose heads' last blocks run rope_kv (one row), for every target rope_kv kernel: the row
    against the GEMV reference (sampled units at full size) and q / K / V against rope_kv's reference on that row,
    written where lane 1's slot is and nowhere else; bit for bit the plain GEMV then the rope_kv kernel (the two
    launches it replaces, one block); a second launch on the same counters at the next position runs every head
    again (the last blocks left them zeroed)."""
    rng = np.random.default_rng(15)
    folds = [k for k in runner.find("nvfp4_gemv__") if k.param("epi") == "rope_kv"]
    ropes = runner.find("rope_kv__tgt_")
    assert sorted(k.param("rope") for k in folds) == sorted(r.name for r in ropes), "a rope_kv kernel without its fold"
    for kern in folds:
        p, n, k = kern.param_dict, kern.param("n"), kern.param("k")
        rope, plain = runner.kernels[p["rope"]], runner.kernels[f"nvfp4_gemv__n{n}_k{k}"]
        assert (p["ks"], p["pf"]) == (plain.param("ks"), plain.param("pf")), kern.name
        HQ, HKV, D, kv_t, q_t = p["HQ"], p["HKV"], p["D"], p["KV"], p["Q"]
        nq, nk, kvdt, qdt = HQ * D, HKV * D, RK.np_dtype(kv_t), RK.np_dtype(q_t)
        lw = R.LayoutWeight(rng, n, k, p["fp4_order"])
        gemv = {"w": lw.w, "s": lw.s, "gscale": lw.gscale, "x": R.act_f16(rng, 1, k), "m": np.int32(1),
                "y": _poison((1, n), np.float32)}
        kv_in, cap, row_of, pos = _kv_case(rng, p, HKV, D)
        rope_in = dict(kv_in, positions=np.array([pos], np.int32), q_out=np.full((1, HQ, D), 0x7FC0, qdt),
                       **{w: f32_to_bf16(rng.normal(1, 0.3, D).astype(np.float32)) for w in ("q_norm_w", "k_norm_w")})
        fold_in = dict(gemv, **rope_in, counters=np.zeros(p["row_heads"], np.uint32))
        outs = {"y": ((1, n), np.float32), "q_out": ((1, HQ, D), qdt), "k_cache": ((cap, HKV, D), kvdt),
                "v_cache": ((cap, HKV, D), kvdt), "counters": ((p["row_heads"],), np.uint32)}
        got = runner.run(kern, fold_in, outs)
        assert not got["counters"].any(), f"{kern.name}: counters left at {got['counters']}"
        units = _units(rng, n)
        cols = (units[:, None] * 16 + np.arange(16)).reshape(-1)
        err = R.norm_err(got["y"][:, cols], R.gemm_ref(gemv["x"], lw.rows(units)))
        assert err <= R.TOL_GEMM["f32"], f"{kern.name}: q|k|v error {err:.2e}"
        y = got["y"]
        q, kr, vr = RK.rope_kv_ref(y[:, :nq], y[:, nq:nq + nk], None if p["V_FROM_K"] else y[:, nq + nk:],
                                   rope_in["q_norm_w"], rope_in["k_norm_w"], rope_in["positions"], HQ=HQ, HKV=HKV, D=D,
                                   rot=p["ROT"], theta=p["THETA"], has_q=True, v_from_k=p["V_FROM_K"],
                                   v_norm=p["V_NORM"], eps=p["EPS"])
        assert RK.norm_err(RK.load(got["q_out"], q_t), q) <= RK.TOL[q_t], kern.name
        sl = row_of(pos)
        for name, ref in (("k_cache", kr[0]), ("v_cache", vr[0])):
            cache = got[name]
            assert RK.norm_err(RK.load(cache[sl], kv_t), ref) <= RK.TOL[kv_t], (kern.name, name)
            assert RK.norm_err(RK.load(cache[sl], kv_t), RK.load(RK.store(ref, kv_t), kv_t)) <= RK.TOL[kv_t] / 4
            assert not np.delete(cache, sl, axis=0).any(), f"{kern.name}: {name} written outside row {sl}"
        # the pair it replaces: the plain GEMV, then rope_kv on its row (one row: one block, as the runtime launches)
        row = runner.run(plain, gemv, {"y": outs["y"]})["y"]
        raw = {"q_raw": row[:, :nq], "k_raw": row[:, nq:nq + nk]}
        if not p["V_FROM_K"]:
            raw["v_raw"] = row[:, nq + nk:]
        pair = runner.run(rope, dict(rope_in, **raw, q_stride=np.int32(nq), kv_stride=np.int32(nk), T=np.int32(1)),
                          {w: outs[w] for w in ("q_out", "k_cache", "v_cache")}, (1, 1, 1))
        for what, theirs in (("y", row), ("q_out", pair["q_out"]), ("k_cache", pair["k_cache"]),
                             ("v_cache", pair["v_cache"])):
            assert np.array_equal(_bits(got[what]), _bits(theirs)), f"{kern.name}: {what} differs from the pair's"
        # two launches on the same counters, the second at the next position: its heads all run again (a second
        # slot written, q of that position), as a fresh launch there does
        nxt = {"positions": np.array([pos + 1], np.int32)}
        twice = runner.run_seq([(kern, None), (kern, None, nxt)], fold_in, outs)
        again = runner.run(kern, dict(fold_in, **nxt), outs)
        assert np.array_equal(_bits(twice["q_out"]), _bits(again["q_out"])), f"{kern.name}: second launch's q"
        for name in ("k_cache", "v_cache"):
            both = _bits(got[name]) | _bits(again[name])  # (disjoint rows: the two positions' slots)
            assert np.array_equal(_bits(twice[name]), both), f"{kern.name}: second launch's {name}"
        assert not twice["counters"].any(), kern.name


def test_drafter_gemms(runner):
    rng = np.random.default_rng(13)
    kernels = runner.find("bf16_")
    if runner.spec.drafter is None:
        pytest.skip("no drafter")
    assert kernels
    failures = []
    for kern in kernels:
        n, k, epi = kern.param("n"), kern.param("k"), kern.param("epi")
        wf = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        bits = L.bf16_to_f16_bits(f32_to_bf16(wf))
        w16 = bits.view(np.float16).astype(np.float64)
        wl = L.pack_half(bits) if epi == "store" else L.pack_half_gate_up(bits[: n // 2], bits[n // 2:])
        for m in _ms(kern):
            width, dt = _out(kern, m)
            x = R.act_f16(rng, m, k)
            ref = R.gemm_ref(x, w16) if epi == "store" else R.gated_ref(x, w16[: n // 2], w16[n // 2:], epi)
            y = _launch(runner, kern, {"w": wl.view(np.uint8), "x": x}, m, width, dt)
            err = R.norm_err(y, ref)
            if not err <= R.TOL_GEMM[kern.param("out_dtype")]:
                failures.append(f"{kern.name} m={m}: error {err:.2e}")
    assert not failures, "\n".join(failures)
