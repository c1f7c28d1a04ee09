"""GPU tests: NVFP4 GEMV / verify GEMM / prefill GEMM (matmul family), the o_proj GEMV with the attention tail
folded in, their fp16-weight forms for bf16 target linears (ALL_BF16 plans), and the drafter's fp16 GEMMs against
NumPy.

Tiny preset: weights go through the real path (float -> quantize_nvfp4 -> runtime.convert.layouts packers). Full size:
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
from gpu_harness import PRESETS, GpuRunner, bits  # noqa: E402
import reference_kernels as RK  # noqa: E402
from thorgen.codegen.families.matmul import gemm_small, target_gemm, target_shapes
from thorgen.model_spec.nvfp4 import f32_to_bf16
from thorgen.runtime.convert import layouts as L
from thorgen.runtime.convert.linears import pack_bf16_linear

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("matmul", "drafter_gemm", "norms"))  # (norms: attn_tail, for the fold's pair)


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
    kernels = [k for k in runner.find("nvfp4_") if k.param("epi") != "attn_tail"]  # (the fold: its own test)
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


def test_rows_do_not_depend_on_the_row_count(runner):
    """A row's output has the same bits from the M = 1 GEMV (the swapped form) as from the 16- and 32-row GEMMs, at
    any row count and position: a sequence's tokens must not depend on the batch it decodes in."""
    rng = np.random.default_rng(13)
    forms: dict = {}
    for kern in runner.find("nvfp4_gem"):
        if "gemmL" not in kern.name and kern.param("epi") != "attn_tail":
            forms.setdefault((kern.param("n"), kern.param("k"), kern.param("epi")), []).append(kern)
    failures = []
    for (n, k, epi), kernels in sorted(forms.items()):
        lw = R.LayoutWeight(rng, n, k, kernels[0].param("fp4_order"))
        x = R.act_f16(rng, 32, k)
        w = {"w": lw.w, "s": lw.s, "gscale": lw.gscale}
        rows = {}  # (kernel, m) -> rows 0..m-1
        for kern in kernels:
            width, dt = _out(kern, 1)
            for m in [1] if kern.param("mmax") == 1 else [kern.param("mmax"), 5]:
                rows[(kern.name, m)] = _launch(runner, kern, dict(w, x=x[:m]), m, width, dt)
        first = next(iter(rows.values()))[0]
        for (name, m), y in rows.items():
            if not np.array_equal(bits(y[0]), bits(first)):
                failures.append(f"n={n} k={k} {epi}: row 0 of {name} at m={m} differs from {kernels[0].name}")
        for (name, m), y in rows.items():  # a row at another position among other rows
            if m >= 5 and not np.array_equal(bits(y[:5]), bits(rows[(name, 5)] if (name, 5) in rows else y[:5])):
                failures.append(f"n={n} k={k} {epi}: rows 0..4 of {name} differ between m={m} and m=5")
    assert not failures, "\n".join(failures)


