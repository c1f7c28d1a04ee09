"""CPU test: the hot loop of each NVFP4 family's full-size kernel (codegen/sass.py) issues no more SASS instructions
per 16 bytes of streamed weights than measured after the decode work (docs/benchmarks/NOTES.md), plus 3 %, on sm_90a
and sm_110a. Skips without nvcc or cuobjdump."""

from __future__ import annotations

from pathlib import Path

import pytest

from thorgen.codegen.arch import get_arch
from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
from thorgen.codegen.sass import REPRESENTATIVES, SassToolMissing, count_families, find_cuobjdump, hot_loop

MARGIN = 1.03
LIMITS = {  # instructions per 16 B, nvcc 13.0
    "sm_90a": {
        "gemv": 100.0,
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
