"""CPU test: the kernel plan is exactly what the step programs launch, for every shipped preset and arch: no planned
kernel is left unlaunched (it would be compiled and shipped for nothing) and no program lacks a kernel."""

from __future__ import annotations

import dataclasses

import pytest

from thorgen.codegen.arch import ARCHS, get_arch
from thorgen.codegen.families import KV_DTYPES, MAX_STEP_TOKENS
from thorgen.codegen.families.matmul import gemm_small
from thorgen.codegen.kernel_spec import KernelSpec
from thorgen.codegen.plan import plan
from thorgen.codegen.programs import emit_programs
from thorgen.model_spec import types
from thorgen.model_spec.presets import PRESETS, get_preset


def launched(programs: dict) -> set[str]:
    """Names of the kernels some launch of some program runs."""
    return {
        op["kernel"]
        for table in programs.values()
        for ranges in table.values()
        for rng in ranges
        for op in rng["launches"]
    }


def plan_problems(spec, arch, kernels: list[KernelSpec]) -> list[str]:
    """What keeps `kernels` from being exactly the kernels of the step programs lowered against them."""
    steps = emit_programs(spec, arch, kernels, list(KV_DTYPES), MAX_STEP_TOKENS)
    used = launched(steps["programs"])
    problems = [f"planned, never launched: {k.name}" for k in kernels if k.name not in used]
    problems += [f"a program lacks {what}" for group in steps["missing"].values() for what in group]
    return problems


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_planned_kernel_is_launched(preset: str, arch: str) -> None:
    spec, a = get_preset(preset), get_arch(arch)
    kernels = plan(spec, a)
    assert kernels and not plan_problems(spec, a, kernels)


@pytest.mark.parametrize("arch", ["sm_90a", "sm_120a"])
@pytest.mark.parametrize("formats", ["ALL_BF16", "EXPERTS_ONLY_NVFP4"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_planned_kernel_is_launched_in_every_linear_format(preset: str, formats: str, arch: str) -> None:
    """bf16 linears plan fp16-weight kernels in place of the NVFP4 ones of their role, and nothing else."""
    spec = dataclasses.replace(get_preset(preset), linear_formats=getattr(types, formats))
    a = get_arch(arch)
    kernels = plan(spec, a)
    assert kernels and not plan_problems(spec, a, kernels)
    half = {k.name for k in kernels if k.param("kind", None) == "half" and k.family not in ("drafter_gemm", "vision")}
    experts_half = {n for n in half if n.startswith("moe_")}
    assert half and bool(experts_half) == (spec.linear_formats.experts == "bf16")
    assert all(n.startswith(("half_", "moe_")) for n in half)
    nvfp4 = {k.name for k in kernels if k.family in ("matmul", "rope_kv") and k.param("kind", "half") != "half"}
    assert all(f"_n{spec.target.vocab_size}_" in n for n in nvfp4), nvfp4  # only the lm_head stays NVFP4
    tower = {k for k in kernels if k.family == "vision"}  # the vision tower is bf16 whatever the text linears are
    assert tower and tower == {k for k in plan(get_preset(preset), a) if k.family == "vision"}


def test_the_check_catches_an_unlaunched_kernel() -> None:
    """A copy of the plan with a planted kernel (the plain one-row o_proj GEMV of a full layer, which the folded GEMV
    replaces), and one without a kernel some program launches: both are caught."""
    spec, a = get_preset("tiny"), get_arch("sm_90a")
    kernels = plan(spec, a)
    t = spec.target
    full = t.layer_types.index("full_attention")
    extra = gemm_small(t.hidden_size, t.num_attention_heads * t.layer_head_dim(full), 1, "store", a)
    assert extra.name not in {k.name for k in kernels}
    assert plan_problems(spec, a, kernels + [extra]) == [f"planned, never launched: {extra.name}"]
    dropped = next(k for k in kernels if k.name.startswith("router_fused__"))
    problems = plan_problems(spec, a, [k for k in kernels if k is not dropped])
    # (the programs left out also leave kernels only they launch unlaunched)
    assert any(p.startswith("a program lacks") and dropped.name in p for p in problems)
