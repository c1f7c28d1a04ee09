"""CPU tests of the matrix kernel families (matmul, moe, attention, drafter_gemm): every preset x arch plans,
renders, fits the arch, and the launch geometry agrees with the template constants."""

from __future__ import annotations

import dataclasses
import math

import pytest

from thorgen.codegen.arch import ARCHS
from thorgen.codegen.families import attention, drafter_gemm, matmul, moe, ring_slots
from thorgen.codegen.plan import plan
from thorgen.codegen.render import render
from thorgen.model_spec import types
from thorgen.model_spec.presets import PRESETS
from thorgen.model_spec.weight_layout import fp4_order_for

MATRIX_FAMILIES = ("matmul", "moe", "attention", "drafter_gemm")
FAMILY_BENCH = (matmul.bench_matmul, moe.bench_moe, attention.bench_attention, drafter_gemm.bench_drafter_gemm)


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plans_render_and_fit(preset: str, arch: str) -> None:
    check_plan(PRESETS[preset], ARCHS[arch])


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("formats", ["ALL_BF16", "EXPERTS_ONLY_NVFP4"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_mixed_precision_plans_render_and_fit(preset: str, formats: str, arch: str) -> None:
    """bf16 linears: the fp16-weight kernels render with one weight argument, and the geometry checks hold."""
    spec = dataclasses.replace(PRESETS[preset], linear_formats=getattr(types, formats))
    kernels = check_plan(spec, ARCHS[arch])
    half = [k for k in kernels if k.param("kind", None) == "half" and k.family != "drafter_gemm"]
    assert half and all(k.args[:2] == ("w", "x") or k.args[:2] == ("w", "act") for k in half)
    assert all("const uint8_t* __restrict__ s" not in render(k, ARCHS[arch], spec.spec_hash) for k in half)


def check_plan(spec, a) -> list:
    """The matrix families' kernels of `spec` on `a` render, fit the arch and agree with their launch geometry."""
    kernels = plan(spec, a, MATRIX_FAMILIES)
    assert len({k.name for k in kernels}) == len(kernels), "duplicate kernel names"
    for k in kernels:
        assert k.smem_bytes <= a.smem_per_block_max, k.name
        src = render(k, a, spec.spec_hash)
        assert f"{k.name}(" in src and 'extern "C" __global__' in src, k.name
        p = k.param_dict
        if k.template == "nvfp4_gemm.cu.j2":
            un = p.get("un", 1)  # units a block: 1 below 16 rows and for the drafter's fp16 GEMMs
            assert un == 1 or (p["mmax"] >= 16 and p["kind"] != "half" and (p["n"] // 16) % un == 0), k.name
            assert k.grid == (p["n"] // 16 // un, 1, 1) and k.block == (32 * p["ks"], 1, 1), k.name
            assert 1 <= p["ks"] <= p["k"] // 64 and 1 <= p["pf"] <= 16, k.name
            assert p["swap"] == (p["mmax"] <= 8), k.name
        if k.template.startswith("nvfp4") or k.template.startswith("moe"):
            assert p["fp4_order"] == fp4_order_for(a.name), k.name
            # fp16 weights exactly where the checkpoint is bf16: the drafter (always), the roles linear_formats names
            fmt = _expected_format(spec, k)
            if fmt is not None:
                assert p["kind"] == ("half" if fmt == "bf16" else fp4_order_for(a.name)), k.name
        if k.template == "attn_fwd.cu.j2":
            g = p["hq"] // p["hkv"]
            assert k.smem_bytes == attention.attn_smem(p["d"], p["mt"], p["tk"], p["kv_dtype"]), k.name
            assert k.grid[0] == math.ceil(p["mmax"] / (16 * p["mt"] // g)) and k.block[0] == 32 * (p["d"] // 64)
            if p["nsplit"] > 1:
                # partials of every split, plus the merge subgroups' partials (two-level in-kernel merge)
                assert p["ws_floats"] == (p["nsplit"] + p["nsub"]) * p["mmax"] * p["hq"] * (p["d"] + 2)
                assert p["nsplit"] % p["nsub"] == 0
    return kernels


def _expected_format(spec, k) -> str | None:
    """The checkpoint format kernel k's weights come from (None: a target GEMM whose shape two roles of different
    formats could share, e.g. the tiny preset's q|k|v and lm_head, both 512 wide)."""
    f = spec.linear_formats
    if k.family == "drafter_gemm":
        return "bf16"
    if k.family.startswith("moe"):
        return f.experts
    if k.param("n") == spec.target.vocab_size:  # the lm_head: the tied embedding quantized at repack
        return "nvfp4" if f.all_nvfp4 else None
    return f.attention if f.attention == f.dense_mlp else None


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
        assert matmul.fp4_order(a) == fp4_order_for(a.name)


def test_real_shapes_are_planned() -> None:
    """The model's shapes: q 2816->4096 (in the fused q|k|v of the sliding layers, 2816->8192; one row: folded with
    rope_kv), o 4096->2816, fused gate|up 2816->2x2112, down, lm_head; MoE and both attention layer kinds, with bf16
    and fp8 caches."""
    spec, a = PRESETS["gemma-4-26b-a4b"], ARCHS["sm_90a"]
    names = {k.name for k in plan(spec, a)}
    assert any(n.startswith("nvfp4_gemv__n8192_k2816_rope__tgt_s_d256") for n in names)
    for want in (
        "nvfp4_gemm16__n8192_k2816",
        "nvfp4_gemmL__n8192_k2816",
        "nvfp4_gemm16__n2816_k4096",
        "nvfp4_gemv__n4224_k2816_gelu",
        "nvfp4_gemmL__n2816_k2112",
        "nvfp4_gemv__n262144_k2816",
        "moe_gateup__m1_e128_k8_i704_h2816",
        "moe_down_pairs__m16_e128_k8_i704_h2816",
        "bf16_gemm16__n11264_k2816_silu",
        "bf16_gemmL__n2816_k16896",
    ):
        assert want in names, want
    att = [n for n in names if n.startswith("attn_")]
    ring = ring_slots(1024)
    for frag in (
        f"tgt_s_d256_h16x8_cw1024_ring{ring}_bf16",
        f"tgt_s_d256_h16x8_cw1024_ring{ring}_fp8e4m3",
        "tgt_f_d512_h16x2_c_p16_bf16",
        "dft_s_d128_h32x8_cw2048",
        "dft_f_d128_h32x8_b_lin",
    ):
        assert any(frag in n for n in att), frag


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_bench_cases_build(preset: str) -> None:
    spec, a = PRESETS[preset], ARCHS["sm_90a"]
    cases = [c for bench in FAMILY_BENCH for c in bench(spec, a)]
    assert cases and all(c.bytes_moved > 0 for c in cases)
    assert any(c.weight_streaming for c in cases)
