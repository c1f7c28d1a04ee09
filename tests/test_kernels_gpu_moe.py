"""GPU tests: grouped MoE gate|up (GELU-tanh) and down (routing-weighted, no atomics) against NumPy, decode (M = 1)
and verify (M <= 16, experts shared between tokens), tiny preset (real quantize + pack path) and full size (random
layout bytes, all 128 experts resident, only the selected ones dequantized for the reference); NVFP4 experts and
fp16 ones (bf16 checkpoint experts, ALL_BF16)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from thorgen.runtime.cuda.programs import _grid

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402
from thorgen.runtime.convert import layouts as L  # noqa: E402
from thorgen.runtime.convert.linears import pack_bf16_linear  # noqa: E402

pytestmark = pytest.mark.gpu


# every test on NVFP4 experts and on fp16 ones (bf16 checkpoint experts: ALL_BF16)
@pytest.fixture(
    scope="module", params=[(p, f) for p in PRESETS for f in ("ALL_NVFP4", "ALL_BF16")], ids=lambda pf: "-".join(pf)
)
def runner(request):
    return GpuRunner(request.param[0], ("moe",), request.param[1])


class HalfExperts:
    """All experts' fp16 weights (gate|up interleaved) in the half layout: bf16 checkpoint weights through the
    repack's packer on the tiny preset, random fp16 bit patterns (2^-8 .. 2^-5, random signs) at full size."""

    def __init__(self, rng, spec):
        t = spec.target
        self.h, self.ie, self.e = h, ie, e = t.hidden_size, t.moe_intermediate_size, t.num_experts
        self.gu_s = self.gu_g = self.dn_s = self.dn_g = None  # (fp16 weights: no scales)
        if spec.name == "tiny":
            gu = [
                pack_bf16_linear([R.Bf16Weight(rng, ie, h).bits, R.Bf16Weight(rng, ie, h).bits], "interleave8")
                for _ in range(e)
            ]
            dn = [pack_bf16_linear([R.Bf16Weight(rng, h, ie).bits], "single") for _ in range(e)]
            self.gu_bits, self.dn_bits = np.concatenate(gu), np.concatenate(dn)
        else:
            self.gu_bits, self.dn_bits = (
                rng.integers(0x1C00, 0x2800, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
                for n in (e * 2 * ie * h, e * h * ie)
            )
        self.gu_w, self.dn_w = self.gu_bits.view(np.uint8), self.dn_bits.view(np.uint8)

    def dense(self, e: int):
        h, ie = self.h, self.ie
        fused = L.unpack_half(self.gu_bits[e * 2 * ie * h : (e + 1) * 2 * ie * h], 2 * ie, h).view(np.float16)
        gate, up = L.deinterleave8(fused.astype(np.float64))
        down = L.unpack_half(self.dn_bits[e * h * ie : (e + 1) * h * ie], h, ie).view(np.float16).astype(np.float64)
        return gate, up, down

    def lists(self, ids: np.ndarray):
        gates, ups, downs = [None] * self.e, [None] * self.e, [None] * self.e
        for e in np.unique(ids):
            gates[e], ups[e], downs[e] = self.dense(int(e))
        return gates, ups, downs


class Experts:
    """All experts' fused gate|up and down weights in the kernel layout, dense float64 on demand."""

    def __init__(self, rng, spec, order: str):
        t = spec.target
        self.h, self.ie, self.e = t.hidden_size, t.moe_intermediate_size, t.num_experts
        self.tiny = spec.name == "tiny"
        if self.tiny:
            gu, dn, gs_gu, gs_dn, self.gates, self.ups, self.downs = [], [], [], [], [], [], []
            for _ in range(self.e):
                g, u, (w, s, gsc) = R.gate_up_weight(rng, self.ie, self.h, order, amp=0.5)
                d = R.Fp4Weight(rng, self.h, self.ie, order, amp=0.5)
                gu.append((w, s)), dn.append((d.w, d.s)), gs_gu.append(gsc), gs_dn.append(d.gscale)
                self.gates.append(g.dense), self.ups.append(u.dense), self.downs.append(d.dense)
            self.gu_w, self.gu_s = np.concatenate([a for a, _ in gu]), np.concatenate([b for _, b in gu])
            self.dn_w, self.dn_s = np.concatenate([a for a, _ in dn]), np.concatenate([b for _, b in dn])
            self.gu_g, self.dn_g = np.concatenate(gs_gu), np.concatenate(gs_dn)
        else:
            self.gu = R.LayoutWeight(rng, 2 * self.ie, self.h, order, experts=self.e, gmax=0.01)
            self.dn = R.LayoutWeight(rng, self.h, self.ie, order, experts=self.e, gmax=0.01)
            self.gu_w, self.gu_s, self.gu_g = self.gu.w, self.gu.s, self.gu.gscale
            self.dn_w, self.dn_s, self.dn_g = self.dn.w, self.dn.s, self.dn.gscale
            self._cache: dict[int, tuple] = {}

    def dense(self, e: int):
        """(gate, up, down) float64 of expert e."""
        if self.tiny:
            return self.gates[e], self.ups[e], self.downs[e]
        if e not in self._cache:
            fused = self.gu.dense(e).reshape(-1, 2, 8, self.h)
            self._cache[e] = (fused[:, 0].reshape(-1, self.h), fused[:, 1].reshape(-1, self.h), self.dn.dense(e))
        return self._cache[e]

    def lists(self, ids: np.ndarray):
        gates, ups, downs = [None] * self.e, [None] * self.e, [None] * self.e
        for e in np.unique(ids):
            gates[e], ups[e], downs[e] = self.dense(int(e))
        return gates, ups, downs


@pytest.fixture(scope="module")
def experts(runner):
    (k,) = runner.find("moe_gateup__m1_")
    if k.param("kind") == "half":
        return HalfExperts(np.random.default_rng(21), runner.spec)
    return Experts(np.random.default_rng(21), runner.spec, k.param("fp4_order"))


# (m, routing); "pool": experts shared by tokens. 21 and 32 rows: the M = 32 pair (batched decode steps)
CASES = [(1, None), (16, None), (16, "pool"), (5, "pool"), (32, None), (32, "pool"), (21, "pool")]


def _rows_grid(kernel, m: int) -> tuple[int, int, int]:
    """The grid the runtime launches the kernel with for m rows (runtime/cuda/programs.py's rule: ROW_GRID with its
    cap)."""
    return _grid(SimpleNamespace(grid=kernel.grid, params=kernel.param_dict), m)


def _down(runner, down, dn: dict, act: np.ndarray, m: int, h: int, topk: int) -> np.ndarray:
    """y [m, h] of the down kernel: moe_down (one token) directly; moe_down_pairs (up to 32) writes each slot's
    weighted row, summed here in slot order as ffn_tail's PAIRS form does (test_kernels_gpu_norms tests that)."""
    if down.name.startswith("moe_down__"):
        return runner.run(down, dict(dn, act=act, y=np.full((m, h), np.nan, np.float32)), {"y": ((m, h), np.float32)})[
            "y"
        ]
    pairs = runner.run(
        down,
        dict(dn, act=act, ypair=np.full((m * topk, h), np.nan, np.float32)),
        {"ypair": ((m * topk, h), np.float32)},
        grid=_rows_grid(down, m),
    )["ypair"]
    return pairs.reshape(m, topk, h).sum(axis=1, dtype=np.float32)


@pytest.mark.parametrize("m,pool", CASES)
def test_moe(runner, experts, m, pool):
    rng = np.random.default_rng(22 + m)
    t = runner.spec.target
    h, ie, topk = t.hidden_size, t.moe_intermediate_size, t.top_k_experts
    mmax = 1 if m == 1 else 16 if m <= 16 else 32
    gateup = runner.find(f"moe_gateup__m{mmax}_")[0]
    (down,) = runner.find("moe_down__m1_" if m == 1 else f"moe_down_pairs__m{mmax}_")
    ids, wts = R.moe_routing(rng, m, t.num_experts, topk, pool=topk + 3 if pool else None)
    x = R.act_f16(rng, m, h)
    gates, ups, downs = experts.lists(ids)
    act_ref = R.moe_gateup_ref(x, ids, gates, ups)
    common = {"w": experts.gu_w, "s": experts.gu_s, "gscale": experts.gu_g, "ids": ids, "m": np.int32(m)}
    act = runner.run(
        gateup,
        dict(common, x=x, act=np.full((m * topk, ie), np.nan, np.float16)),
        {"act": ((m * topk, ie), np.float16)},
        grid=_rows_grid(gateup, m),
    )["act"]
    err = R.norm_err(act, act_ref)
    assert err <= R.TOL_MOE_ACT, f"{gateup.name} m={m}: act error {err:.2e}"
    # down on the reference's own f16 act (isolates the down kernel), then the chained pair
    act16 = act_ref.astype(np.float16)
    y_ref = R.moe_down_ref(act16, ids, wts, downs)
    dn = {"w": experts.dn_w, "s": experts.dn_s, "gscale": experts.dn_g, "ids": ids, "wts": wts, "m": np.int32(m)}
    y = _down(runner, down, dn, act16, m, h, topk)
    err = R.norm_err(y, y_ref)
    assert err <= R.TOL_MOE_OUT, f"{down.name} m={m}: error {err:.2e}"
    np.testing.assert_array_equal(y, _down(runner, down, dn, act16, m, h, topk))  # deterministic
    y2 = _down(runner, down, dn, act, m, h, topk)
    assert R.norm_err(y2, R.moe_down_ref(act, ids, wts, downs)) <= R.TOL_MOE_OUT


def test_moe_bad_expert_id_is_ignored_not_a_wild_read(runner, experts):
    """An out-of-range id (corrupt router output) must neither crash nor write garbage for the valid slots."""
    rng = np.random.default_rng(23)
    t = runner.spec.target
    m, topk = 1, t.top_k_experts
    ids, wts = R.moe_routing(rng, m, t.num_experts, topk)
    bad = ids.copy()
    bad[0, -1] = t.num_experts + 1000
    down = runner.find("moe_down__m1_")[0]
    act16 = R.act_f16(rng, m * topk, t.moe_intermediate_size)
    dn = {"w": experts.dn_w, "s": experts.dn_s, "gscale": experts.dn_g, "wts": wts, "m": np.int32(m), "act": act16}
    y = runner.run(down, dict(dn, ids=bad), {"y": ((m, t.hidden_size), np.float32)})["y"]
    keep = wts.copy()
    keep[0, -1] = 0.0
    _, _, downs = experts.lists(ids)
    assert R.norm_err(y, R.moe_down_ref(act16, ids, keep, downs)) <= R.TOL_MOE_OUT


def _pairs_of(runner, kernel, common: dict, extra: dict, out: str, width: int, m: int, dtype) -> np.ndarray:
    topk = runner.spec.target.top_k_experts
    res = runner.run(
        kernel,
        dict(common, **extra, m=np.int32(m), **{out: np.full((m * topk, width), np.nan, dtype)}),
        {out: ((m * topk, width), dtype)},
        grid=_rows_grid(kernel, m),
    )
    return res[out]


def test_moe_rows_do_not_depend_on_the_batch(runner, experts):
    """A token's gate/up act rows and down pair rows are bit-identical whatever else the step holds: alone, among 5,
    or among 32 tokens sharing its experts (passes of 16 and 8), and in the 16- and the 32-row kernel. The batched
    engine relies on this for a sequence's output not to depend on its batch (batch invariance)."""
    rng = np.random.default_rng(24)
    t = runner.spec.target
    h, ie, topk = t.hidden_size, t.moe_intermediate_size, t.top_k_experts
    ids, wts = R.moe_routing(rng, 32, t.num_experts, topk, pool=topk + 3)
    x = R.act_f16(rng, 32, h)
    act16 = R.act_f16(rng, 32 * topk, ie)
    gu = {"w": experts.gu_w, "s": experts.gu_s, "gscale": experts.gu_g}
    dn = {"w": experts.dn_w, "s": experts.dn_s, "gscale": experts.dn_g}
    k16, k32 = runner.find("moe_gateup__m16_")[0], runner.find("moe_gateup__m32_")[0]
    d16, d32 = runner.find("moe_down_pairs__m16_")[0], runner.find("moe_down_pairs__m32_")[0]
    for a, b in ((k16, k32), (d16, d32)):
        assert [a.param(q) for q in ("ks", "un", "pf")] == [b.param(q) for q in ("ks", "un", "pf")], (a.name, b.name)
    full_act = _pairs_of(runner, k32, gu, {"x": x, "ids": ids}, "act", ie, 32, np.float16)
    full_dn = _pairs_of(runner, d32, dn, {"act": act16, "ids": ids, "wts": wts}, "ypair", h, 32, np.float32)
    k1 = runner.find("moe_gateup__m1_")[0]  # one token: its gate/up too (its down is moe_down, checked below)
    assert k1.param("ks") == k32.param("ks")
    for r in (7, 30):
        act = _pairs_of(runner, k1, gu, {"x": x[r : r + 1], "ids": ids[r : r + 1]}, "act", ie, 1, np.float16)
        np.testing.assert_array_equal(act, full_act[r * topk : (r + 1) * topk], err_msg=f"{k1.name} row {r}")
    d1 = runner.find("moe_down__m1_")[0]  # one token's down sums its slots itself: as ffn_tail sums the pair rows
    for r in (7, 30):
        y = runner.run(
            d1,
            dict(
                dn,
                act=act16[r * topk : (r + 1) * topk],
                ids=ids[r : r + 1],
                wts=wts[r : r + 1],
                m=np.int32(1),
                y=np.full((1, h), np.nan, np.float32),
            ),
            {"y": ((1, h), np.float32)},
            grid=_rows_grid(d1, 1),
        )["y"][0]
        want = np.zeros(h, np.float32)
        for k in range(topk):  # from 0, slot by slot, in f32 (norm.cuh ffn_tail_row)
            want = want + full_dn[r * topk + k]
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32), err_msg=f"{d1.name} row {r}")
    for kernel, down, rows in ((k32, d32, [7]), (k32, d32, [3, 9, 17, 30, 31]), (k16, d16, list(range(16)))):
        sub = np.array(rows)
        pairs = (sub[:, None] * topk + np.arange(topk)).ravel()
        act = _pairs_of(runner, kernel, gu, {"x": x[sub], "ids": ids[sub]}, "act", ie, len(rows), np.float16)
        np.testing.assert_array_equal(act, full_act[pairs], err_msg=f"{kernel.name} rows {rows}")
        y = _pairs_of(
            runner, down, dn, {"act": act16[pairs], "ids": ids[sub], "wts": wts[sub]}, "ypair", h, len(rows), np.float32
        )
        np.testing.assert_array_equal(y, full_dn[pairs], err_msg=f"{down.name} rows {rows}")
