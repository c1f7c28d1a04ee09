"""CPU test: `thorgen build`'s report (codegen.builder.build) shows no register spills on any of the four arches
outside ALLOWED, each entry there with the bytes it may spill and why.

sm_90a and sm_110a build the full preset's whole plan (the cubin cache shares those compiles with
tests/test_codegen_compile.py). sm_100a and sm_120a build a representative subset: one kernel per template and
kernel kind, plus every shape of the decode path's weight-streaming kernels (GEMV, 16- and 32-row GEMMs, MoE),
ffn_tail and attention's prefill kernels (full preset, 2 cores: ~90 s an arch for the whole plan uncached, the
subset about two thirds of it). Skips without nvcc."""

from __future__ import annotations

from pathlib import Path

import pytest

from thorgen.codegen.arch import get_arch
from thorgen.codegen.builder import build
from thorgen.codegen.kernel_spec import KernelSpec
from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
from thorgen.codegen.plan import plan
from thorgen.model_spec.presets import get_preset

PRESET = "gemma-4-26b-a4b"
WHOLE_PLAN = ("sm_90a", "sm_110a")
EVERY_SHAPE = (
    "nvfp4_gemv",
    "nvfp4_gemm16",
    "nvfp4_gemm32",
    "moe_gateup",
    "moe_down",
    "moe_down_pairs",
    "ffn_tail",
    "attn_pre",
)
# arch -> {kernel: (spill bytes, stores + loads, allowed at most; why)}. nvcc 13.0.
ALLOWED: dict[str, dict[str, tuple[int, str]]] = {
    "sm_100a": {
        "vis_attn__h16x72_dp128": (
            8,
            "the vision attention's online-softmax state (nvcc 13.0 for sm_100a; 0 on sm_90a, 143 registers); "
            "not examined on a Blackwell GPU",
        ),
        "moe_down__m1_e128_k8_i704_h2816": (
            16,
            "two of the token's 8 expert ids, stored once before the slot loop "
            "and reloaded once after it; nothing spills in the weight loop",
        ),
        "rope_kv__dblk_s_d128_q32_kv8_r64_t1000000p0_ring4096_bf16": (
            24,
            "the drafter's block rope_kv (prefill side), not examined",
        ),
        "rope_kv__dblk_f_d128_q32_kv8_r64_t1000000p0_lin_bf16": (24, "as its sliding twin"),
        "lm_sample_prep__v262144_c30p0": (8, "one word of the sampler's chunk pass, not examined"),
        "lm_pick_prep__v262144": (8, "as lm_sample_prep"),
    },
    "sm_120a": {
        "attn_pre__tgt_s_d256_h16x8_cw1024_ring3072_fp8e4m3": (24, "prefill attention with fp8 KV, not examined"),
        "attn_pre__tgt_s_d256_h16x8_cw1024_ring3072_fp8e4m3_kvhi": (
            24,
            "its image-block twin (the per-query key bound): the same spill",
        ),
    },
}


@pytest.fixture(scope="module", autouse=True)
def _nvcc() -> None:
    try:
        find_nvcc()
    except NvccNotFound as exc:
        pytest.skip(str(exc))


def representative(kernels: list[KernelSpec]) -> list[KernelSpec]:
    """One kernel per (template, kind), plus every kernel of the EVERY_SHAPE kinds."""
    seen: set[tuple[str, str]] = set()
    out = []
    for k in kernels:
        kind = k.name.split("__")[0]
        if kind in EVERY_SHAPE or (k.template, kind) not in seen:
            out.append(k)
        seen.add((k.template, kind))
    return out


@pytest.mark.parametrize("arch_name", ["sm_90a", "sm_110a", "sm_100a", "sm_120a"])
def test_no_spills_outside_the_allow_list(arch_name: str, tmp_path: Path) -> None:
    spec, arch = get_preset(PRESET), get_arch(arch_name)
    kernels = plan(spec, arch)
    if arch_name not in WHOLE_PLAN:
        kernels = representative(kernels)
    report = build(spec, arch, tmp_path / "out", jobs=2, kernels=kernels)
    allowed = ALLOWED.get(arch_name, {})
    bad = {r.kernel: r.spills for r in report.rows if r.spills > allowed.get(r.kernel, (0, ""))[0]}
    assert not bad, f"{arch_name}: spill bytes (stores + loads) outside the allow-list: {bad}"


def test_allow_list_names_planned_kernels() -> None:
    spec = get_preset(PRESET)
    for arch_name, entries in ALLOWED.items():
        names = {k.name for k in plan(spec, get_arch(arch_name))}
        assert set(entries) <= names, f"{arch_name}: allow-list entries no longer planned: {set(entries) - names}"


def test_representative_subset_keeps_every_kind() -> None:
    kernels = plan(get_preset(PRESET), get_arch("sm_120a"))
    subset = representative(kernels)
    assert {(k.template, k.name.split("__")[0]) for k in subset} == {
        (k.template, k.name.split("__")[0]) for k in kernels
    }
    assert len(subset) < len(kernels)
    assert {k.name for k in kernels if k.name.startswith("moe_")} <= {k.name for k in subset}
