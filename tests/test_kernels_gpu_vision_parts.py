"""GPU tests: each vision kernel alone, at both presets' tower shapes (the full-size tower: hidden 1152, 16 heads of
72 padded to 128, intermediate 4304 padded to 4352), against its NumPy reference in tests/emulated_vision.py with the
tolerance written there. Row counts: a 6x9 image (54 patches), a 720p image at budget 280 (2,376 patches: more rows
than a row kernel's grid, several GEMM row tiles and attention query blocks). Outputs start as NaN, so an unwritten
element fails. Skip without a GPU / cuda-python / nvcc."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import emulated_vision as EV  # noqa: E402
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402
from test_kernels_gpu_matmul import _out  # noqa: E402
from test_vision_program import _grid  # noqa: E402
from thorgen.model_spec.nvfp4 import bf16_to_f32, f32_to_bf16  # noqa: E402
from thorgen.runtime.convert.layouts import pack_half, pack_half_gate_up  # noqa: E402

pytestmark = pytest.mark.gpu

GRIDS = ((6, 9), (66, 36))  # patch grids (width, height): 54 and 2,376 patches
BF16_NAN = 0xFFFF


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("vision", "attention"))


def _one(runner, stem: str):
    found = [k for k in runner.kernels.values() if k.name.startswith(stem)]
    assert len(found) == 1, f"{stem}: {[k.name for k in found]}"
    return found[0]


def _grid_pos(gw: int, gh: int) -> np.ndarray:
    ys, xs = np.divmod(np.arange(gw * gh), gw)
    return np.stack([xs, ys], 1).astype(np.int32)


def _bf16(rng, shape, mean=0.0, std=1.0) -> np.ndarray:
    return f32_to_bf16((rng.standard_normal(shape) * std + mean).astype(np.float32))


def _run_rows(runner, kern, inputs: dict, outputs: dict, rows: int) -> dict:
    return runner.run(kern, dict(inputs, T=np.int32(inputs.get("T", rows))), outputs, _grid(kern, rows))


def test_patch_prep(runner):
    kern = _one(runner, "vis_patch_prep__")
    pd, rng = kern.param("PD"), np.random.default_rng(1)
    for gw, gh in GRIDS:
        T = gw * gh
        p = rng.integers(0, 256, (T, pd), np.uint8)
        p.flat[:256] = np.arange(256)  # every pixel value
        got = _run_rows(
            runner, kern, {"p": p, "out": np.full((T, pd), np.nan, np.float16)}, {"out": ((T, pd), np.float16)}, T
        )["out"]
        np.testing.assert_array_equal(got, EV.patch_prep_ref(p))  # one f32 op, one f16 rounding: exact


def test_embed_norm(runner):
    kern = _one(runner, "vis_embed_norm__")
    H, HP, P, eps = (kern.param(n) for n in ("H", "HP", "P", "EPS"))
    rng, failures = np.random.default_rng(2), []
    for gw, gh in GRIDS:
        T = gw * gh
        x = rng.standard_normal((T, H)).astype(np.float32)
        table, w = _bf16(rng, (2, P, H), std=0.5), _bf16(rng, H, 1.0, 0.05)
        pos = rng.integers(0, P, (T, 2)).astype(np.int32)  # any entry of the table, the last one included
        pos[-1] = P - 1
        got = _run_rows(
            runner,
            kern,
            {"x": x, "table": table, "pos": pos, "w": w, "a": np.full((T, HP), np.nan, np.float16)},
            {"x": ((T, H), np.float32), "a": ((T, HP), np.float16)},
            T,
        )
        want_x, want_a = EV.embed_norm_ref(x, table, pos, w, eps, HP)
        failures += _check(f"T={T} x", got["x"], want_x, EV.TOL_VIS_RESID)
        failures += _check(f"T={T} a", got["a"], want_a, EV.TOL_VIS_ROWS, pad_from=H)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("last_layer", [False, True])
def test_sandwich(runner, last_layer):
    kern = _one(runner, "vis_sandwich__")
    H, HP, eps = (kern.param(n) for n in ("H", "HP", "EPS"))
    rng, failures = np.random.default_rng(3), []
    for gw, gh in GRIDS:
        T = gw * gh
        x, y = (rng.standard_normal((T, H)).astype(np.float32) * s for s in (3.0, 1.0))
        w_post, w_next = _bf16(rng, H, 1.0, 0.05), None if last_layer else _bf16(rng, H, 1.0, 0.05)
        inputs = {"x": x, "y": y, "w_post": w_post, "a": np.full((T, HP), np.nan, np.float16)}
        if w_next is not None:
            inputs["w_next"] = w_next
        got = _run_rows(runner, kern, inputs, {"x": ((T, H), np.float32), "a": ((T, HP), np.float16)}, T)
        want_x, want_a = EV.sandwich_ref(x, y, w_post, w_next, eps, HP)
        failures += _check(f"T={T} x", got["x"], want_x, EV.TOL_VIS_RESID)
        if last_layer:  # no next norm: the activations are left as they were
            failures += [] if np.isnan(got["a"]).all() else [f"T={T}: a written without w_next"]
        else:
            failures += _check(f"T={T} a", got["a"], want_a, EV.TOL_VIS_ROWS, pad_from=H)
    assert not failures, "\n".join(failures)


def test_qkv_rope(runner):
    kern = _one(runner, "vis_qkv_rope__")
    NH, D, DP, theta, eps = (kern.param(n) for n in ("NH", "D", "DP", "THETA", "EPS"))
    rng, failures = np.random.default_rng(4), []
    for gw, gh in GRIDS:
        T = gw * gh
        qkv = rng.standard_normal((T, 3 * NH * D)).astype(np.float32)
        qw, kw = _bf16(rng, D, D**-0.25, 0.05), _bf16(rng, D, D**-0.25, 0.05)
        pos = _grid_pos(gw, gh) * 97 % 10240  # large angles too (the real table has 10240 positions)
        nan = np.full((T, NH, DP), BF16_NAN, np.uint16)
        got = _run_rows(
            runner,
            kern,
            {"qkv": qkv, "q_norm_w": qw, "k_norm_w": kw, "pos": pos, "q": nan, "k": nan, "v": nan},
            {n: ((T, NH, DP), np.uint16) for n in "qkv"},
            T,
        )
        for name, want in zip("qkv", EV.qkv_rope_ref(qkv, qw, kw, pos, NH, D, DP, theta, eps)):
            failures += _check(f"T={T} {name}", bf16_to_f32(got[name]), bf16_to_f32(want), EV.TOL_VIS_ROPE, pad_from=D)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("images", [1, 3])
def test_pool(runner, images):
    """Each image's cells pooled (`images` images of one grid back to back: each against its own reference)."""
    kern = _one(runner, "vis_pool__")
    H, HP, pool, eps = (kern.param(n) for n in ("H", "HP", "POOL", "EPS"))
    rng, failures = np.random.default_rng(5), []
    for gw, gh in GRIDS:
        L, T = images * gw * gh, images * gw * gh // pool**2
        x = rng.standard_normal((L, H)).astype(np.float32)
        pos = np.concatenate([_grid_pos(gw, gh)] * images)
        bias = (rng.standard_normal(H) * 0.5 * H**0.5).astype(np.float32)
        scale = rng.uniform(0.5, 1.5, H).astype(np.float32) * np.float32(H**-0.5)
        got = _run_rows(
            runner,
            kern,
            {
                "x": x,
                "pos": pos,
                "std_bias": bias,
                "std_scale": scale,
                "T": T,
                "TI": np.int32(T // images),
                "out": np.full((T, HP), np.nan, np.float16),
            },
            {"out": ((T, HP), np.float16)},
            T,
        )["out"]
        n, per = T // images, L // images
        for b in range(images):
            want = EV.pool_ref(x[b * per : (b + 1) * per], pos[:per], bias, scale, pool, eps, HP)
            failures += _check(f"T={T} image {b}", got[b * n : (b + 1) * n], want, EV.TOL_VIS_ROWS, pad_from=H)
    assert not failures, "\n".join(failures)


def test_gemms(runner):
    """Every tower linear's GEMM (patch input, q|k|v, o, gate|up with GELU, down, the projection)."""
    kernels = [k for k in runner.kernels.values() if k.name.startswith("vis_gemmL__")]
    assert len({(k.param("n"), k.param("k")) for k in kernels}) >= 5, [k.name for k in kernels]
    rng, failures = np.random.default_rng(6), []
    for kern in kernels:
        n, k, epi = kern.param("n"), kern.param("k"), kern.param("epi")
        w16 = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float16)
        bits = w16.view(np.uint16)
        packed = pack_half(bits) if epi == "store" else pack_half_gate_up(bits[: n // 2], bits[n // 2 :])
        for m in (3, kern.param("bm") + 37, 66 * 36):
            width, dt = _out(kern, m)
            x = R.act_f16(rng, m, k)
            ref = R.gemm_ref(x, w16) if epi == "store" else R.gated_ref(x, w16[: n // 2], w16[n // 2 :], epi)
            y = runner.run(
                kern,
                {"w": packed.view(np.uint8), "x": x, "m": np.int32(m), "y": np.full((m, width), np.nan, dt)},
                {"y": ((m, width), dt)},
                _grid(kern, m),
            )["y"]
            err = R.norm_err(y, ref)
            if not err <= R.TOL_GEMM[kern.param("out_dtype")]:
                failures.append(f"{kern.name} m={m}: error {err:.2e}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("images", [1, 2])
def test_attention(runner, images):
    """Every patch attends every other of its image (scale 1), heads zero-padded past head_dim as the q/k/v kernel
    writes them; `images` images back to back, each against its own reference."""
    kern = _one(runner, "vis_attn__")
    d = runner.spec.vision.head_dim
    dp, nh = kern.param("DP"), kern.param("NH")
    rng, failures = np.random.default_rng(7), []
    for gw, gh in GRIDS:
        L, rows = gw * gh, images * gw * gh
        q, k, v = (np.zeros((rows, nh, dp), np.float32) for _ in range(3))
        for t, std in ((q, d**-0.25), (k, d**-0.25), (v, 1.0)):  # q.k ~ N(0, 1), as the synthetic tower
            t[..., :d] = rng.standard_normal((rows, nh, d)) * std
        qb, kb, vb = (f32_to_bf16(t) for t in (q, k, v))
        inputs = {"q": qb, "k": kb, "v": vb, "T": np.int32(L), "B": np.int32(images)}
        inputs["out"] = np.full((rows, nh, dp), np.nan, np.float16)
        got = runner.run(kern, inputs, {"out": ((rows, nh, dp), np.float16)}, _grid(kern, L))["out"]
        for b in range(0, rows, L):
            want = EV.attention_ref(*(bf16_to_f32(t[b : b + L]) for t in (qb, kb, vb)))
            failures += _check(f"L={L} rows {b}..", got[b : b + L], want, EV.TOL_VIS_ATTN, pad_from=d)
    assert not failures, "\n".join(failures)


def _check(what: str, got: np.ndarray, want: np.ndarray, tol: float, pad_from: int | None = None) -> list[str]:
    """A failure line when `got` is off `want` by more than tol (norm_err), or a padding column is not zero."""
    out = []
    err = R.norm_err(got, want)
    if not err <= tol:
        out.append(f"{what}: error {err:.2e} > {tol}")
    if pad_from is not None and not (np.asarray(got, np.float64)[..., pad_from:] == 0).all():
        out.append(f"{what}: padding past column {pad_from} is not zero")
    return out
