"""CPU tests of the one-row decode GEMVs' weight prologue: the form the plan launches (codegen/gemv_prologue.py:
"slice" where the warp's K slice fits its registers, else "early"), its bench-only forms (codegen/prologue_variants.py)
and the chain benchmark that times them (runtime/bench/kernel_chain.py). The forms change only the loads' timing
(same template, grid, K split and arguments; the step programs stay as they were, launching the planned kernel, which
equals its slice or early form under its own name), `thorgen build --prologue-variants` (nvcc replaced by empty
cubins) writes them with their planned kernel's bench case, they give the planned kernel's outputs through the
emulated driver, and `thorgen bench kernels --chain N` runs over such a build. The smem form may also group units
into fewer blocks (the same per-unit sums) and stage them in dynamic shared memory within its budget. With nvcc and
cuobjdump, the compiled forms issue their prologue's weight loads (the smem form: its cp.async copies) before
griddepcontrol.wait (its SASS ACQBULK), all but the nc form, whose ld.global.nc loads ptxas moves after it."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

import engine_emulator as EE
from thorgen.codegen import builder
from thorgen.codegen.arch import get_arch
from thorgen.codegen.bench_cases import built_bench_cases
from thorgen.codegen.nvcc import CompileResult
from thorgen.codegen.plan import plan
from thorgen.codegen.programs import emit_programs
from thorgen.codegen.gemv_prologue import planned_prologue, slice_fits, steps_a_warp
from thorgen.codegen.prologue_variants import (
    PROLOGUES,
    SMEM_BLOCK_BUDGET,
    STEP_BYTES,
    decode_gemvs,
    prologue_variants,
    stream_pf,
)
from thorgen.codegen.render import render
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.backend import BackendError
from thorgen.runtime.bench import cases as runtime_cases
from thorgen.runtime.bench import kernel_chain
from thorgen.runtime.bench import kernels as kernel_bench
from thorgen.runtime.bench.kernels import KernelRig
from thorgen.runtime.cuda import device as dev
from thorgen.runtime.manifest import load_manifest

ARCH = "sm_90a"
FULL = "gemma-4-26b-a4b"
TIMING_PARAMS = {"pf", "prologue", "variant_of", "min_blocks"}  # what a form may change: when its loads issue
SMEM_PARAMS = TIMING_PARAMS | {"un", "smem_steps"}  # and the smem form: units a block, steps staged a warp


def _empty_cubins(sources: dict[str, str], arch, work_dir: Path, jobs: int = 0, cache=None) -> dict:
    return {name: (b"", CompileResult(name, 0.0, True, {})) for name in sources}


def _fake_build(out: Path, preset: str, variants: bool = True) -> Path:
    """`thorgen build --preset P --arch sm_90a [--prologue-variants]` with nvcc replaced by empty cubins."""
    spec, arch = get_preset(preset), get_arch(ARCH)
    kernels = plan(spec, arch)
    if variants:
        kernels += prologue_variants(kernels, arch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "compile_sources", _empty_cubins)
        mp.setattr(builder, "find_nvcc", lambda: "nvcc")
        mp.setattr(builder, "nvcc_version", lambda nvcc: "emulated")
        builder.build(spec, arch, out, kernels=kernels)
    return out


ARCHS = ("sm_90a", "sm_100a", "sm_110a", "sm_120a")
# (arch, planned GEMV) -> its form, gemma-4-26b-a4b: every one a slice but where ptxas spills it at 64 registers
# (gemv_prologue.SLICE_STEPS_AT_FLOOR); sm_110a's full-size GEMVs are all too wide for a prologue
FULL_EARLY = {
    "sm_90a": {"nvfp4_gemv__n2816_k8192_attn_tail"},
    "sm_100a": {"nvfp4_gemv__n2816_k8192_attn_tail", "nvfp4_gemv__n8192_k2816", "nvfp4_gemv__n9216_k2816"},
}
FULL_EARLY["sm_120a"] = FULL_EARLY["sm_100a"]


@pytest.mark.parametrize("arch_name", ARCHS)
@pytest.mark.parametrize("preset", ["tiny", FULL])
def test_plan_launches_the_slice_form_where_it_fits_else_early(preset, arch_name):
    spec, arch = get_preset(preset), get_arch(arch_name)
    planned = plan(spec, arch)
    gemvs = decode_gemvs(planned, arch)
    assert gemvs or (preset, arch_name) == (FULL, "sm_110a")
    for k in gemvs:
        form = "slice" if slice_fits(k, arch) else "early"
        assert k.param("prologue") == planned_prologue(k, arch) == form, k.name
        if form == "slice":
            assert k.param("pf") == steps_a_warp(k) and k.threads * k.param("min_blocks") * 64 <= 65536, k.name
        else:
            assert k.param("pf") == stream_pf(k, arch) and k.param("min_blocks", None) is None, k.name
        source = render(k, arch, spec.spec_hash)
        assert re.search(r"thorgen::gemm_small<[^>]*, true>\(", source), k.name  # gemm_small's EARLY
    early = {k.name.split("_rope__")[0] for k in gemvs if k.param("prologue") == "early"}
    assert early == (FULL_EARLY.get(arch_name, set()) if preset == FULL else set())
    # the other one-row GEMVs (the lm_head's width) keep gemm_small's form: no prologue, no EARLY
    for k in planned:
        if k.template == "nvfp4_gemm.cu.j2" and k not in gemvs:
            assert k.param("prologue", None) is None, k.name


@pytest.mark.parametrize("preset", ["tiny", FULL])
def test_forms_change_only_when_the_weights_load(preset):
    spec, arch = get_preset(preset), get_arch(ARCH)
    planned = plan(spec, arch)
    gemvs = decode_gemvs(planned, arch)
    variants = prologue_variants(planned, arch)
    assert gemvs and len(variants) == len(PROLOGUES) * len(gemvs)
    assert not {v.name for v in variants} & {k.name for k in planned}
    assert all(k.param("n") // 16 < 8 * arch.sm_count for k in gemvs)  # not the lm_head's width
    if preset == FULL:
        assert "nvfp4_gemv__n262144_k2816" in {k.name for k in planned} - {k.name for k in gemvs}
    by_name = {k.name: k for k in planned}
    assert {v.param("prologue") for v in variants} == set(PROLOGUES)
    for v in variants:
        base = by_name[v.param("variant_of")]
        assert v.name == f"{base.name}_{v.param('prologue')}"
        assert (v.template, v.block, v.args, v.family) == (base.template, base.block, base.args, base.family)
        if v.param("prologue") == "smem":
            _check_smem_form(v, base, arch, render(v, arch, spec.spec_hash))
            continue
        assert v.grid == base.grid and v.smem_bytes == base.smem_bytes == 0
        same = {key: val for key, val in v.params if key not in TIMING_PARAMS}
        assert same == {key: val for key, val in base.params if key not in TIMING_PARAMS}
        if v.param("prologue") == base.param("prologue"):  # the planned kernel is this form under its own name
            assert {key: val for key, val in v.params if key != "variant_of"} == dict(base.params)
        if v.param("prologue") in ("nc", "early"):
            assert v.param("pf") == stream_pf(base, arch) and v.param("min_blocks", None) is None
        else:  # the warp's whole K slice, the grid resident where 64 registers a thread allow it
            assert v.param("pf") == math.ceil(base.param("k") // 64 / base.param("ks"))
            assert 1 <= v.param("min_blocks") <= math.ceil(base.grid[0] / arch.sm_count)
            assert v.threads * v.param("min_blocks") * 64 <= 65536
        call = render(v, arch, spec.spec_hash).split("thorgen::gemm_small<")[1].split(")")[0]
        assert (", true>(" in call) == (v.param("prologue") != "nc"), v.name  # gemm_small's EARLY


def _check_smem_form(v, base, arch, source: str) -> None:
    """The smem form: UN whole units a block (a head's with rope_kv folded in), the planned K split and sums, and
    its shared memory within the budget: the warp's whole K range, or at least one step of every warp."""
    same = {key: val for key, val in v.params if key not in SMEM_PARAMS}
    assert same == {key: val for key, val in base.params if key not in SMEM_PARAMS}
    un, units, ks = v.param("un"), base.param("n") // 16, base.param("ks")
    assert 1 <= un <= 4 and units % un == 0 and v.grid == (units // un, 1, 1)
    if base.param("epi") == "rope_kv":
        assert base.param("D") % (16 * un) == 0
    steps, most = base.param("k") // 64, math.ceil(base.param("k") // 64 / ks)
    assert 1 <= v.param("smem_steps") <= most
    assert v.smem_bytes == min(steps, ks * v.param("smem_steps")) * un * STEP_BYTES <= SMEM_BLOCK_BUDGET
    assert v.smem_bytes + ks * 8 * 16 * 4 <= (arch.smem_per_block_max + 1024) // 2
    assert v.threads * v.param("min_blocks") * 64 <= 65536
    assert f", false, {v.param('smem_steps')}>(" in source  # gemm_small's SMEM_STEPS
    assert f"{v.smem_bytes} B of dynamic shared memory" in source


def test_smem_forms_at_full_size_group_units_and_stage_whole_slices_where_they_fit():
    spec, arch = get_preset(FULL), get_arch(ARCH)
    variants = prologue_variants(plan(spec, arch), arch)
    forms = {v.param("variant_of"): v for v in variants if v.param("prologue") == "smem"}
    assert len(forms) == 8
    for name, v in forms.items():
        most = math.ceil(v.param("k") // 64 / v.param("ks"))
        # every SM holds at most 512 threads of a kernel (two kernels' blocks share it) where 4 units a block allow
        assert math.ceil(v.grid[0] / arch.sm_count) * v.threads <= 512 or v.param("un") == 4, name
        if v.param("k") == 8192:  # the o_proj of the full layers: 147 KB a block of 2 units, past the budget
            assert v.param("smem_steps") < most and v.smem_bytes <= SMEM_BLOCK_BUDGET
        else:
            assert v.param("smem_steps") == most, name


def test_step_programs_and_bench_cases_of_a_build_with_the_forms():
    spec, arch = get_preset("tiny"), get_arch(ARCH)
    planned = plan(spec, arch)
    variants = prologue_variants(planned, arch)
    programs = emit_programs(spec, arch, planned, ["bf16"], 64)
    assert emit_programs(spec, arch, planned + variants, ["bf16"], 64) == programs
    cases = {c.kernel.name: c for c in built_bench_cases(spec, arch, planned + variants)}
    assert not {v.name for v in variants} & set(c.kernel.name for c in built_bench_cases(spec, arch, planned))
    for v in variants:
        base = cases[v.param("variant_of")]
        assert cases[v.name].kernel == v and cases[v.name].args == base.args
        assert cases[v.name].bytes_moved == base.bytes_moved and base.weight_streaming


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> Path:
    return _fake_build(tmp_path_factory.mktemp("build") / "tiny" / ARCH, "tiny")


def _outputs(rig: KernelRig, case, kernel: str) -> list[np.ndarray]:
    """Every buffer after one launch of `kernel` on `case`'s inputs (drawn afresh from one seed)."""
    host = runtime_cases.host_args(case, np.random.default_rng(3))
    args = [rig.upload(h) if isinstance(h, np.ndarray) else h for h in host]
    rig.launch(kernel, args, case.grid)
    out = [rig.download(a, h.shape, h.dtype) for a, h in zip(args, host) if isinstance(h, np.ndarray)]
    rig.free()
    return out


def _check_forms_match(build: Path, tmp_path: Path) -> int:
    manifest = load_manifest(build)
    forms = kernel_chain.prologue_forms(manifest)
    cases = [c for c in runtime_cases.load_bench_cases(manifest) if c.kernel in forms]
    assert cases and {c.kernel for c in cases} == set(forms)
    EE.install(build)
    device = dev.Device.open(0)
    rig = KernelRig(device, tmp_path / "work", arch=manifest.arch)
    try:
        rig.add(manifest.kernel(k) for c in cases for k in forms[c.kernel].values())
        for case in cases:
            want = _outputs(rig, case, case.kernel)
            for form, kernel in forms[case.kernel].items():
                got = _outputs(rig, case, kernel)
                assert all(np.array_equal(g.view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)), kernel
    finally:
        rig.close()
        device.close()
        dev.set_driver(None)
    return len(cases)


def test_emulated_forms_give_the_planned_outputs(tiny_build: Path, tmp_path: Path) -> None:
    assert _check_forms_match(tiny_build, tmp_path) == len(
        decode_gemvs(plan(get_preset("tiny"), get_arch(ARCH)), get_arch(ARCH))
    )


@pytest.mark.slow
def test_emulated_forms_give_the_planned_outputs_at_full_size(tmp_path: Path) -> None:
    build = _fake_build(tmp_path / "full" / ARCH, FULL)
    assert _check_forms_match(build, tmp_path) == 8  # 4 q|k|v (2 layer kinds x 2 KV dtypes), 2 o, gate|up, down


@pytest.fixture
def emulated_gpu(tiny_build: Path, monkeypatch: pytest.MonkeyPatch):
    """The emulated driver, timing nothing (EE.install_for_timing)."""
    yield EE.install_for_timing(tiny_build, monkeypatch)
    dev.set_driver(None)


def test_chain_benchmark_runs_over_a_build_with_the_forms(tiny_build: Path, emulated_gpu) -> None:
    n = 3
    report = kernel_bench.run_bench(kernel_dir=tiny_build, iters=2, chain=n)
    chain, manifest = report["chain"], load_manifest(tiny_build)
    forms = kernel_chain.prologue_forms(manifest)
    assert chain["forms"] == ["planned", *sorted(PROLOGUES)] and chain["launches"] == n  # the manifest's order
    assert [r["kernel"] for r in chain["kernels"]] == [
        c.kernel for c in runtime_cases.load_bench_cases(manifest) if c.kernel in forms
    ]
    for r in chain["kernels"]:  # 10 us between the events around a replay of n launches
        assert {f: row["kernel"] for f, row in r["forms"].items()} == forms[r["kernel"]]
        for row in r["forms"].values():
            assert row["us"] == pytest.approx(10.0 / n)
            assert row["gbps"] == pytest.approx(r["bytes"] / (10.0 / n * 1e-6) / 1e9)
            assert row["fraction_of_copy"] == pytest.approx(row["gbps"] / report["copy_gbps"])
    step = chain["step"]
    layers = kernel_chain.step_layers(manifest, forms)
    assert layers and all(layer for layer in layers)
    order = [k for i in range(n) for k in layers[i % len(layers)]]
    assert step["launches"] == len(order) and set(step["forms"]) == set(chain["forms"])
    assert step["bytes"] == sum(r["bytes"] for k in order for r in chain["kernels"] if r["kernel"] == k)
    for m in step["forms"].values():
        assert m["ms"] == pytest.approx(0.01) and m["us"] == pytest.approx(10.0 / len(order))
    graphs = len(chain["kernels"]) * len(chain["forms"]) + len(chain["forms"])
    launches = len(chain["kernels"]) * len(chain["forms"]) * n + len(chain["forms"]) * len(order)
    assert emulated_gpu.pdl_launches == launches - graphs  # every launch but a graph's first
    every_form = {k for f in forms.values() for k in f.values()}
    assert every_form <= set(emulated_gpu.launches)
    assert "decode step order, 3 layers" in kernel_bench.format_report(report)


def test_chain_benchmark_asks_for_the_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build = _fake_build(tmp_path / "plain" / "tiny" / ARCH, "tiny", variants=False)
    driver = EE.install(build)
    monkeypatch.setattr(driver, "cuEventElapsedTime", lambda a, b: (EE.OK, 0.01))
    probe = KernelRig.copy_bandwidth_gbps
    monkeypatch.setattr(KernelRig, "copy_bandwidth_gbps", lambda rig: probe(rig, nbytes=1 << 20, iters=2))
    try:
        with pytest.raises(BackendError, match="thorgen build --prologue-variants"):
            kernel_bench.run_bench(kernel_dir=build, iters=1, chain=2)
    finally:
        dev.set_driver(None)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", FULL])
def test_compiled_forms_load_their_prologue_before_the_wait(preset: str, tmp_path: Path) -> None:
    """nvcc for sm_90a: each form compiles without spilling beyond the 8192-wide o_proj's slice (prologue_variants'
    note) and its SASS issues every prologue step's 16-byte weight load (PF x UN a lane) before ACQBULK; the smem
    form issues all its cp.async copies before it; the nc form none of its loads."""
    from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
    from thorgen.codegen.sass import (
        SassToolMissing,
        copies_around_wait,
        disassemble,
        find_cuobjdump,
        weight_loads_before_wait,
    )

    try:
        find_nvcc()
        find_cuobjdump()
    except (NvccNotFound, SassToolMissing) as exc:
        pytest.skip(str(exc))
    spec, arch = get_preset(preset), get_arch(ARCH)
    variants = prologue_variants(plan(spec, arch), arch)
    compiled = builder.compile_sources({v.name: render(v, arch, spec.spec_hash) for v in variants}, arch, tmp_path)
    for v in variants:
        cubin, result = compiled[v.name]
        sass = disassemble(cubin)
        if v.param("prologue") == "smem":  # every copy into shared memory issues before the wait, and past the
            # budget the streamed rest's first step a unit (its one-step ring, loaded while the staged steps compute)
            before, after = copies_around_wait(v.name, sass)
            assert before > 0 and after == 0, (v.name, before, after)
            streamed = v.param("smem_steps") < math.ceil(v.param("k") // 64 / v.param("ks"))
            assert weight_loads_before_wait(v.name, sass) == (v.param("un") if streamed else 0), v.name
        elif v.param("prologue") == "nc":  # ptxas schedules the wait above the ld.global.nc prologue
            assert weight_loads_before_wait(v.name, sass) == 0, v.name
        else:
            assert weight_loads_before_wait(v.name, sass) == v.param("pf") * v.param("un"), v.name
        spills = result.info[v.name].spills
        assert spills == 0 or v.name == "nvfp4_gemv__n2816_k8192_attn_tail_slice", (v.name, spills)


def test_bench_kernels_command_writes_the_chain_report(tiny_build: Path, tmp_path: Path, emulated_gpu) -> None:
    from click.testing import CliRunner

    from thorgen.cli import main

    out = tmp_path / "chain.json"
    args = ["bench", "kernels", "--kernel-dir", str(tiny_build), "--chain", "2", "--iters", "1", "--json", str(out)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["chain"]["launches"] == 2 and report["chain"]["step"]["layers"] == 2
    assert "decode step order, 2 layers" in result.output
