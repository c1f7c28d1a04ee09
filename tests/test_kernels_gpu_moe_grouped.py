"""GPU tests: the grouped prefill MoE (plan -> gate/up -> down; ffn_tail sums the slot rows) against NumPy. The
plan must equal its NumPy contract exactly; gate/up and down are checked against float64 on the same dequantized
weights and the same f16 activations (tiny: real quantize + pack path, every column; full size: random layout bytes
for all 128 experts, a sample of 16-row units dequantized); unwritten slot rows must stay poisoned. Rows 17 / 100 /
512, random, skewed (one expert in every row, most experts empty) and corrupt ids; a row's output must not change
bit for bit when other rows are added in front of it (other tiles, other positions inside its tile). Every test runs
on NVFP4 experts and on fp16 ones (bf16 checkpoint experts, ALL_BF16)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402
from thorgen.codegen.families import moe_grouped as MG  # noqa: E402
from thorgen.runtime.convert import layouts as L  # noqa: E402
from thorgen.runtime.convert.linears import pack_bf16_linear  # noqa: E402

pytestmark = pytest.mark.gpu


# every test on NVFP4 experts and on fp16 ones (bf16 checkpoint experts: ALL_BF16)
@pytest.fixture(
    scope="module", params=[(p, f) for p in PRESETS for f in ("ALL_NVFP4", "ALL_BF16")], ids=lambda pf: "-".join(pf)
)
def runner(request):
    return GpuRunner(request.param[0], ("moe_grouped",), request.param[1])


class HalfExperts:
    """All experts' fp16 weights (gate|up interleaved) in the half layout (test_kernels_gpu_moe.HalfExperts); every
    column checked on the tiny preset, the first, last and random units at full size."""

    def __init__(self, rng, spec):
        t = spec.target
        self.h, self.ie, self.e, self.k = h, ie, e, _ = (
            t.hidden_size,
            t.moe_intermediate_size,
            t.num_experts,
            t.top_k_experts,
        )
        self.gu_s = self.gu_g = self.dn_s = self.dn_g = None  # (fp16 weights: no scales)
        if spec.name == "tiny":
            self.gu_bits = np.concatenate(
                [
                    pack_bf16_linear([R.Bf16Weight(rng, ie, h).bits, R.Bf16Weight(rng, ie, h).bits], "interleave8")
                    for _ in range(e)
                ]
            )
            self.dn_bits = np.concatenate(
                [pack_bf16_linear([R.Bf16Weight(rng, h, ie).bits], "single") for _ in range(e)]
            )
            self.gu_units, self.dn_units = np.arange(ie // 8), np.arange(h // 16)
        else:
            self.gu_bits, self.dn_bits = (
                rng.integers(0x1C00, 0x2800, n, dtype=np.uint16) | (rng.integers(0, 2, n, dtype=np.uint16) << 15)
                for n in (e * 2 * ie * h, e * h * ie)
            )
            nu_gu, nu_dn = 2 * ie // 16, h // 16
            self.gu_units = np.unique(np.r_[0, nu_gu - 1, rng.choice(nu_gu, 6, replace=False)])
            self.dn_units = np.unique(np.r_[0, nu_dn - 1, rng.choice(nu_dn, 10, replace=False)])
        self.gu_w, self.dn_w = self.gu_bits.view(np.uint8), self.dn_bits.view(np.uint8)
        self.act_cols = (8 * self.gu_units[:, None] + np.arange(8)).reshape(-1)
        self.y_cols = (16 * self.dn_units[:, None] + np.arange(16)).reshape(-1)
        self._cache: dict = {}

    def weights(self, e: int):
        """(gate [cols, H], up [cols, H], down [y_cols, Ie]) float64 for the checked columns of expert e."""
        if e not in self._cache:
            h, ie = self.h, self.ie
            fused = L.unpack_half(self.gu_bits[e * 2 * ie * h : (e + 1) * 2 * ie * h], 2 * ie, h)
            fused = fused.view(np.float16).astype(np.float64).reshape(-1, 2, 8, h)[self.gu_units]
            down = L.unpack_half(self.dn_bits[e * h * ie : (e + 1) * h * ie], h, ie).view(np.float16)
            self._cache[e] = (
                fused[:, 0].reshape(-1, h),
                fused[:, 1].reshape(-1, h),
                down.astype(np.float64)[self.y_cols],
            )
        return self._cache[e]


class Experts:
    """All experts' fused gate|up and down weights in the kernel layout; float64 rows for the checked columns."""

    def __init__(self, rng, spec, order: str):
        t = spec.target
        self.h, self.ie, self.e, self.k = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
        self.tiny = spec.name == "tiny"
        if self.tiny:  # every column, through the real quantizer and packers
            gu, dn, self.dense = [], [], []
            for _ in range(self.e):
                g, u, fused = R.gate_up_weight(rng, self.ie, self.h, order, amp=0.5)
                d = R.Fp4Weight(rng, self.h, self.ie, order, amp=0.5)
                gu.append(fused), dn.append((d.w, d.s, d.gscale))
                self.dense.append((g.dense, u.dense, d.dense))
            self.gu_w, self.gu_s, self.gu_g = (np.concatenate([f[i] for f in gu]) for i in range(3))
            self.dn_w, self.dn_s, self.dn_g = (np.concatenate([f[i] for f in dn]) for i in range(3))
            self.gu_units, self.dn_units = np.arange(self.ie // 8), np.arange(self.h // 16)
        else:  # random layout bytes; first, last and random units checked
            self.gu = R.LayoutWeight(rng, 2 * self.ie, self.h, order, experts=self.e, gmax=0.01)
            self.dn = R.LayoutWeight(rng, self.h, self.ie, order, experts=self.e, gmax=0.01)
            self.gu_w, self.gu_s, self.gu_g = self.gu.w, self.gu.s, self.gu.gscale
            self.dn_w, self.dn_s, self.dn_g = self.dn.w, self.dn.s, self.dn.gscale
            nu_gu, nu_dn = 2 * self.ie // 16, self.h // 16
            self.gu_units = np.unique(np.r_[0, nu_gu - 1, rng.choice(nu_gu, 6, replace=False)])
            self.dn_units = np.unique(np.r_[0, nu_dn - 1, rng.choice(nu_dn, 10, replace=False)])
            self._cache: dict = {}
        # act columns 8u..8u+7 of the checked gate/up units, y columns 16u..16u+15 of the checked down units
        self.act_cols = (8 * self.gu_units[:, None] + np.arange(8)).reshape(-1)
        self.y_cols = (16 * self.dn_units[:, None] + np.arange(16)).reshape(-1)

    def weights(self, e: int):
        """(gate [cols, H], up [cols, H], down [y_cols, Ie]) float64 for the checked columns of expert e."""
        if self.tiny:
            g, u, d = self.dense[e]
            return g, u, d
        if e not in self._cache:
            fused = self.gu.rows(self.gu_units, e).reshape(-1, 2, 8, self.h)
            self._cache[e] = (
                fused[:, 0].reshape(-1, self.h),
                fused[:, 1].reshape(-1, self.h),
                self.dn.rows(self.dn_units, e),
            )
        return self._cache[e]


@pytest.fixture(scope="module")
def experts(runner):
    k = runner.find("moe_grouped_gateup__")[0]
    if k.param("kind") == "half":
        return HalfExperts(np.random.default_rng(31), runner.spec)
    return Experts(np.random.default_rng(31), runner.spec, k.param("fp4_order"))


def _kernels(runner):
    return [runner.find(f"moe_grouped_{s}__")[0] for s in ("plan", "gateup", "down")]


def _routing(rng, t, rows, kind):
    e, k = t.num_experts, t.top_k_experts
    if kind == "skewed":  # expert 0 in every row (rows > tile_rows: several tiles), others from a pool of k + 2
        ids = MG.random_routing(rng, rows, min(e, k + 2), k)
        ids[~(ids == 0).any(1), 0] = 0
    else:
        ids = MG.random_routing(rng, rows, e, k)
        if kind == "corrupt":
            ids[rng.random(ids.shape) < 0.05] = e + 7
            ids[0, -1] = -1
    wts = rng.uniform(0.05, 0.6, (rows, k)).astype(np.float32)
    return ids.astype(np.int32), wts


def _valid(ids, e):
    return (ids >= 0) & (ids < e)


def run_chain(runner, ex, ids, wts, x, act_in=None):
    """plan, gate/up, down (on act_in when given, else the gate/up output); poisoned outputs. y: each row's valid
    slot rows summed in slot order in f32, the operations of ffn_tail's PAIRS form (tested in
    test_kernels_gpu_norms)."""
    plan, gu, dn = _kernels(runner)
    t, rows = runner.spec.target, ids.shape[0]
    npair, nt = ids.size, plan.param("max_tiles")
    i32 = np.int32
    r = runner.run(
        plan,
        {"ids": ids, "T": i32(rows), "pairs": np.full(npair, -7, i32)},
        {"offsets": ((t.num_experts + 1,), i32), "pairs": ((npair,), i32), "tiles": ((nt, 4), i32)},
    )
    route = {"pairs": r["pairs"], "tiles": r["tiles"]}
    act = runner.run(
        gu,
        dict(
            route,
            w=ex.gu_w,
            s=ex.gu_s,
            gscale=ex.gu_g,
            x=x,
            act=np.full((npair, t.moe_intermediate_size), np.nan, np.float16),
        ),
        {"act": ((npair, t.moe_intermediate_size), np.float16)},
    )["act"]
    a = act if act_in is None else act_in
    ypair = runner.run(
        dn,
        dict(
            route,
            w=ex.dn_w,
            s=ex.dn_s,
            gscale=ex.dn_g,
            act=a,
            wts=wts,
            ypair=np.full((npair, t.hidden_size), np.nan, np.float32),
        ),
        {"ypair": ((npair, t.hidden_size), np.float32)},
    )["ypair"]
    return r, act, ypair, slot_sum(ypair, ids, t.num_experts)


def slot_sum(ypair, ids, e):
    rows, k = ids.shape
    y, ok = np.zeros((rows, ypair.shape[1]), np.float32), _valid(ids, e)
    for slot in range(k):
        y[ok[:, slot]] += ypair.reshape(rows, k, -1)[ok[:, slot], slot]
    return y


CASES = [(17, "random"), (100, "random"), (512, "random"), (100, "skewed"), (512, "skewed"), (100, "corrupt")]


@pytest.mark.parametrize("rows,kind", CASES)
def test_grouped_moe(runner, experts, rows, kind):
    t = runner.spec.target
    e, k, ie = t.num_experts, t.top_k_experts, t.moe_intermediate_size
    rng = np.random.default_rng(rows + len(kind))
    ids, wts = _routing(rng, t, rows, kind)
    x = R.act_f16(rng, rows, t.hidden_size)
    act_rand = R.act_f16(rng, ids.size, ie)  # down's own input (isolates it from gate/up)
    plan = _kernels(runner)[0]
    off, pairs, tiles = MG.plan_reference(ids, e, plan.param("tile_rows"), plan.param("max_tiles"))
    n = int(off[-1])
    r, act, ypair, y = run_chain(runner, experts, ids, wts, x, act_in=act_rand)
    np.testing.assert_array_equal(r["offsets"], off)
    np.testing.assert_array_equal(r["pairs"][:n], pairs[:n])
    assert (r["pairs"][n:] == -7).all(), "plan wrote past the valid pairs"
    np.testing.assert_array_equal(r["tiles"], tiles)
    # gate/up: act_sorted[i] for pair pairs[i] (checked columns), one f16 rounding
    flat = ids.reshape(-1)
    ref = np.zeros((n, len(experts.act_cols)))
    for ex in np.unique(flat[pairs[:n]]):
        sel = np.nonzero(flat[pairs[:n]] == ex)[0]
        g, u, _ = experts.weights(int(ex))
        xr = x[pairs[sel] // k].astype(np.float64)
        ref[sel] = R.gelu_tanh(xr @ g.T) * (xr @ u.T)
    assert np.isnan(act[n:].astype(np.float32)).all(), "gate/up wrote rows past the valid pairs"
    err = R.norm_err(act[:n][:, experts.act_cols], ref)
    assert err <= R.TOL_MOE_ACT, f"gate/up rows={rows} {kind}: error {err:.2e}"
    # down (on act_rand): ypair[p] = wts[p] * down_e act_rand[i]; pairs of corrupt ids are never written
    yref = np.zeros((n, len(experts.y_cols)))
    for ex in np.unique(flat[pairs[:n]]):
        sel = np.nonzero(flat[pairs[:n]] == ex)[0]
        yref[sel] = (act_rand[sel].astype(np.float64) @ experts.weights(int(ex))[2].T) * wts.reshape(-1)[
            pairs[sel], None
        ]
    got = ypair[pairs[:n]][:, experts.y_cols]
    err = R.norm_err(got, yref)
    assert err <= R.TOL_MOE_OUT, f"down rows={rows} {kind}: error {err:.2e}"
    assert np.isnan(ypair[~_valid(flat, e)]).all()
    assert np.isfinite(y).all()  # every valid slot row written


@pytest.mark.parametrize("rows", [100, 512])
def test_grouped_chain_and_row_independence(runner, experts, rows):
    """Full chain (down on the kernel's act) against float64, bit-identical on a repeat, and each row's y unchanged
    bit for bit when 23 other rows are placed in front of it."""
    t = runner.spec.target
    k = t.top_k_experts
    rng = np.random.default_rng(7 * rows)
    ids, wts = _routing(rng, t, rows, "random")
    x = R.act_f16(rng, rows, t.hidden_size)
    r, act, ypair, y = run_chain(runner, experts, ids, wts, x)
    n, pairs, flat = ids.size, r["pairs"], ids.reshape(-1)
    yp = np.zeros((n, len(experts.y_cols)))
    for ex in np.unique(flat):
        sel = np.nonzero(flat[pairs] == ex)[0]
        yp[pairs[sel]] = (act[sel].astype(np.float64) @ experts.weights(int(ex))[2].T) * wts.reshape(-1)[
            pairs[sel], None
        ]
    yref = yp.reshape(rows, k, -1).sum(1)
    err = R.norm_err(y[:, experts.y_cols], yref)
    assert err <= R.TOL_MOE_OUT, f"chain rows={rows}: error {err:.2e}"
    np.testing.assert_array_equal(run_chain(runner, experts, ids, wts, x)[3], y)
    extra = 23 if rows + 23 <= MG.MAX_STEP_TOKENS else 0
    if extra == 0:
        ids2, wts2, x2 = ids[::-1].copy(), wts[::-1].copy(), x[::-1].copy()  # full chunk: reverse the rows instead
        np.testing.assert_array_equal(run_chain(runner, experts, ids2, wts2, x2)[3][::-1], y)
        return
    more_ids, more_wts = _routing(rng, t, extra, "random")
    ids2, wts2 = np.concatenate([more_ids, ids]), np.concatenate([more_wts, wts])
    x2 = np.concatenate([R.act_f16(rng, extra, t.hidden_size), x])
    np.testing.assert_array_equal(run_chain(runner, experts, ids2, wts2, x2)[3][extra:], y)
