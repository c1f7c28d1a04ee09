"""GPU tests: each one-row decode GEMV's bench-only prologue forms (codegen/prologue_variants.py: "nc", the
ld.global.nc prologue the plan launched before codegen/gemv_prologue.py; weights loaded before griddepcontrol.wait,
"early", the whole K slice in registers, and "smem": the block's slice copied into dynamic shared memory, with its
own grid of grouped units, and past its budget the rest streamed) give the planned kernel's outputs bit for bit (the
same sums in the same order: their tolerance is zero), on its bench case's inputs, for the tiny and the full preset.
(The chain benchmark, `thorgen bench kernels --chain N`, launches them in PDL chains.)"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
from gpu_harness import PRESETS, GpuRunner, bits  # noqa: E402
from thorgen.codegen.bench_cases import built_bench_cases
from thorgen.codegen.prologue_variants import PROLOGUES, decode_gemvs, prologue_variants
from thorgen.runtime.bench.cases import host_args

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    r = GpuRunner(request.param, ("matmul", "rope_kv"))
    r.variants = prologue_variants(list(r.kernels.values()), r.arch)
    r.add(r.variants)
    return r


def _run(runner, case, kernel: str) -> list[np.ndarray]:
    """Every buffer after one launch of `kernel` on fresh copies of the case's inputs (one seed)."""
    rig = runner.rig
    host = host_args(case, np.random.default_rng(7))
    args = [rig.upload(h) if isinstance(h, np.ndarray) else h for h in host]
    try:
        rig.launch(kernel, args, case.grid)
        return [rig.download(a, h.shape, h.dtype) for a, h in zip(args, host) if isinstance(h, np.ndarray)]
    finally:
        rig.free()


def test_forms_give_the_planned_bits(runner):
    kernels = list(runner.kernels.values()) + runner.variants
    cases = {c.kernel.name: c for c in built_bench_cases(runner.spec, runner.arch, kernels)}
    gemvs = decode_gemvs(runner.kernels.values(), runner.arch)
    assert gemvs and len(runner.variants) == len(PROLOGUES) * len(gemvs)
    smem = [v for v in runner.variants if v.param("prologue") == "smem"]
    assert {v.param("variant_of") for v in smem} == {g.name for g in gemvs}
    if runner.spec.name != "tiny" and runner.arch.name == "sm_90a":  # grouped units, a budget's streamed remainder
        assert any(v.param("un") > 1 for v in smem)
        assert any(v.param("smem_steps") * v.param("ks") < v.param("k") // 64 for v in smem)
    for v in runner.variants:
        base = v.param("variant_of")
        case = cases[base]
        want = _run(runner, case, base)
        assert any(np.abs(w.astype(np.float64)).sum() > 0 for w in want if w.dtype.kind == "f"), base
        got = _run(runner, case, v.name)
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.array_equal(bits(g), bits(w)), (v.name, f"buffer {i}")
