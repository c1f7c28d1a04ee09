"""CPU tests of the matrix kernel families (matmul, moe, attention, drafter_gemm): every preset x arch plans,
renders, fits the arch, and the launch geometry agrees with the template constants."""

from __future__ import annotations

import math

import pytest

from thorgen.codegen.arch import ARCHS
from thorgen.codegen.families import attention, drafter_gemm, matmul, moe, ring_slots
from thorgen.codegen.plan import plan
from thorgen.codegen.render import render
from thorgen.model_spec.presets import PRESETS
from thorgen.runtime.convert import layouts as L

MATRIX_FAMILIES = ("matmul", "moe", "attention", "drafter_gemm")
FAMILY_BENCH = (matmul.bench_matmul, moe.bench_moe, attention.bench_attention, drafter_gemm.bench_drafter_gemm)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plans_render_and_fit(preset: str, arch: str) -> None:
    spec, a = PRESETS[preset], ARCHS[arch]
    kernels = plan(spec, a, MATRIX_FAMILIES)
    assert len({k.name for k in kernels}) == len(kernels), "duplicate kernel names"
    for k in kernels:
        assert k.smem_bytes <= a.smem_per_block_max, k.name
        src = render(k, a, spec.spec_hash)
        assert f"{k.name}(" in src and "extern \"C\" __global__" in src, k.name
        p = k.param_dict
        if k.template == "nvfp4_gemm.cu.j2":
            un = p.get("un", 1)  # units a block: 1 below 16 rows and for the drafter's fp16 GEMMs
            assert un == 1 or (p["mmax"] >= 16 and p["kind"] != "half" and (p["n"] // 16) % un == 0), k.name
            assert k.grid == (p["n"] // 16 // un, 1, 1) and k.block == (32 * p["ks"], 1, 1), k.name
            assert 1 <= p["ks"] <= p["k"] // 64 and 1 <= p["pf"] <= 16, k.name
            assert p["swap"] == (p["mmax"] <= 8), k.name
        if k.template.startswith("nvfp4") or k.template.startswith("moe"):
            assert p["fp4_order"] == L.fp4_order_for(a.has_fp4_cvt), k.name
            # fp16 weights only where the checkpoint is bf16: the drafter (always) and no target linear of ALL_NVFP4
            assert p["kind"] == (L.fp4_order_for(a.has_fp4_cvt) if k.family != "drafter_gemm" else "half"), k.name
        if k.template == "attn_fwd.cu.j2":
            g = p["hq"] // p["hkv"]
            assert k.smem_bytes == attention.attn_smem(p["d"], p["mt"], p["tk"], p["kv_dtype"]), k.name
            assert k.grid[0] == math.ceil(p["mmax"] / (16 * p["mt"] // g)) and k.block[0] == 32 * (p["d"] // 64)
            if p["nsplit"] > 1:
                # partials of every split, plus the merge subgroups' partials (two-level in-kernel merge)
                assert p["ws_floats"] == (p["nsplit"] + p["nsub"]) * p["mmax"] * p["hq"] * (p["d"] + 2)
                assert p["nsplit"] % p["nsub"] == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_the_drafter_gemms_are_resident_at_once(arch: str) -> None:
    """The fp16-weight 16-row GEMMs take the most warps a block (a power of two) with which every block is resident at
    once at matmul.HALF_REGS registers a thread, where the machine can hold a 2-warp block per unit (the H200's
    drafter: 176 blocks of 16 warps ran in two waves)."""
    spec, a = PRESETS["gemma-4-26b-a4b"], ARCHS[arch]
    resident = a.sm_count * (65536 // (32 * matmul.HALF_REGS))
    for k in plan(spec, a, ("drafter_gemm",)):
        if not k.name.startswith("bf16_gemm16__"):
            continue
        units, ks = k.grid[0], k.param("ks")
        if units * 2 <= resident:
            assert units * ks <= resident and (ks == 16 or units * 2 * ks > resident), (k.name, ks)
            assert ks & (ks - 1) == 0, k.name


def test_fp4_order_matches_layouts() -> None:
    for a in ARCHS.values():
        assert matmul.fp4_order(a) == L.fp4_order_for(a.has_fp4_cvt)


def test_real_shapes_are_planned() -> None:
    """The model's shapes: q 2816->4096 (in the fused q|k|v of the sliding layers, 2816->8192; one row: folded with
    rope_kv), o 4096->2816, fused gate|up 2816->2x2112, down, lm_head; MoE and both attention layer kinds, with bf16
    and fp8 caches."""
    spec, a = PRESETS["gemma-4-26b-a4b"], ARCHS["sm_90a"]
    names = {k.name for k in plan(spec, a)}
    assert any(n.startswith("nvfp4_gemv__n8192_k2816_rope__tgt_s_d256") for n in names)
    for want in ("nvfp4_gemm16__n8192_k2816", "nvfp4_gemmL__n8192_k2816", "nvfp4_gemm16__n2816_k4096", "nvfp4_gemv__n4224_k2816_gelu",
                 "nvfp4_gemmL__n2816_k2112", "nvfp4_gemv__n262144_k2816", "moe_gateup__m1_e128_k8_i704_h2816",
                 "moe_down_pairs__m16_e128_k8_i704_h2816", "bf16_gemm16__n11264_k2816_silu", "bf16_gemmL__n2816_k16896"):
        assert want in names, want
    att = [n for n in names if n.startswith("attn_")]
    ring = ring_slots(1024)
    for frag in (f"tgt_s_d256_h16x8_cw1024_ring{ring}_bf16", f"tgt_s_d256_h16x8_cw1024_ring{ring}_fp8e4m3",
                 "tgt_f_d512_h16x2_c_p16_bf16", "dft_s_d128_h32x8_cw2048", "dft_f_d128_h32x8_b_lin"):
        assert any(frag in n for n in att), frag


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_bench_cases_build(preset: str) -> None:
    spec, a = PRESETS[preset], ARCHS["sm_90a"]
    cases = [c for bench in FAMILY_BENCH for c in bench(spec, a)]
    assert cases and all(c.bytes_moved > 0 for c in cases)
    assert any(c.weight_streaming for c in cases)
