"""GPU tests: Q/K norm + RoPE (default / proportional) + V norm + KV-cache write (bf16, fp8; ring, linear and paged:
a paged cache's positions land where lane 1's row of a scrambled page table puts them, nowhere else), and the q|k|v
GEMV with it folded in (the decode step's attention prologue in one launch), NVFP4 and fp16-weight (bf16 attention)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
import matmul_reference as MR  # noqa: E402
from gpu_harness import PRESETS, GpuRunner, bits  # noqa: E402
import reference_kernels as R
from thorgen.codegen.families.matmul import target_gemm
from thorgen.model_spec.nvfp4 import f32_to_bf16

pytestmark = pytest.mark.gpu
T = 5


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("rope_kv",))


@pytest.fixture(scope="module", params=PRESETS)
def half_runner(request):
    """bf16 attention weights (ALL_BF16): the folded GEMV's fp16-weight form."""
    return GpuRunner(request.param, ("rope_kv",), "ALL_BF16")


@pytest.mark.parametrize("far", [False, True], ids=["near", "far"])
def test_rope_kv(runner, far):
    rng = np.random.default_rng(11 + far)
    for k in runner.find("rope_kv__"):
        p = k.param_dict
        HQ, HKV, D, slots = p["HQ"], p["HKV"], p["D"], p["SLOTS"]
        if far and not slots:
            continue  # far positions (RoPE range reduction near 2.6e5 rad) on the ring caches only
        start = int(rng.integers(250_000, 262_000)) if far else int(rng.integers(0, 3000))
        positions = (start + np.arange(T)).astype(np.int32)
        cap = slots or int(positions.max()) + 1
        q_raw = rng.normal(0, 2, (T, HQ * D)).astype(np.float32)
        k_raw = rng.normal(0, 2, (T, HKV * D)).astype(np.float32)
        v_raw = rng.normal(0, 2, (T, HKV * D)).astype(np.float32)
        q_w, k_w = (f32_to_bf16(rng.normal(1, 0.3, D).astype(np.float32)) for _ in range(2))
        kv_t, q_t = p["KV"], p["Q"]
        # near: each token's inputs sit in a wider row (the target reads its q|k|v GEMM rows in place), the rest
        # of the row NaN, so a kernel that ignores the strides fails; far: packed rows
        pad = 0 if far else 96
        strided = [np.concatenate([a, np.full((T, pad), np.nan, np.float32)], axis=1) for a in (q_raw, k_raw, v_raw)]
        inputs = {
            "q_raw": strided[0],
            "k_raw": strided[1],
            "v_raw": strided[2],
            "q_norm_w": q_w,
            "k_norm_w": k_w,
            "positions": positions,
            "q_stride": np.int32(HQ * D + pad),
            "kv_stride": np.int32(HKV * D + pad),
            "T": np.int32(T),
        }
        sl = R.cache_slots(positions, slots)
        if p["PAGE"]:  # lane 1's pages scattered over a pool with spare pages; row 0 points at a spare one
            page, n = p["PAGE"], -(-cap // p["PAGE"])
            order = rng.permutation(n + 2)
            table = np.full((2, p["PITCH"]), order[n], np.int32)
            table[1, :n] = order[:n]
            inputs |= {"pages": table, "lanes": np.ones(T, np.int32)}
            sl, cap = table[1, positions // page].astype(np.int64) * page + positions % page, (n + 2) * page
        outputs = {"k_cache": ((cap, HKV, D), R.np_dtype(kv_t)), "v_cache": ((cap, HKV, D), R.np_dtype(kv_t))}
        if p["HAS_Q"]:
            outputs["q_out"] = ((T, HQ, D), R.np_dtype(q_t))
        got = runner.run(k, inputs, outputs, (3, 1, 1))
        q, kr, vr = R.rope_kv_ref(
            q_raw,
            k_raw,
            v_raw,
            q_w,
            k_w,
            positions,
            HQ=HQ,
            HKV=HKV,
            D=D,
            rot=p["ROT"],
            theta=p["THETA"],
            has_q=p["HAS_Q"],
            v_from_k=p["V_FROM_K"],
            v_norm=p["V_NORM"],
            eps=p["EPS"],
        )
        for name, ref in (("k_cache", kr), ("v_cache", vr)):
            cache = got[name]
            err = R.norm_err(R.load(cache[sl], kv_t), ref)
            assert err <= R.TOL[kv_t], (k.name, name, err)
            # rounding the reference the kernel's way gives nearly the same bits (only boundary cases differ)
            assert R.norm_err(R.load(cache[sl], kv_t), R.load(R.store(ref, kv_t), kv_t)) <= R.TOL[kv_t] / 4
            untouched = np.ones(cap, bool)
            untouched[sl] = False
            assert not cache[untouched].any(), f"{k.name}: {name} written outside slots {sl}"
        if p["HAS_Q"]:
            assert R.norm_err(R.load(got["q_out"], q_t), q) <= R.TOL[q_t], k.name
        if p["ROT"] < D // 2:  # proportional RoPE: the non-rotating dims are the normed values, unrotated
            kn = R.rms(k_raw.reshape(T, HKV, D), R.load(k_w, "bf16"), p["EPS"])
            mid = np.r_[p["ROT"] : D // 2, D // 2 + p["ROT"] : D]
            assert R.norm_err(R.load(got["k_cache"][sl], kv_t)[..., mid], kn[..., mid]) <= R.TOL[kv_t]


def test_gemv_rope_kv(runner):
    """The q|k|v GEMV whose last block of each head runs rope_kv's warp for it (one row), on every layer kind and
    cache dtype: bit for bit the plain GEMV then rope_kv (the two launches it replaces), q / K / V against the
    reference on that row, the counters left zeroed, and a second launch on the same counters again the same."""
    check_gemv_rope_kv(runner, "nvfp4")


def test_half_gemv_rope_kv(half_runner):
    """The same for the fp16-weight fold (bf16 attention weights)."""
    check_gemv_rope_kv(half_runner, "bf16")


def _weights(rng, kern, n: int, k: int) -> dict:
    """The fold's weight arguments: random NVFP4 layout bytes, or random fp16 weights (2^-8 .. 2^-5) in the half
    layout."""
    if kern.param("kind") == "half":
        bits16 = rng.integers(0x1C00, 0x2800, n * k, dtype=np.uint16) | (
            rng.integers(0, 2, n * k, dtype=np.uint16) << 15
        )
        return {"w": bits16.view(np.uint8)}
    lw = MR.LayoutWeight(rng, n, k, kern.param("fp4_order"))
    return {"w": lw.w, "s": lw.s, "gscale": lw.gscale}


def check_gemv_rope_kv(runner, fmt: str):
    rng = np.random.default_rng(15)
    folds = runner.find("nvfp4_gemv__" if fmt == "nvfp4" else "half_gemv__")
    ropes = {k.name for k in runner.find("rope_kv__tgt_")}
    assert folds and {"rope_kv__" + f.name.split("_rope__")[1] for f in folds} == ropes, "a layer kind without fold"
    plains = {f.name: target_gemm(f.param("n"), f.param("k"), 1, "store", runner.arch, fmt) for f in folds}
    runner.add(list(plains.values()))
    for kern in folds:
        p, plain = kern.param_dict, plains[kern.name]
        rope = runner.kernels["rope_kv__" + kern.name.split("_rope__")[1]]
        assert (p["ks"], p["pf"], p["un"]) == (plain.param("ks"), plain.param("pf"), plain.param("un")), kern.name
        n, k, HQ, HKV, D, slots = p["n"], p["k"], p["HQ"], p["HKV"], p["D"], p["SLOTS"]
        nq, nk, kv_t, q_t = HQ * D, HKV * D, p["KV"], p["Q"]
        gemv = dict(_weights(rng, kern, n, k), x=MR.act_f16(rng, 1, k), m=np.int32(1))
        # a far position (RoPE range reduction) on the ring; within the page table's reach on the paged cache
        pos = int(rng.integers(3000, p["PITCH"] * p["PAGE"] if p["PAGE"] else 250_000))
        positions = np.array([pos], np.int32)
        eb = np.dtype(R.np_dtype(kv_t)).itemsize
        cache = {
            "q_norm_w": f32_to_bf16(rng.normal(1, 0.3, D).astype(np.float32)),
            "k_norm_w": f32_to_bf16(rng.normal(1, 0.3, D).astype(np.float32)),
            "positions": positions,
            "lanes": np.ones(1, np.int32),
        }
        if p["PAGE"]:  # lane 1's row of a page table maps the position to a page of a small pool
            table = np.zeros((2, p["PITCH"]), np.int32)
            table[1, pos // p["PAGE"]] = 2
            cap, slot = 3 * p["PAGE"], 2 * p["PAGE"] + pos % p["PAGE"]
            cache |= {"pages": table, "lane_bytes": np.int64(0)}
        else:  # lane 1 of two ring lanes
            cap, slot = 2 * slots, slots + pos % slots
            cache |= {"lane_bytes": np.int64(slots * nk * eb)}
        outs = {
            "q_out": ((1, HQ, D), R.np_dtype(q_t)),
            "k_cache": ((cap, HKV, D), R.np_dtype(kv_t)),
            "v_cache": ((cap, HKV, D), R.np_dtype(kv_t)),
        }
        fold_in = dict(gemv, **cache, counters=np.zeros(n // D, np.uint32))
        fold_out = dict(outs, y=((1, n), np.float32), counters=((n // D,), np.uint32))
        got = runner.run(kern, fold_in, fold_out)
        assert not got["counters"].any(), f"{kern.name}: counters left at {got['counters']}"
        # the pair it replaces: the plain GEMV, then rope_kv on its row (one token: one block)
        y = runner.run(plain, gemv, {"y": ((1, n), np.float32)})["y"]
        v_raw = np.zeros((1, nk), np.float32) if p["V_FROM_K"] else y[:, nq + nk :]
        pair = runner.run(
            rope,
            dict(
                cache,
                q_raw=y[:, :nq],
                k_raw=y[:, nq : nq + nk],
                v_raw=v_raw,
                q_stride=np.int32(nq),
                kv_stride=np.int32(nk),
                T=np.int32(1),
            ),
            outs,
            (1, 1, 1),
        )
        assert np.array_equal(bits(got["y"]), bits(y)), f"{kern.name}: y differs from the plain GEMV's"
        for what in outs:
            assert np.array_equal(bits(got[what]), bits(pair[what])), f"{kern.name}: {what} differs from the pair's"
        q, kr, vr = R.rope_kv_ref(
            y[:, :nq],
            y[:, nq : nq + nk],
            None if p["V_FROM_K"] else v_raw,
            cache["q_norm_w"],
            cache["k_norm_w"],
            positions,
            HQ=HQ,
            HKV=HKV,
            D=D,
            rot=p["ROT"],
            theta=p["THETA"],
            has_q=True,
            v_from_k=p["V_FROM_K"],
            v_norm=p["V_NORM"],
            eps=p["EPS"],
        )
        assert R.norm_err(R.load(got["q_out"], q_t), q) <= R.TOL[q_t], kern.name
        for name, ref in (("k_cache", kr), ("v_cache", vr)):
            assert R.norm_err(R.load(got[name][[slot]], kv_t), ref) <= R.TOL[kv_t], (kern.name, name)
            rest = np.ones(cap, bool)
            rest[slot] = False
            assert not got[name][rest].any(), f"{kern.name}: {name} written outside slot {slot}"
        twice = runner.run_seq([(kern, None), (kern, None)], fold_in, fold_out)
        for what in outs:
            assert np.array_equal(bits(twice[what]), bits(got[what])), f"{kern.name}: second launch's {what}"
        assert not twice["counters"].any(), kern.name
