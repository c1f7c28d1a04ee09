"""GPU test support (not a test module): compile kernels of a plan through the codegen cache and run them through
the runtime's CUDA driver wrapper (runtime/bench/kernels.py's KernelRig, which takes cubins and manifest entries)
on NumPy inputs. GPU tests skip cleanly without a GPU / cuda-python / nvcc."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

from thorgen.codegen.arch import ArchSpec, get_arch
from thorgen.codegen.builder import compile_sources
from thorgen.codegen.kernel_spec import KernelSpec
from thorgen.codegen.plan import plan
from thorgen.codegen.render import render
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec import types
from thorgen.model_spec.types import ModelSpec
from thorgen.runtime.backend import BackendError
from thorgen.runtime.manifest import KernelEntry

PRESETS = ("tiny", "gemma-4-26b-a4b")
gpu = pytest.mark.gpu

_DEVICE = None


def work_dir() -> Path:
    return Path(os.environ.get("THORGEN_TEST_WORK", tempfile.gettempdir())) / "thorgen-gpu-tests"


def require_gpu():
    """The shared runtime `Device` (one context per process); pytest.skip when no GPU, cuda-python or nvcc is
    usable."""
    global _DEVICE
    from thorgen.runtime.cuda.device import Device

    if _DEVICE is None:
        try:
            _DEVICE = Device.open(0)
        except BackendError as exc:
            pytest.skip(f"no GPU: {exc}")
    try:
        from thorgen.codegen.nvcc import find_nvcc

        find_nvcc()
    except Exception as exc:
        pytest.skip(f"no nvcc: {exc}")
    return _DEVICE


def manifest_entry(k: KernelSpec) -> KernelEntry:
    """The runtime's manifest entry of `k`, as `thorgen build` writes it (its cubin is passed to KernelRig.add)."""
    return KernelEntry(
        name=k.name,
        cubin=Path(f"{k.name}.cubin"),
        entry=k.name,
        family=k.family,
        grid=k.grid,
        block=k.block,
        smem_bytes=k.smem_bytes,
        args=k.args,
        params=dict(k.params),
        template=k.template,
    )


def compile_kernels(kernels: list[KernelSpec], arch: ArchSpec, spec_hash: str, work: Path) -> dict[str, bytes]:
    """{kernel name: cubin} for `kernels`, compiled in parallel through codegen's content-addressed cubin cache."""
    sources = {k.name: render(k, arch, spec_hash) for k in kernels}
    return {name: cubin for name, (cubin, _) in compile_sources(sources, arch, work).items()}


def bits(a: np.ndarray) -> np.ndarray:
    """An array's raw bits (unsigned ints of its item size), for bit-for-bit comparisons of two kernels' outputs."""
    return np.ascontiguousarray(a).view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


class GpuRunner:
    """Kernels of one preset's plan for the local GPU; `run` launches one on NumPy inputs."""

    def __init__(self, preset: str, families: tuple[str, ...], linear_formats: str = "ALL_NVFP4"):
        """`linear_formats`: the name of a model_spec.types LinearFormats preset (ALL_BF16: fp16-weight kernels)."""
        from thorgen.runtime.bench.kernels import KernelRig

        self.rig = KernelRig(require_gpu(), work_dir() / "rig")
        self.arch: ArchSpec = get_arch(self.rig.arch)
        self.spec: ModelSpec = dataclasses.replace(get_preset(preset), linear_formats=getattr(types, linear_formats))
        self.kernels = {k.name: k for k in plan(self.spec, self.arch) if k.family in families}
        self.add(list(self.kernels.values()))

    def add(self, kernels: list[KernelSpec]) -> None:
        """Compile `kernels` (through the content-addressed cache) and make them launchable."""
        cubins = compile_kernels(kernels, self.arch, self.spec.spec_hash, work_dir() / self.arch.name)
        self.rig.add([manifest_entry(k) for k in kernels], cubins)

    def find(self, prefix: str) -> list[KernelSpec]:
        return [k for name, k in self.kernels.items() if name.startswith(prefix)]

    def _args(self, kernel: KernelSpec, inputs: dict, outputs: dict, bufs: dict) -> list:
        rig = self.rig
        args = []
        for name in kernel.args:
            if name in bufs:
                args.append(bufs[name])
            elif name in outputs:
                shape, dtype = outputs[name]
                buf = bufs[name] = rig.alloc(int(np.prod(shape)) * np.dtype(dtype).itemsize)
                if name in inputs:  # in/out buffers start from the given values
                    buf.upload(np.ascontiguousarray(inputs[name]))
                args.append(buf)
            elif isinstance(inputs.get(name), np.ndarray):
                bufs[name] = rig.upload(inputs[name])
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
        rig = self.rig
        bufs: dict = {}
        try:
            for kernel, grid in steps:
                rig.launch(kernel.name, self._args(kernel, inputs, outputs, bufs), grid)
            return {name: rig.download(bufs[name], shape, dtype) for name, (shape, dtype) in outputs.items()}
        finally:
            rig.free()
