"""CPU test: the hot loop of each NVFP4 family's full-size kernel (codegen/sass.py) issues no more SASS instructions
per 16 bytes of streamed weights than measured after the decode work (docs/benchmarks/NOTES.md), plus 3 %, on sm_90a
and sm_110a; the plan's one-row decode GEMVs issue their weight prologue before griddepcontrol.wait
(codegen/gemv_prologue.py). Skips without nvcc or cuobjdump."""

from __future__ import annotations

from pathlib import Path

import pytest

from thorgen.codegen.arch import get_arch
from thorgen.codegen.builder import compile_sources
from thorgen.codegen.gemv_prologue import is_decode_gemv
from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
from thorgen.codegen.plan import plan
from thorgen.codegen.render import render
from thorgen.codegen.sass import (
    PRESET,
    REPRESENTATIVES,
    SassToolMissing,
    count_families,
    disassemble,
    find_cuobjdump,
    hot_loop,
    weight_loads_before_wait,
)
from thorgen.model_spec.presets import get_preset

MARGIN = 1.03
LIMITS = {  # instructions per 16 B, nvcc 13.0
    "sm_90a": {
        # the planned slice form (codegen/gemv_prologue.py): its loop holds the warp's 3 steps, 311 instructions (its
        # refill loads never run: the whole slice loads before the wait); gemm_small's 2-step nc loop was 200 / 2
        "gemv": 103.7,
        "gemm16": 145.0,
        "moe_gateup_m1": 90.5,
        "moe_down_m1": 110.3,
        "moe_gateup_m16": 97.6,
        "moe_down_m16": 96.6,
        "lm_head": 92.5,
    },
    "sm_110a": {
        "gemv": 71.0,
        "gemm16": 85.0,
        "moe_gateup_m1": 68.0,
        "moe_down_m1": 51.8,
        "moe_gateup_m16": 59.5,
        "moe_down_m16": 52.8,
        "lm_head": 66.0,
    },
}


@pytest.fixture(scope="module", autouse=True)
def _tools() -> None:
    try:
        find_nvcc()
        find_cuobjdump()
    except (NvccNotFound, SassToolMissing) as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("arch_name", sorted(LIMITS))
def test_hot_loop_instructions_per_16_bytes(arch_name: str, tmp_path: Path) -> None:
    assert set(LIMITS[arch_name]) == set(REPRESENTATIVES)
    counts = count_families(get_arch(arch_name), tmp_path)
    over = {fam: round(c.per_16b, 1) for fam, c in counts.items() if c.per_16b > LIMITS[arch_name][fam] * MARGIN}
    assert not over, f"{arch_name}: hot loops above their limits {LIMITS[arch_name]}: {over}"


# sm_110a plans no full-size GEMV with a prologue (all wider than 8 blocks an SM of its 20): the tiny preset's
@pytest.mark.parametrize(("arch_name", "preset"), [("sm_90a", PRESET), ("sm_110a", "tiny")])
def test_planned_one_row_gemvs_load_weights_before_the_wait(arch_name: str, preset: str, tmp_path: Path) -> None:
    """Each planned one-row decode GEMV issues its prologue's 16-byte weight loads (PF x UN a lane: the warp's whole
    K slice, or the early form's PF steps) before its ACQBULK. gemm_small's own ld.global.nc prologue issued none
    there: ptxas scheduled the wait above it."""
    arch, spec = get_arch(arch_name), get_preset(preset)
    gemvs = [k for k in plan(spec, arch) if is_decode_gemv(k, arch)]
    assert gemvs
    compiled = compile_sources({k.name: render(k, arch, spec.spec_hash) for k in gemvs}, arch, tmp_path, jobs=2)
    for k in gemvs:
        loads = weight_loads_before_wait(k.name, disassemble(compiled[k.name][0]))
        assert loads == k.param("pf") * k.param("un") > 0, (k.name, k.param("prologue"), loads)


SAMPLE = """
        /*0100*/                   LDG.E.NA.LTC256B.128.CONSTANT R4, desc[UR6][R12.64] ;
        /*0110*/                   HMUL2 R20, R24, R31 ;
        /*0120*/                   NOP ;
        /*0130*/               @!P0 BRA 0x100 ;
        /*0140*/                   LDG.E.128.CONSTANT R8, desc[UR6][R16.64] ;
        /*0150*/                   BRA 0x140;
"""


def test_hot_loop_counts_the_weight_loop_without_nops() -> None:
    loop = hot_loop("k", SAMPLE)
    assert (loop.instructions, loop.weight_loads, loop.per_16b) == (3, 1, 3.0)
