"""bf16 target linears: the repack's packer (runtime/convert/linears.py) and the emulated fp16-weight kernels
(tests/emulated_kernels.py) of an ALL_BF16 plan against the NumPy references of tests/matmul_reference.py, on
weights packed by that packer: the GEMV / 16- / 32-row / prefill GEMMs (store and gelu), the o_proj GEMV with the
attention tail folded in, and the MoE kernels over fp16 experts (one token, 16 / 32 rows, grouped prefill)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import matmul_reference as R  # noqa: E402
import reference_kernels as RK  # noqa: E402
from fake_driver import FakeDriver  # noqa: E402
from thorgen.codegen.arch import get_arch  # noqa: E402
from thorgen.codegen.families import moe_grouped as MG  # noqa: E402
from thorgen.codegen.plan import plan  # noqa: E402
from thorgen.model_spec.nvfp4 import f32_to_bf16  # noqa: E402
from thorgen.model_spec.presets import get_preset  # noqa: E402
from thorgen.model_spec.types import ALL_BF16  # noqa: E402
from thorgen.runtime.convert import layouts as L  # noqa: E402
from thorgen.runtime.convert.linears import pack_bf16_linear  # noqa: E402


# ---- the packer ------------------------------------------------------------------------------------------------------
def test_pack_bf16_linear_is_the_half_layout_of_the_fused_fp16_weight():
    rng = np.random.default_rng(3)
    q, k, v = (R.Bf16Weight(rng, rows, 128) for rows in (64, 32, 32))
    flat = pack_bf16_linear([q.bits, k.bits, v.bits], "concat")
    got = L.unpack_half(flat, 128, 128).view(np.float16).astype(np.float64)
    want = np.concatenate([q.dense, k.dense, v.dense])
    np.testing.assert_array_equal(got, want.astype(np.float16))  # fp16 round to nearest even
    normal = np.abs(want) >= 2.0**-14
    assert normal.mean() > 0.99 and (got[normal] == want[normal]).all()  # exact in fp16's normal range
    assert np.abs(got - want).max() <= 2.0**-25  # below it, the nearest subnormal
    gate, up = R.Bf16Weight(rng, 32, 64), R.Bf16Weight(rng, 32, 64)
    fused = L.unpack_half(pack_bf16_linear([gate.bits, up.bits], "interleave8"), 64, 64).view(np.float16)
    g, u = L.deinterleave8(fused.astype(np.float64))
    np.testing.assert_array_equal(g, gate.dense.astype(np.float16))
    np.testing.assert_array_equal(u, up.dense.astype(np.float16))


def test_pack_bf16_linear_streams_by_whole_steps():
    """Column slices of whole 64-input steps pack to consecutive pieces of the whole matrix's layout."""
    rng = np.random.default_rng(4)
    gate, up = R.Bf16Weight(rng, 16, 256), R.Bf16Weight(rng, 16, 256)
    whole = pack_bf16_linear([gate.bits, up.bits], "interleave8")
    pieces = [pack_bf16_linear([gate.bits[:, c : c + 128], up.bits[:, c : c + 128]], "interleave8") for c in (0, 128)]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)


def test_pack_bf16_linear_refuses_what_fp16_cannot_hold_and_bad_input():
    w = f32_to_bf16(np.full((16, 64), 0.5, np.float32))
    w[3, 7] = f32_to_bf16(np.array([1e5], np.float32))[0]  # above 65504
    with pytest.raises(L.LayoutError, match="fp16 range"):
        pack_bf16_linear([w], "single")
    ok = f32_to_bf16(np.full((16, 64), 0.5, np.float32))
    for parts, fusion, match in (
        ([ok], "stacked", "fusion"),
        ([ok.astype(np.float32)], "single", "uint16"),
        ([ok, ok], "single", "takes 1"),
        ([ok, ok[:, :32]], "concat", "disagree on K"),
        ([ok[:8]], "single", "N % 16"),
    ):
        with pytest.raises(L.LayoutError, match=match):
            pack_bf16_linear(parts, fusion)


# ---- the emulated kernels ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernels():
    spec = dataclasses.replace(get_preset("tiny"), linear_formats=ALL_BF16)
    ks = {
        k.name: k
        for k in plan(spec, get_arch("sm_90a"))
        if k.param("kind", None) == "half" and k.family not in ("drafter_gemm", "vision")
    }  # the target's linears (the tower's: test_vision_program)
    assert ks
    return spec, ks