def test_fused_qkv_scales_are_per_part(runner):
    """A fused q|k|v weight with different global scales per part gives each part's own product."""
    rng = np.random.default_rng(12)
    t = runner.spec.target
    h = t.hidden_size
    cands = [
        kern
        for kern in runner.find("nvfp4_gemm16__")
        if kern.param("k") == h and kern.param("epi") == "store" and kern.param("n") % 64 == 0
    ]
    if not cands or runner.spec.name != "tiny":
        pytest.skip("checked on the tiny preset")
    kern = cands[0]
    n, order = kern.param("n"), kern.param("fp4_order")
    sizes = (n // 2, n // 4, n // 4)
    parts = [R.Fp4Weight(rng, rows, h, order, amp=a) for rows, a in zip(sizes, (1.0, 0.01, 30.0))]
    w, s, gsc = L.pack_nvfp4_concat([(p.packed, p.scale, p.mul) for p in parts], order)
    x = R.act_f16(rng, 16, h)
    y = _launch(runner, kern, {"w": w, "s": s, "gscale": gsc, "x": x}, 16, n, np.float32)
    starts = np.cumsum((0,) + sizes)
    for i, p in enumerate(parts):
        err = R.norm_err(y[:, starts[i] : starts[i + 1]], R.gemm_ref(x, p.dense))
        assert err <= R.TOL_GEMM["f32"], f"part {i}: {err:.2e}"


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
    # the plain one-row o_proj GEMV is no step's kernel (the fold replaces it): built here for the comparison
    plains = {f.name: gemm_small(f.param("n"), f.param("k"), 1, "store", runner.arch) for f in folds}
    runner.add(list(plains.values()))
    for kern in folds:
        n, k = kern.param("n"), kern.param("k")
        plain = plains[kern.name]
        knobs = (kern.param("ks"), kern.param("pf"), kern.param("tail_threads"))
        assert knobs == (plain.param("ks"), plain.param("pf"), tail.threads), kern.name
        lw = R.LayoutWeight(rng, n, k, kern.param("fp4_order"))
        ws = [f32_to_bf16(rng.normal(1.0, 0.3, n).astype(np.float32)) for _ in range(3)]
        gemv = {
            "w": lw.w,
            "s": lw.s,
            "gscale": lw.gscale,
            "x": R.act_f16(rng, 1, k),
            "m": np.int32(1),
            "y": _poison((1, n), np.float32),
        }
        resid = rng.normal(0, 2, (1, n)).astype(np.float32)
        norms = {
            "w_post": ws[0],
            "w_pre1": ws[1],
            "w_pre2": ws[2],
            "a1": _poison((1, n), np.float16),
            "a2": _poison((1, n), np.float16),
        }
        fold_in = dict(gemv, **norms, resid=resid, counters=np.zeros(1, np.uint32))
        outs = {
            "y": ((1, n), np.float32),
            "resid": ((1, n), np.float32),
            "a1": ((1, n), np.float16),
            "a2": ((1, n), np.float16),
            "counters": ((1,), np.uint32),
        }
        got = runner.run(kern, fold_in, outs)
        units = (
            np.arange(n // 16)
            if n // 16 <= 64
            else np.unique(np.concatenate([[0, n // 16 - 1], rng.integers(0, n // 16, 30)]))
        )
        cols = (units[:, None] * 16 + np.arange(16)).reshape(-1)
        err = R.norm_err(got["y"][:, cols], R.gemm_ref(gemv["x"], lw.rows(units)))
        assert err <= R.TOL_GEMM["f32"], f"{kern.name}: o error {err:.2e}"
        xr, a1r, a2r = RK.attn_tail_ref(got["y"], resid, *ws, kern.param("eps"))
        assert RK.norm_err(got["resid"], xr) <= RK.TOL["f32"], kern.name
        assert RK.norm_err(got["a1"], a1r) <= RK.TOL["f16"] and RK.norm_err(got["a2"], a2r) <= RK.TOL["f16"], kern.name
        assert got["counters"][0] == 0, f"{kern.name}: counter left at {got['counters'][0]}"
        # the pair it replaces: the plain GEMV, then attn_tail on its o (one row: one block, as the runtime launches)
        o = runner.run(plain, gemv, {"y": ((1, n), np.float32)})["y"]
        pair = runner.run(
            tail,
            {"o": o, "x": resid, **norms, "T": np.int32(1)},
            {"x": outs["resid"], "a1": outs["a1"], "a2": outs["a2"]},
            (1, 1, 1),
        )
        for what, theirs in (("y", o), ("resid", pair["x"]), ("a1", pair["a1"]), ("a2", pair["a2"])):
            assert np.array_equal(bits(got[what]), bits(theirs)), f"{kern.name}: {what} differs from the pair's"
        # two launches on one counter: the second one's tail runs again, from the first one's residual
        twice = runner.run_seq([(kern, None), (kern, None)], fold_in, outs)
        again = runner.run(kern, dict(fold_in, resid=got["resid"]), outs)
        for what in ("resid", "a1", "a2"):
            assert np.array_equal(bits(twice[what]), bits(again[what])), f"{kern.name}: second launch's {what}"
        assert twice["counters"][0] == 0, kern.name


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
        hbits = L.bf16_to_f16_bits(f32_to_bf16(wf))
        w16 = hbits.view(np.float16).astype(np.float64)
        wl = L.pack_half(hbits) if epi == "store" else L.pack_half_gate_up(hbits[: n // 2], hbits[n // 2 :])
        for m in _ms(kern):
            width, dt = _out(kern, m)
            x = R.act_f16(rng, m, k)
            ref = R.gemm_ref(x, w16) if epi == "store" else R.gated_ref(x, w16[: n // 2], w16[n // 2 :], epi)
            y = _launch(runner, kern, {"w": wl.view(np.uint8), "x": x}, m, width, dt)
            err = R.norm_err(y, ref)
            if not err <= R.TOL_GEMM[kern.param("out_dtype")]:
                failures.append(f"{kern.name} m={m}: error {err:.2e}")
    assert not failures, "\n".join(failures)


# ---- bf16 target linears: the fp16-weight forms of the same kernels (ALL_BF16 plans) --------------------------------
@pytest.fixture(scope="module", params=PRESETS)
def half_runner(request):
    return GpuRunner(request.param, ("matmul", "norms"), "ALL_BF16")


def _half_weight(rng, n: int, k: int, epi: str):
    """(layout uint8, float64 [n, k] as the kernel reads it) of a random fp16-weight matrix (gate/up interleaved for
    the gated epilogues). Full size: random fp16 bit patterns of 2^-8 .. 2^-5 with random signs, in the layout."""
    if n * k <= 64 * 1024 * 1024 // 2:
        parts = [R.Bf16Weight(rng, n, k)] if epi == "store" else [R.Bf16Weight(rng, n // 2, k) for _ in range(2)]
        flat = pack_bf16_linear([p.bits for p in parts], "single" if epi == "store" else "interleave8")
    else:
        flat = (
            rng.integers(0x1C00, 0x2800, n * k, dtype=np.uint16) | (rng.integers(0, 2, n * k, dtype=np.uint16) << 15)
        ).astype(np.uint16)
    return flat.view(np.uint8), L.unpack_half(flat, n, k).view(np.float16).astype(np.float64)


def test_half_kernels(half_runner):
    """Every fp16-weight GEMV / GEMM / prefill GEMM of the target (store and gelu) against the float64 reference."""
    runner, rng, failures = half_runner, np.random.default_rng(31), []
    kernels = [k for k in runner.find("half_") if k.param("epi") in ("store", "gelu_mul")]
    assert {k.name.split("__")[0] for k in kernels} == {"half_gemv", "half_gemm16", "half_gemm32", "half_gemmL"}
    for kern in kernels:
        n, k, epi = kern.param("n"), kern.param("k"), kern.param("epi")
        w, dense = _half_weight(rng, n, k, epi)
        for m in _ms(kern):
            width, dt = _out(kern, m)
            x = R.act_f16(rng, m, k)
            if epi == "store":
                ref = R.gemm_ref(x, dense)
            else:
                g, u = L.deinterleave8(dense)
                ref = R.gated_ref(x, g, u, epi)
            err = R.norm_err(_launch(runner, kern, {"w": w, "x": x}, m, width, dt), ref)
            if not err <= R.TOL_GEMM[kern.param("out_dtype")]:
                failures.append(f"{kern.name} m={m}: error {err:.2e}")
    assert not failures, "\n".join(failures)


def test_half_rows_do_not_depend_on_the_row_count(half_runner):
    """Batch invariance of the fp16-weight forms: a row has the same bits from the GEMV and the 16- / 32-row GEMMs."""
    runner, rng, failures = half_runner, np.random.default_rng(32), []
    forms: dict = {}
    for kern in runner.find("half_gem"):
        if "gemmL" not in kern.name and kern.param("epi") != "attn_tail":
            forms.setdefault((kern.param("n"), kern.param("k"), kern.param("epi")), []).append(kern)
    assert forms
    for (n, k, epi), kernels in sorted(forms.items()):
        w, _ = _half_weight(rng, n, k, epi)
        x = R.act_f16(rng, 32, k)
        rows = {}
        for kern in kernels:
            width, dt = _out(kern, 1)
            for m in [1] if kern.param("mmax") == 1 else [kern.param("mmax"), 5]:
                rows[(kern.name, m)] = _launch(runner, kern, {"w": w, "x": x[:m]}, m, width, dt)
        first = next(iter(rows.values()))[0]
        failures += [
            f"n={n} k={k} {epi}: row 0 of {name} at m={m} differs"
            for (name, m), y in rows.items()
            if not np.array_equal(bits(y[0]), bits(first))
        ]
    assert not failures, "\n".join(failures)


def test_half_gemv_attn_tail(half_runner):
    """The fp16-weight o_proj GEMV with the attention tail folded in: bit for bit the plain fp16 GEMV then attn_tail,
    and its counter left zeroed."""
    runner, rng = half_runner, np.random.default_rng(33)
    folds = [k for k in runner.find("half_gemv__") if k.param("epi") == "attn_tail"]
    (tail,) = runner.find("attn_tail__")
    assert folds
    plains = {f.name: target_gemm(f.param("n"), f.param("k"), 1, "store", runner.arch, "bf16") for f in folds}
    runner.add([p for p in plains.values() if p.name not in runner.kernels])
    for kern in folds:
        n, k = kern.param("n"), kern.param("k")
        w, dense = _half_weight(rng, n, k, "store")
        ws = [f32_to_bf16(rng.normal(1.0, 0.3, n).astype(np.float32)) for _ in range(3)]
        gemv = {"w": w, "x": R.act_f16(rng, 1, k), "m": np.int32(1), "y": _poison((1, n), np.float32)}
        resid = rng.normal(0, 2, (1, n)).astype(np.float32)
        norms = {
            "w_post": ws[0],
            "w_pre1": ws[1],
            "w_pre2": ws[2],
            "a1": _poison((1, n), np.float16),
            "a2": _poison((1, n), np.float16),
        }
        outs = {
            "y": ((1, n), np.float32),
            "resid": ((1, n), np.float32),
            "a1": ((1, n), np.float16),
            "a2": ((1, n), np.float16),
            "counters": ((1,), np.uint32),
        }
        got = runner.run(kern, dict(gemv, **norms, resid=resid, counters=np.zeros(1, np.uint32)), outs)
        assert R.norm_err(got["y"], R.gemm_ref(gemv["x"], dense)) <= R.TOL_GEMM["f32"], kern.name
        o = runner.run(plains[kern.name], gemv, {"y": ((1, n), np.float32)})["y"]
        pair = runner.run(
            tail,
            {"o": o, "x": resid, **norms, "T": np.int32(1)},
            {"x": outs["resid"], "a1": outs["a1"], "a2": outs["a2"]},
            (1, 1, 1),
        )
        for what, theirs in (("y", o), ("resid", pair["x"]), ("a1", pair["a1"]), ("a2", pair["a2"])):
            assert np.array_equal(bits(got[what]), bits(theirs)), f"{kern.name}: {what} differs from the pair's"
        assert got["counters"][0] == 0, kern.name
