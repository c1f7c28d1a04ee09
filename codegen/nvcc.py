"""Codegen stage: the nvcc driver — one flag table per arch, compile to cubin, parse `-Xptxas -v` per kernel."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .arch import ArchSpec

# No --use_fast_math: RoPE angles reach 2.6e5 rad (sin/cos need full range reduction), and the softmax / softcap /
# GELU parity with the NumPy reference is worth more than the few cycles; kernels call __expf etc. where safe.
BASE_FLAGS: tuple[str, ...] = ("-cubin", "-O3", "-std=c++17", "-lineinfo", "-Xptxas", "-v")
ARCH_FLAGS: dict[str, tuple[str, ...]] = {
    "sm_90a": ("-gencode=arch=compute_90a,code=sm_90a",),
    "sm_100a": ("-gencode=arch=compute_100a,code=sm_100a",),
    "sm_110a": ("-gencode=arch=compute_110a,code=sm_110a",),
    "sm_120a": ("-gencode=arch=compute_120a,code=sm_120a",),
}

NVCC_HELP = (
    "nvcc (the CUDA compiler, 12.9 or later for sm_110a) was not found. Install a CUDA toolkit "
    "(https://developer.nvidia.com/cuda-downloads) and put its bin/ on PATH, or `pip install "
    "nvidia-cuda-nvcc` (the wheel), or point THORGEN_NVCC at an nvcc binary."
)


class NvccNotFound(RuntimeError):
    pass


class CompileError(RuntimeError):
    """nvcc failed on one kernel: names it and where its source and log were kept."""

    def __init__(self, kernel: str, source: Path, log: Path, tail: str):
        super().__init__(f"nvcc failed on kernel {kernel}\n  source: {source}\n  log:    {log}\n{tail}")
        self.kernel, self.source, self.log = kernel, source, log


@dataclass
class PtxasInfo:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_bytes: int = 0
    smem_bytes: int = 0  # static shared memory

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class CompileResult:
    kernel: str
    seconds: float
    cached: bool
    info: dict[str, PtxasInfo] = field(default_factory=dict)  # per entry function in the cubin


def find_nvcc() -> str:
    """THORGEN_NVCC, then PATH, then CUDA_HOME / /usr/local/cuda, then the nvidia-cuda-nvcc wheel."""
    env = os.environ.get("THORGEN_NVCC")
    if env:
        if Path(env).is_file() and os.access(env, os.X_OK):
            return env
        raise NvccNotFound(f"THORGEN_NVCC={env} is not an executable file. " + NVCC_HELP)
    found = shutil.which("nvcc")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import nvidia.cuda_nvcc as wheel  # the nvidia-cuda-nvcc wheel

        roots += [str(Path(p)) for p in wheel.__path__]
    except ImportError:
        pass
    roots.append(str(Path(sys.prefix) / "lib" / "nvidia" / "cuda_nvcc"))
    for root in roots:
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    raise NvccNotFound(NVCC_HELP)


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    match = re.search(r"release [\d.]+, V([\d.]+)", out)
    return match.group(1) if match else out.strip().splitlines()[-1] if out.strip() else "unknown"


def flags(arch: ArchSpec, include_dir: Path) -> list[str]:
    """The full flag list (without input/output) for `arch` — part of the cache key."""
    try:
        arch_flags = ARCH_FLAGS[arch.name]
    except KeyError:
        raise ValueError(f"no nvcc flags for arch {arch.name}; known: {', '.join(ARCH_FLAGS)}") from None
    return [*BASE_FLAGS, *arch_flags, f"-I{include_dir}"]


_FN = re.compile(r"Function properties for (\w+)")
_COMPILING = re.compile(r"Compiling entry function '(\w+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, PtxasInfo]:
    """Per-entry registers / spills / static smem from `-Xptxas -v` output."""
    infos: dict[str, PtxasInfo] = {}
    current: str | None = None
    for line in log.splitlines():
        if m := _COMPILING.search(line):
            current = m.group(1)
            infos.setdefault(current, PtxasInfo())
        elif m := _FN.search(line):
            current = m.group(1)
            infos.setdefault(current, PtxasInfo())
        elif current and (m := _STACK.search(line)):
            info = infos[current]
            info.stack_bytes, info.spill_stores, info.spill_loads = (int(g) for g in m.groups())
        elif current and (m := _USED.search(line)):
            infos[current].registers = int(m.group(1))
            infos[current].smem_bytes = int(m.group(2) or 0)
    return infos


def compile_cubin(
    kernel: str, source: Path, cubin: Path, arch: ArchSpec, include_dir: Path, nvcc: str | None = None
) -> tuple[float, str]:
    """Compile `source` to `cubin`; returns (seconds, ptxas log). CompileError (source + log kept) on failure."""
    nvcc = nvcc or find_nvcc()
    cmd = [nvcc, *flags(arch, include_dir), "-o", str(cubin), str(source)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    log = " ".join(cmd) + "\n" + proc.stdout + proc.stderr
    if proc.returncode != 0 or not cubin.is_file():
        log_path = source.with_suffix(".log")
        log_path.write_text(log)
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise CompileError(kernel, source, log_path, tail)
    return seconds, log