class Device:
    """A fake driver's memory with named uploads, and the emulator run on one kernel."""

    def __init__(self) -> None:
        self.drv = FakeDriver()
        self.drv.cuCtxSetCurrent("ctx")

    def put(self, a: np.ndarray) -> int:
        a = np.ascontiguousarray(a)
        _, addr = self.drv.cuMemAlloc(a.nbytes)
        self.drv.view(addr, np.uint8, a.nbytes)[:] = a.view(np.uint8).reshape(-1)
        return addr

    def get(self, addr: int, dtype, shape) -> np.ndarray:
        return self.drv.view(addr, dtype, shape).copy()

    def run(self, kern, args: dict, grid=None) -> None:
        self.drv.emu.run(kern.name, {"template": kern.template, "params": kern.param_dict}, args, grid or kern.grid)


def _rows(kern) -> list[int]:
    if "gemmL" in kern.name:
        return [kern.param("bm") + 37, 3]  # a partial last block, and fewer rows than a block
    return [1] if kern.param("mmax") == 1 else [kern.param("mmax"), 5]


def test_emulated_half_gemms_follow_the_reference(kernels):
    _, ks = kernels
    rng = np.random.default_rng(5)
    gemms = [k for k in ks.values() if k.template.startswith("nvfp4_gemm") and k.param("epi") in ("store", "gelu_mul")]
    assert {k.name.split("__")[0] for k in gemms} == {"half_gemv", "half_gemm16", "half_gemm32", "half_gemmL"}
    for kern in gemms:
        n, k, epi = kern.param("n"), kern.param("k"), kern.param("epi")
        if epi == "store":
            wt = R.Bf16Weight(rng, n, k)
            flat, ref_of = pack_bf16_linear([wt.bits], "single"), (lambda x, wt=wt: R.gemm_ref(x, wt.dense))
        else:
            g, u = R.Bf16Weight(rng, n // 2, k), R.Bf16Weight(rng, n // 2, k)
            flat = pack_bf16_linear([g.bits, u.bits], "interleave8")

            def ref_of(x, g=g, u=u):
                return R.gated_ref(x, g.dense, u.dense, "gelu_mul")

        for m in _rows(kern):
            dev = Device()
            x = R.act_f16(rng, m, k)
            width, dt = (n, np.float32) if epi == "store" else (n // 2, np.float16)
            y = dev.put(np.full((m, width), np.nan, dt))
            grid = (kern.grid[0], -(-m // kern.param("bm")), 1) if "gemmL" in kern.name else None
            dev.run(kern, dict(w=dev.put(flat), x=dev.put(x), y=y, m=m), grid)
            err = R.norm_err(dev.get(y, dt, (m, width)), ref_of(x))
            assert err <= R.TOL_GEMM[kern.param("out_dtype")], f"{kern.name} m={m}: {err:.2e}"


def test_emulated_half_o_proj_with_the_attention_tail(kernels):
    spec, ks = kernels
    rng = np.random.default_rng(6)
    folds = [k for k in ks.values() if k.param("epi", None) == "attn_tail"]
    assert folds
    for kern in folds:
        n, k = kern.param("n"), kern.param("k")
        wt = R.Bf16Weight(rng, n, k)
        x, resid = R.act_f16(rng, 1, k), rng.normal(0, 2, (1, n)).astype(np.float32)
        ws = [f32_to_bf16(rng.normal(1.0, 0.3, n).astype(np.float32)) for _ in range(3)]
        dev = Device()
        a = dict(
            w=dev.put(pack_bf16_linear([wt.bits], "single")),
            x=dev.put(x),
            y=dev.put(np.zeros((1, n), np.float32)),
            m=1,
            resid=dev.put(resid),
            w_post=dev.put(ws[0]),
            w_pre1=dev.put(ws[1]),
            w_pre2=dev.put(ws[2]),
            a1=dev.put(np.zeros((1, n), np.float16)),
            a2=dev.put(np.zeros((1, n), np.float16)),
            counters=dev.put(np.zeros(1, np.uint32)),
        )
        dev.run(kern, a)
        o = dev.get(a["y"], np.float32, (1, n))
        assert R.norm_err(o, R.gemm_ref(x, wt.dense)) <= R.TOL_GEMM["f32"], kern.name
        xr, a1r, a2r = RK.attn_tail_ref(o, resid, *ws, spec.target.rms_norm_eps)
        assert RK.norm_err(dev.get(a["resid"], np.float32, (1, n)), xr) <= RK.TOL["f32"], kern.name
        assert RK.norm_err(dev.get(a["a1"], np.float16, (1, n)), a1r) <= RK.TOL["f16"], kern.name
        assert RK.norm_err(dev.get(a["a2"], np.float16, (1, n)), a2r) <= RK.TOL["f16"], kern.name


def _experts(rng, n_experts: int, n: int, k: int, gated: bool):
    """Per-expert bf16 weights (gate/up pairs when gated) and their stacked half-layout slab."""
    if gated:
        pairs = [(R.Bf16Weight(rng, n // 2, k), R.Bf16Weight(rng, n // 2, k)) for _ in range(n_experts)]
        slab = np.concatenate([pack_bf16_linear([g.bits, u.bits], "interleave8") for g, u in pairs])
        return [g.dense for g, _ in pairs], [u.dense for _, u in pairs], slab
    ws = [R.Bf16Weight(rng, n, k) for _ in range(n_experts)]
    return [w.dense for w in ws], None, np.concatenate([pack_bf16_linear([w.bits], "single") for w in ws])


def test_emulated_half_moe_follows_the_reference(kernels):
    spec, ks = kernels
    t = spec.target
    h, ie, e, topk = t.hidden_size, t.moe_intermediate_size, t.num_experts, t.top_k_experts
    rng = np.random.default_rng(7)
    gates, ups, gu_slab = _experts(rng, e, 2 * ie, h, True)
    downs, _, dn_slab = _experts(rng, e, h, ie, False)
    small = sorted(
        (k for k in ks.values() if k.template in ("moe_gateup.cu.j2", "moe_down.cu.j2", "moe_down_pairs.cu.j2")),
        key=lambda k: k.name,
    )
    assert {k.param("mmax") for k in small} == {1, 16, 32}
    for mmax in (1, 16, 32):
        gu = next(k for k in small if k.param("mmax") == mmax and k.template == "moe_gateup.cu.j2")
        dn = next(k for k in small if k.param("mmax") == mmax and k is not gu)
        m = min(mmax, 5) if mmax > 1 else 1
        ids, wts = R.moe_routing(rng, m, e, topk, pool=max(topk, e // 2))
        x = R.act_f16(rng, m, h)
        dev = Device()
        act = dev.put(np.zeros((m * topk, ie), np.float16))
        dev.run(gu, dict(w=dev.put(gu_slab), x=dev.put(x), ids=dev.put(ids), act=act, m=m))
        act_ref = R.moe_gateup_ref(x, ids, gates, ups)
        got_act = dev.get(act, np.float16, (m * topk, ie))
        assert R.norm_err(got_act, act_ref) <= R.TOL_MOE_ACT, gu.name
        out = (
            dict(ypair=dev.put(np.zeros((m * topk, h), np.float32)))
            if mmax > 1
            else dict(y=dev.put(np.zeros((m, h), np.float32)))
        )
        dev.run(dn, dict(w=dev.put(dn_slab), act=act, ids=dev.put(ids), wts=dev.put(wts), m=m, **out))
        y_ref = R.moe_down_ref(got_act, ids, wts, downs)
        if mmax > 1:
            y = dev.get(out["ypair"], np.float32, (m, topk, h)).sum(axis=1)
        else:
            y = dev.get(out["y"], np.float32, (m, h))
        assert R.norm_err(y, y_ref) <= R.TOL_MOE_OUT, dn.name
    grouped_gu, grouped_dn = (
        next(k for k in ks.values() if k.name.startswith(f"moe_grouped_{w}__")) for w in ("gateup", "down")
    )
    m = 40  # a prefill chunk: tiles of one expert's rows
    ids, wts = R.moe_routing(rng, m, e, topk)
    tiles_n = grouped_gu.param("max_tiles")
    _, pairs, tiles = MG.plan_reference(ids, e, grouped_gu.param("tile_rows"), tiles_n)
    x = R.act_f16(rng, m, h)
    dev = Device()
    routing = dict(pairs=dev.put(pairs), tiles=dev.put(tiles))
    act = dev.put(np.zeros((m * topk, ie), np.float16))
    dev.run(grouped_gu, dict(w=dev.put(gu_slab), x=dev.put(x), act=act, **routing))
    order = pairs[: m * topk]
    act_ref = R.moe_gateup_ref(x, ids, gates, ups)[order]
    got_act = dev.get(act, np.float16, (m * topk, ie))
    assert R.norm_err(got_act, act_ref) <= R.TOL_MOE_ACT, grouped_gu.name
    ypair = dev.put(np.zeros((m * topk, h), np.float32))
    dev.run(grouped_dn, dict(w=dev.put(dn_slab), act=act, wts=dev.put(wts), ypair=ypair, **routing))
    unsorted = np.empty_like(got_act)
    unsorted[order] = got_act
    y_ref = R.moe_down_ref(unsorted, ids, wts, downs)
    y = dev.get(ypair, np.float32, (m, topk, h)).sum(axis=1)
    assert R.norm_err(y, y_ref) <= R.TOL_MOE_OUT, grouped_dn.name
