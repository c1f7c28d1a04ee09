"""Test support (not a test module): runs rendered kernels on the CPU — g++ builds them against the host stand-in
tests/host_cuda/thorgen/common.cuh (one std::thread per CUDA thread) — behind GpuRunner's interface (`find`,
`run_seq`), so the GPU tests' bodies also run without a GPU. For kernels whose correctness does not hinge on
the memory model (the blocks of a grid run one after another): it proves the indexing, the algorithms and the
arguments, not the absence of races."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from thorgen.codegen.arch import ArchSpec
from thorgen.codegen.kernel_spec import KernelSpec
from thorgen.codegen.render import INCLUDE_DIR, render

SHIM = Path(__file__).resolve().parent / "host_cuda"
_DYN_SMEM = re.compile(r"extern __shared__ ([\w ]+?) (\w+)\[\];")

DRIVER = r"""
#include <stdio.h>
#include <stdlib.h>
#include <thread>
#include <vector>
#include "thorgen/common.cuh"
thread_local dim3_ threadIdx, blockIdx;
dim3_ gridDim, blockDim;
std::barrier<>* host_block_barrier;
uint64_t host_exchange[1024];
alignas(16) unsigned char host_dyn_smem[1 << 18];
struct Arg {
  void* p;
  long long v;
  template <typename T> operator T*() const { return (T*)p; }
  operator int() const { return (int)v; }
};
%(includes)s
static void dispatch(int kid, const Arg* a) {
  switch (kid) {
%(cases)s
  }
}
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "r");
  int nbuf;
  if (fscanf(f, "%%d", &nbuf) != 1) return 2;
  std::vector<std::vector<unsigned char>> bufs(nbuf);
  for (int i = 0; i < nbuf; ++i) {
    long n;
    char path[4096];
    if (fscanf(f, "%%ld %%4095s", &n, path) != 2) return 2;
    bufs[i].assign(n + 16, 0);
    FILE* b = fopen(path, "rb");
    if (b) { fread(bufs[i].data(), 1, n, b); fclose(b); }  // an output-only buffer's file is empty: zeros
  }
  int nl;
  if (fscanf(f, "%%d", &nl) != 1) return 2;
  for (int l = 0; l < nl; ++l) {
    int kid, gx, gy, gz, bx, na;
    if (fscanf(f, "%%d %%d %%d %%d %%d %%d", &kid, &gx, &gy, &gz, &bx, &na) != 6) return 2;
    std::vector<Arg> args(na);
    for (int j = 0; j < na; ++j) {
      char kind;
      long long v;
      if (fscanf(f, " %%c %%lld", &kind, &v) != 2) return 2;
      args[j] = kind == 'b' ? Arg{bufs[v].data(), 0} : Arg{nullptr, kind == 'i' ? v : 0};
    }
    gridDim = {(unsigned)gx, (unsigned)gy, (unsigned)gz};
    blockDim = {(unsigned)bx, 1u, 1u};
    std::barrier<> bar(bx);
    host_block_barrier = &bar;
    std::vector<std::thread> ts;
    for (int t = 0; t < bx; ++t)
      ts.emplace_back([&, t] {
        threadIdx = {(unsigned)t, 0u, 0u};
        for (int z = 0; z < gz; ++z)
          for (int y = 0; y < gy; ++y)
            for (int x = 0; x < gx; ++x) {
              blockIdx = {(unsigned)x, (unsigned)y, (unsigned)z};
              dispatch(kid, args.data());
              bar.arrive_and_wait();
            }
      });
    for (auto& t : ts) t.join();
  }
  for (int i = 0; i < nbuf; ++i) {
    char path[4096];
    snprintf(path, sizeof path, "%%s.%%d.out", argv[1], i);
    FILE* b = fopen(path, "wb");
    fwrite(bufs[i].data(), 1, bufs[i].size() - 16, b);
    fclose(b);
  }
  return 0;
}
"""


def host_compiler() -> str | None:
    return shutil.which("g++")


class HostRunner:
    """`kernels` rendered for `arch` and built once into one program under `work`; `run_seq` as GpuRunner's."""

    def __init__(self, kernels: list[KernelSpec], arch: ArchSpec, work: Path, spec_hash: str = "0" * 64) -> None:
        self.kernels = {k.name: k for k in kernels}
        self.work = Path(work)
        inc = self.work / "include" / "thorgen"
        inc.mkdir(parents=True, exist_ok=True)
        for h in (INCLUDE_DIR / "thorgen").glob("*.cuh"):  # dynamic shared memory -> the host block's buffer
            if h.name != "common.cuh":
                (inc / h.name).write_text(
                    _DYN_SMEM.sub(r"\1* \2 = reinterpret_cast<\1*>(host_dyn_smem);", h.read_text())
                )
        includes, cases = [], []
        for i, k in enumerate(kernels):
            src = self.work / f"{k.name}.cu"
            src.write_text(render(k, arch, spec_hash))
            includes.append(f'namespace k{i} {{\n#include "{src}"\n}}')
            args = ", ".join(f"a[{j}]" for j in range(len(k.args)))
            cases.append(f"    case {i}: k{i}::{k.name}({args}); break;")
        # the headers first, outside the namespaces (their #pragma once then keeps them there)
        pre = "\n".join(f'#include "thorgen/{h}"' for h in ("sample.cuh", "logits.cuh"))
        (self.work / "driver.cpp").write_text(
            DRIVER % {"includes": pre + "\n" + "\n".join(includes), "cases": "\n".join(cases)}
        )
        self.exe = self.work / "driver"
        subprocess.run(
            [
                host_compiler() or "g++",
                "-std=c++20",
                "-O1",
                "-ffp-contract=off",
                "-pthread",
                "-Wno-unused-result",
                f"-I{SHIM}",
                f"-I{self.work / 'include'}",
                "-o",
                str(self.exe),
                str(self.work / "driver.cpp"),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        self._ids = {k.name: i for i, k in enumerate(kernels)}
        self._runs = 0

    def find(self, prefix: str) -> list[KernelSpec]:
        return [k for name, k in self.kernels.items() if name.startswith(prefix)]

    def run_seq(self, steps: list, inputs: dict, outputs: dict) -> dict[str, np.ndarray]:
        """Launch [(kernel, grid or None), ...] in order over one set of named buffers (shared by arg name);
        inputs: arrays or numpy scalars; outputs: {name: (shape, dtype)}, zero-filled unless also an input."""
        self._runs += 1
        run = self.work / f"run{self._runs}"
        names: list[str] = []
        for kernel, _ in steps:
            names += [
                a for a in kernel.args if (a in outputs or isinstance(inputs.get(a), np.ndarray)) and a not in names
            ]
        lines = [str(len(names))]
        for i, name in enumerate(names):
            arr = np.ascontiguousarray(inputs[name]) if isinstance(inputs.get(name), np.ndarray) else None
            size = max(
                arr.nbytes if arr is not None else 0,
                int(np.prod(outputs[name][0])) * np.dtype(outputs[name][1]).itemsize if name in outputs else 0,
            )
            path = Path(f"{run}.{i}.in")
            path.write_bytes(arr.tobytes() if arr is not None else b"")
            lines.append(f"{size} {path}")
        lines.append(str(len(steps)))
        for kernel, grid in steps:
            g = grid or kernel.grid
            args = []
            for a in kernel.args:
                if a in names:
                    args.append(f"b {names.index(a)}")
                elif a in inputs:
                    args.append(f"i {int(inputs[a])}")
                else:
                    args.append("n 0")  # optional pointer left null
            head = f"{self._ids[kernel.name]} {g[0]} {g[1]} {g[2]} {kernel.threads} {len(args)}"
            lines.append(" ".join([head, *args]))
        Path(run).write_text("\n".join(lines) + "\n")
        subprocess.run([str(self.exe), str(run)], check=True, timeout=600)
        out = {}
        for name, (shape, dtype) in outputs.items():
            data = Path(f"{run}.{names.index(name)}.out").read_bytes()
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            out[name] = np.frombuffer(data[:n], dtype=dtype).reshape(shape).copy()
        return out
