"""CPU test: nvcc compiles every kernel of both presets for sm_90a and sm_110a and of the tiny preset for
sm_100a and sm_120a (2 parallel nvcc processes, through the content-addressed cache). Skips without nvcc."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from thorgen.codegen.arch import get_arch
from thorgen.codegen.builder import compile_sources
from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
from thorgen.codegen.plan import plan
from thorgen.codegen.render import render
from thorgen.model_spec.presets import get_preset

TARGETS = [
    ("gemma-4-26b-a4b", "sm_90a"),
    ("gemma-4-26b-a4b", "sm_110a"),
    ("tiny", "sm_90a"),
    ("tiny", "sm_110a"),
    ("tiny", "sm_100a"),
    ("tiny", "sm_120a"),
]


@pytest.fixture(scope="module", autouse=True)
def _nvcc() -> None:
    try:
        find_nvcc()
    except NvccNotFound as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("preset,arch_name", TARGETS, ids=[f"{p}-{a}" for p, a in TARGETS])
def test_compiles(preset: str, arch_name: str, tmp_path: Path) -> None:
    spec, arch = get_preset(preset), get_arch(arch_name)
    kernels = plan(spec, arch)
    sources = {k.name: render(k, arch, spec.spec_hash) for k in kernels}
    start = time.perf_counter()
    results = compile_sources(sources, arch, tmp_path, jobs=2)
    elapsed = time.perf_counter() - start
    assert set(results) == set(sources)
    for name, (cubin, res) in results.items():
        assert cubin[:4] == b"\x7fELF", f"{name}: not an ELF cubin"
        info = res.info.get(name)
        assert info is not None and info.registers > 0, f"{name}: no ptxas report"
    print(
        f"{preset} {arch_name}: {len(sources)} kernels in {elapsed:.1f}s "
        f"({sum(not r.cached for _, r in results.values())} compiled)"
    )
