"""Cubin loading with an arch check, and kernel launches with their arguments packed once.

Launch arguments are packed into a `void*[]` with ctypes once (`Kernel.bind`) and reused: a bound launch costs one
`cuLaunchKernel`, and inside a graph capture it is recorded once. Argument widths come from the cubin itself
(`cuFuncGetParamInfo`), so a Python int becomes a 64-bit pointer or a 32-bit int exactly as the kernel declares it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..manifest import KernelEntry, KernelManifest, ModuleError
from .device import CudaError, Device, Stream, check, driver
from .memory import DeviceBuffer

_NO_BINARY_FOR_GPU = 209  # CUDA_ERROR_NO_BINARY_FOR_GPU
_DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory


# ---- argument packing ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ptr:
    """An explicit device pointer argument (a raw address)."""

    address: int


def _ctype_for(value: Any, size: int | None, where: str) -> Any:
    if isinstance(value, ctypes._SimpleCData):
        return value
    if isinstance(value, DeviceBuffer):
        return ctypes.c_uint64(value.ptr)
    if isinstance(value, Ptr):
        return ctypes.c_uint64(value.address)
    if isinstance(value, np.generic):
        return np.ctypeslib.as_ctypes_type(value.dtype)(value.item())
    if isinstance(value, bool):
        return ctypes.c_bool(value) if size in (None, 1) else ctypes.c_int32(int(value))
    if isinstance(value, int):
        if size == 8:
            return ctypes.c_int64(value) if value < 0 else ctypes.c_uint64(value)
        if size in (None, 4):
            if not -(2**31) <= value < 2**32:
                raise ModuleError(f"{where}: int {value} does not fit 32 bits (pass a Ptr for a pointer)")
            return ctypes.c_int32(value) if value < 2**31 else ctypes.c_uint32(value)
        raise ModuleError(f"{where}: the kernel declares a {size}-byte parameter; an int fits 4 or 8")
    if isinstance(value, float):
        if size in (None, 4):
            return ctypes.c_float(value)
        if size == 8:
            return ctypes.c_double(value)
        raise ModuleError(f"{where}: the kernel declares a {size}-byte parameter; a float fits 4 or 8")
    raise ModuleError(
        f"{where}: cannot pass {type(value).__name__} to a kernel (DeviceBuffer, Ptr, int, float, "
        "NumPy scalar or ctypes value)"
    )


class PackedArgs:
    """A `void*[]` pointing at ctypes copies of the arguments; `.address` goes to cuLaunchKernel."""

    def __init__(
        self,
        values: Sequence[Any],
        sizes: Sequence[int] | None = None,
        names: Sequence[str] = (),
        kernel: str = "kernel",
    ) -> None:
        if sizes is not None and len(sizes) != len(values):
            raise ModuleError(f"{kernel}: takes {len(sizes)} arguments ({', '.join(names)}), got {len(values)}")
        self._store = []
        for i, v in enumerate(values):
            label = f"{kernel} argument {i}" + (f" ({names[i]})" if i < len(names) else "")
            size = None if sizes is None else sizes[i]
            c = _ctype_for(v, size, label)
            if size is not None and ctypes.sizeof(c) != size:
                raise ModuleError(f"{label}: passed {ctypes.sizeof(c)} bytes, the kernel declares {size}")
            self._store.append(c)
        self._array = (ctypes.c_void_p * max(1, len(self._store)))(*[ctypes.addressof(c) for c in self._store])

    @property
    def address(self) -> int:
        return ctypes.addressof(self._array) if self._store else 0

    def set(self, i: int, value: int) -> None:
        """Argument `i` becomes the integer `value` (in its packed width): launches after this one pass it."""
        c = self._store[i]
        c.value = value
        if c.value != value:
            raise ModuleError(f"argument {i}: {value} does not fit its {ctypes.sizeof(c)}-byte parameter")

    def __len__(self) -> int:
        return len(self._store)


# ---- modules and kernels -------------------------------------------------------------------------------------


class Kernel:
    """A loaded entry point with its manifest defaults (grid, block, dynamic smem)."""

    def __init__(self, entry: KernelEntry, function: Any, param_sizes: tuple[int, ...] | None) -> None:
        self.entry, self.function, self.param_sizes = entry, function, param_sizes

    @property
    def name(self) -> str:
        return self.entry.name

    def bind(
        self,
        args: Sequence[Any],
        grid: tuple[int, int, int] | None = None,
        block: tuple[int, int, int] | None = None,
        smem: int | None = None,
        pdl: bool = False,
    ) -> "Launch":
        """`pdl`: launch with programmatic stream serialization (only right after another PDL-safe kernel)."""
        return Launch(
            self,
            PackedArgs(args, self.param_sizes, self.entry.args, self.entry.name),
            tuple(grid or self.entry.grid),
            tuple(block or self.entry.block),  # type: ignore[arg-type]
            self.entry.smem_bytes if smem is None else smem,
            pdl,
        )

    def launch(self, stream: Stream, args: Sequence[Any], **kw: Any) -> None:
        self.bind(args, **kw)(stream)


@dataclass
class Launch:
    """One fully specified launch; calling it enqueues it on a stream."""

    kernel: Kernel
    args: PackedArgs
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    pdl: bool = False

    def __call__(self, stream: Stream) -> None:
        g, b, cu = self.grid, self.block, driver()
        if self.pdl:  # may start under the previous kernel's tail; the kernel waits (griddepcontrol) before its reads
            check(
                cu.cuLaunchKernelEx(self._config(stream), self.kernel.function, self.args.address, 0),
                f"launch {self.kernel.name} (PDL)",
            )
            return
        check(
            cu.cuLaunchKernel(
                self.kernel.function, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream.handle, self.args.address, 0
            ),
            f"launch {self.kernel.name}",
        )

    def regrid(self, grid: tuple[int, int, int]) -> None:
        """Launch on `grid` from now on (a PDL launch's config is built again)."""
        self.grid = grid
        self._cfg = None

    def _config(self, stream: Stream) -> Any:
        cfg = getattr(self, "_cfg", None)
        if cfg is None or getattr(self, "_cfg_stream", None) is not stream:
            cu = driver()
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = cu.CUlaunchConfig()
            cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
            cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
            cfg.sharedMemBytes, cfg.hStream = self.smem, stream.handle
            cfg.attrs, cfg.numAttrs = [attr], 1
            self._cfg, self._cfg_stream = cfg, stream
        return cfg


def _param_sizes(function: Any, count: int) -> tuple[int, ...] | None:
    """Byte size of each kernel parameter as compiled (None when the driver cannot say: CUDA < 12.4)."""
    cu = driver()
    if not hasattr(cu, "cuFuncGetParamInfo"):
        return None
    sizes = []
    for i in range(count):
        ret = cu.cuFuncGetParamInfo(function, i)
        if int(ret[0]) != 0:
            return None if i == 0 else tuple(sizes)
        sizes.append(int(ret[2]))
    # One more index must fail: otherwise the kernel takes more arguments than the manifest names.
    extra = cu.cuFuncGetParamInfo(function, count)
    if int(extra[0]) == 0:
        raise ModuleError(f"kernel takes more than the {count} arguments its manifest entry names; rebuild")
    return tuple(sizes)


class KernelSet:
    """The cubins of a manifest loaded into the current context (each cubin loaded once, on first use)."""

    def __init__(self, manifest: KernelManifest, device: Device) -> None:
        manifest.check(device_arch=device.info.arch)
        self.manifest, self.device = manifest, device
        self._modules: dict[Path, Any] = {}
        self._kernels: dict[str, Kernel] = {}

    def _module(self, path: Path, kernel: str) -> Any:
        mod = self._modules.get(path)
        if mod is not None:
            return mod
        try:
            image = path.read_bytes()
        except OSError as exc:
            raise ModuleError(
                f"kernel {kernel}: cubin {path} unreadable ({exc}); rebuild with `thorgen build`"
            ) from exc
        try:
            mod = check(driver().cuModuleLoadData(image), f"load cubin {path.name}")
        except CudaError as exc:
            if exc.code == _NO_BINARY_FOR_GPU:
                raise ModuleError(
                    f"{path.name} was built for {self.manifest.arch}, which GPU {self.device.info.name} "
                    f"({self.device.info.arch}) cannot run; rebuild with `thorgen build --arch "
                    f"{self.device.info.arch}`"
                ) from exc
            raise
        self._modules[path] = mod
        return mod

    def kernel(self, name: str) -> Kernel:
        k = self._kernels.get(name)
        if k is not None:
            return k
        entry = self.manifest.kernel(name)
        cu = driver()
        fn = check(
            cu.cuModuleGetFunction(self._module(entry.cubin, name), entry.entry.encode()),
            f"find {entry.entry} in {entry.cubin.name}",
        )
        if entry.smem_bytes > _DEFAULT_SMEM_LIMIT:
            limit = self.device.info.smem_per_block_optin
            if entry.smem_bytes > limit:
                raise ModuleError(f"kernel {name} needs {entry.smem_bytes} B shared memory, GPU allows {limit} B")
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(fn, attr, entry.smem_bytes), f"set smem of {name}")
        k = Kernel(entry, fn, _param_sizes(fn, len(entry.args)))
        self._kernels[name] = k
        return k

    def load_all(self) -> None:
        """Load every kernel now (so a missing or broken cubin fails at startup, not mid-generation)."""
        for name in self.manifest.kernels:
            self.kernel(name)

    def unload(self) -> None:
        cu = driver()
        for mod in self._modules.values():
            cu.cuModuleUnload(mod)
        self._modules.clear()
        self._kernels.clear()
