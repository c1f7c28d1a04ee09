"""Codegen stage: SASS instructions per 16 bytes of streamed weights in the hot loop of the NVFP4 kernel families.

`python -m thorgen.codegen.sass [--arch sm_90a --arch sm_110a]` compiles each family's representative full-size
kernel (REPRESENTATIVES), disassembles it with `cuobjdump -sass` and finds its hot loop: the backward branch whose
body holds the most streaming weight loads (`LDG.E.NA...128`, 16 bytes each). The count is the loop's instructions
(NOPs left out) over its weight loads: what a lane issues for each 16 bytes of weights it streams (decode, scale,
mma, activation loads, addressing). tests/test_sass_counts.py keeps it from rising. weight_loads_before_wait counts
the weight loads a kernel issues before its griddepcontrol.wait (tests/test_sass_counts.py: the planned one-row
GEMVs'), copies_around_wait its cp.async copies into shared memory on either side of it
(tests/test_prologue_variants.py).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..model_spec.presets import get_preset
from .arch import ArchSpec, get_arch
from .builder import compile_sources
from .plan import plan
from .render import render

# family -> its full-size kernel (gemma-4-26b-a4b): one-row GEMV, 16-row GEMM, MoE gate/up and down (one row and
# 16 rows), the lm_head GEMV
REPRESENTATIVES: dict[str, str] = {
    "gemv": "nvfp4_gemv__n2816_k2112",
    "gemm16": "nvfp4_gemm16__n2816_k4096",
    "moe_gateup_m1": "moe_gateup__m1_e128_k8_i704_h2816",
    "moe_down_m1": "moe_down__m1_e128_k8_i704_h2816",
    "moe_gateup_m16": "moe_gateup__m16_e128_k8_i704_h2816",
    "moe_down_m16": "moe_down_pairs__m16_e128_k8_i704_h2816",
    "lm_head": "nvfp4_gemv__n262144_k2816",
}
PRESET = "gemma-4-26b-a4b"
CUOBJDUMP_HELP = (
    "cuobjdump was not found: put the CUDA toolkit's bin/ on PATH or `pip install "
    "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm` (the wheels)"
)

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


class SassToolMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class LoopCount:
    kernel: str
    instructions: int  # in the hot loop's body, NOPs left out
    weight_loads: int  # 16-byte streaming weight loads in it

    @property
    def per_16b(self) -> float:
        return self.instructions / self.weight_loads


def _wheel_bins() -> list[Path]:
    try:
        import nvidia  # the nvidia-cuda-* wheels install under the nvidia namespace package
    except ImportError:
        return []
    return [Path(p) / sub / "bin" for p in nvidia.__path__ for sub in ("cu13", "cu12", "cuda_cuobjdump")]


def find_cuobjdump() -> tuple[str, dict[str, str]]:
    """cuobjdump's path and the environment to run it in (nvdisasm on PATH); SassToolMissing without it."""
    found = shutil.which("cuobjdump")
    bins = [Path(found).parent] if found else [b for b in _wheel_bins() if (b / "cuobjdump").is_file()]
    if not bins:
        raise SassToolMissing(CUOBJDUMP_HELP)
    env = dict(os.environ, PATH=os.pathsep.join([str(bins[0]), os.environ.get("PATH", "")]))
    if not shutil.which("nvdisasm", path=env["PATH"]):
        raise SassToolMissing(CUOBJDUMP_HELP)
    return str(bins[0] / "cuobjdump"), env


def disassemble(cubin: bytes) -> str:
    """`cuobjdump -sass` of one cubin."""
    tool, env = find_cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {proc.stderr.strip()}")
    return proc.stdout


def hot_loop(kernel: str, sass: str) -> LoopCount:
    """The loop (a backward branch's span) with the most weight loads; the smaller span on a tie."""
    instrs = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INSTR.finditer(sass)]
    best: LoopCount | None = None
    best_span = 0
    for addr, op, rest in instrs:
        if not op.startswith("BRA") or not (target := _BRANCH_TARGET.search(rest)):
            continue
        start = int(target.group(1), 16)
        if start >= addr:
            continue
        body = [(o, r) for a, o, r in instrs if start <= a <= addr and not o.startswith("NOP")]
        loads = sum(o.startswith("LDG") and ".NA." in o and ".128" in o for o, _ in body)
        span = addr - start
        if loads and (best is None or loads > best.weight_loads or (loads == best.weight_loads and span < best_span)):
            best, best_span = LoopCount(kernel, len(body), loads), span
    if best is None:
        raise RuntimeError(f"{kernel}: no loop with streaming weight loads in its SASS")
    return best


def weight_loads_before_wait(kernel: str, sass: str) -> int:
    """16-byte streaming weight loads (`LDG.E.NA...128`) that issue before the kernel's griddepcontrol.wait (its
    ACQBULK): the weights in flight while the previous kernel of a PDL chain still runs."""
    ops = [m.group(2) for m in _INSTR.finditer(sass)]
    if "ACQBULK" not in ops:
        raise RuntimeError(f"{kernel}: no griddepcontrol.wait (ACQBULK) in its SASS")
    return sum(o.startswith("LDG") and ".NA." in o and ".128" in o for o in ops[: ops.index("ACQBULK")])


def copies_around_wait(kernel: str, sass: str) -> tuple[int, int]:
    """(cp.async instructions before the kernel's griddepcontrol.wait (its ACQBULK), those after it): `LDGSTS`
    (cp.async.cg / .ca) and `UBLKCP` (cp.async.bulk), the copies into shared memory that a smem GEMV form issues
    while the previous kernel of a PDL chain still runs. Instructions, not their dynamic count: a copy loop's body
    counts once."""
    ops = [m.group(2) for m in _INSTR.finditer(sass)]
    if "ACQBULK" not in ops:
        raise RuntimeError(f"{kernel}: no griddepcontrol.wait (ACQBULK) in its SASS")
    wait = ops.index("ACQBULK")
    copies = [i for i, o in enumerate(ops) if o.startswith(("LDGSTS", "UBLKCP"))]
    return sum(i < wait for i in copies), sum(i > wait for i in copies)


def count_families(
    arch: ArchSpec, work_dir: Path, families: dict[str, str] = REPRESENTATIVES, jobs: int = 2
) -> dict[str, LoopCount]:
    """{family: its representative's hot-loop count} for `arch` (compiled through the cubin cache)."""
    spec = get_preset(PRESET)
    kernels = {k.name: k for k in plan(spec, arch)}
    sources = {name: render(kernels[name], arch, spec.spec_hash) for name in families.values()}
    compiled = compile_sources(sources, arch, work_dir, jobs=jobs)
    return {fam: hot_loop(name, disassemble(compiled[name][0])) for fam, name in families.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thorgen.codegen.sass", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="arch to count (repeatable; default sm_90a and sm_110a)")
    args = parser.parse_args(argv)
    try:
        archs = [get_arch(a) for a in (args.arch or ["sm_90a", "sm_110a"])]
        find_cuobjdump()
    except (ValueError, SassToolMissing) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{'family':<16} {'kernel':<40} " + " ".join(f"{a.name:>14}" for a in archs))
    with tempfile.TemporaryDirectory() as tmp:
        counts = {a.name: count_families(a, Path(tmp) / a.name) for a in archs}
    for fam, name in REPRESENTATIVES.items():
        cells = [
            f"{counts[a.name][fam].per_16b:>6.1f} ({counts[a.name][fam].instructions:>3}/"
            f"{counts[a.name][fam].weight_loads})"
            for a in archs
        ]
        print(f"{fam:<16} {name:<40} " + " ".join(f"{c:>14}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
