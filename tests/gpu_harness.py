"""GPU test support (not a test module): build kernels of a plan through the codegen cache, run them through
cuda.bindings on NumPy inputs, time them. GPU tests skip cleanly without a GPU / cuda-python / nvcc."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from thorgen.codegen.arch import ArchSpec, native_arch
from thorgen.codegen.kernel_spec import KernelSpec
from thorgen.codegen.plan import plan
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.types import ModelSpec

PRESETS = ("tiny", "gemma-4-26b-a4b")
gpu = pytest.mark.gpu

_GPU = None


def require_gpu():
    """The shared `Gpu` (one context per process); pytest.skip when no GPU, cuda-python or nvcc is usable."""
    global _GPU
    from thorgen.codegen.device import Gpu, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no GPU: {reason}")
    try:
        from thorgen.codegen.nvcc import find_nvcc

        find_nvcc()
    except Exception as exc:
        pytest.skip(f"no nvcc: {exc}")
    if _GPU is None:
        _GPU = Gpu(0)
    return _GPU


def bits(a: np.ndarray) -> np.ndarray:
    """An array's raw bits (unsigned ints of its item size), for bit-for-bit comparisons of two kernels' outputs."""
    return np.ascontiguousarray(a).view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def build_kernels(specs: list[KernelSpec], arch: ArchSpec, spec_hash: str = "0" * 64) -> dict[str, bytes]:
    """{kernel name: cubin} for `specs`, compiled in parallel through the content-addressed cache."""
    from thorgen.codegen.builder import compile_sources
    from thorgen.codegen.render import render

    sources = {k.name: render(k, arch, spec_hash) for k in specs}
    work = Path(os.environ.get("THORGEN_TEST_WORK", tempfile.gettempdir())) / "thorgen-gpu-tests" / arch.name
    return {name: cubin for name, (cubin, _) in compile_sources(sources, arch, work).items()}


class GpuRunner:
    """Kernels of one preset's plan for the local GPU; `run` launches one on NumPy inputs."""

    def __init__(self, preset: str, families: tuple[str, ...]):
        self.gpu = require_gpu()
        self.arch = native_arch()
        self.spec: ModelSpec = get_preset(preset)
        self.kernels = {k.name: k for k in plan(self.spec, self.arch) if k.family in families}
        self.cubins = build_kernels(list(self.kernels.values()), self.arch, self.spec.spec_hash)

    def find(self, prefix: str) -> list[KernelSpec]:
        return [k for name, k in self.kernels.items() if name.startswith(prefix)]

    def _args(self, kernel: KernelSpec, inputs: dict, outputs: dict, bufs: dict) -> list:
        g = self.gpu
        args = []
        for name in kernel.args:
            if name in bufs:
                args.append(bufs[name])
            elif name in outputs:
                shape, dtype = outputs[name]
                buf = bufs[name] = g.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
                if name in inputs:  # in/out buffers start from the given values
                    arr = np.ascontiguousarray(inputs[name])
                    g.cu.cuMemcpyHtoD(buf.ptr, arr.ctypes.data, arr.nbytes)
                args.append(buf)
            elif isinstance(inputs.get(name), np.ndarray):
                bufs[name] = g.upload(inputs[name])
                args.append(bufs[name])
            elif name in inputs:
                args.append(inputs[name])
            else:
                args.append(None)  # optional pointer left null
        return args

    def run(self, kernel: KernelSpec, inputs: dict, outputs: dict, grid=None) -> dict[str, np.ndarray]:
        """Launch `kernel`; inputs: arrays (uploaded) or numpy scalars; outputs: {name: (shape, dtype)}."""
        return self.run_seq([(kernel, grid)], inputs, outputs)

    def run_seq(self, steps: list, inputs: dict, outputs: dict) -> dict[str, np.ndarray]:
        """Launch [(kernel, grid or None), ...] in order over one set of named buffers (shared by arg name)."""
        g = self.gpu
        bufs: dict = {}
        try:
            for kernel, grid in steps:
                fn = g.function(kernel, self.cubins[kernel.name])
                g.launch(fn, kernel, self._args(kernel, inputs, outputs, bufs), grid)
            g.sync()
            return {name: g.download(bufs[name], shape, dtype) for name, (shape, dtype) in outputs.items()}
        finally:
            g.free_all()

    def time(self, kernel: KernelSpec, inputs: dict, outputs: dict, grid=None, iters: int = 20) -> float:
        g = self.gpu
        fn = g.function(kernel, self.cubins[kernel.name])
        args = self._args(kernel, inputs, outputs, {})
        try:
            return g.time_ms(lambda: g.launch(fn, kernel, args, grid), iters)
        finally:
            g.free_all()
