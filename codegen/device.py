"""Codegen stage (test/bench support): a minimal cuda.bindings.driver harness — load cubins, allocate, copy,
launch a KernelSpec, and time launches with events. No torch; used by tests/gpu_harness.py and bench_kernels."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kernel_spec import KernelSpec

SCALAR_TYPES = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32,
                "f64": np.float64}


class DeviceError(RuntimeError):
    pass


def unavailable_reason() -> str | None:
    """None when a CUDA GPU is usable through cuda.bindings, else why not."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        return f"cuda-python not installed ({exc})"
    try:
        (err,) = cu.cuInit(0)
    except Exception as exc:  # the driver library is missing
        return f"no NVIDIA driver ({exc})"
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuInit failed: {err.name}"
    err, n = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or n == 0:
        return "no CUDA device"
    return None


def _check(result):
    from cuda.bindings import driver as cu

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise DeviceError(f"{err.name}: {msg.decode() if isinstance(msg, bytes) else msg}")
    return rest[0] if len(rest) == 1 else (tuple(rest) if rest else None)


@dataclass
class Buffer:
    ptr: int
    nbytes: int


class Gpu:
    """One device's primary context on the calling thread."""

    def __init__(self, ordinal: int = 0):
        from cuda.bindings import driver as cu

        self.cu = cu
        reason = unavailable_reason()
        if reason:
            raise DeviceError(reason)
        self.dev = _check(cu.cuDeviceGet(ordinal))
        self.ctx = _check(cu.cuDevicePrimaryCtxRetain(self.dev))
        _check(cu.cuCtxSetCurrent(self.ctx))
        self.stream = _check(cu.cuStreamCreate(0))
        self._modules: dict[str, object] = {}
        self._functions: dict[str, object] = {}
        self._buffers: list[Buffer] = []

    @property
    def name(self) -> str:
        raw = _check(self.cu.cuDeviceGetName(256, self.dev))
        return raw.split(b"\0")[0].decode()

    @property
    def capability(self) -> tuple[int, int]:
        a = self.cu.CUdevice_attribute
        return (_check(self.cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.dev)),
                _check(self.cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.dev)))

    # ---- modules -----------------------------------------------------------------------------------------------
    def function(self, kernel: KernelSpec, cubin: bytes | Path):
        """The CUfunction of `kernel` (its name is the entry symbol), loading the cubin once."""
        if kernel.name in self._functions:
            return self._functions[kernel.name]
        data = Path(cubin).read_bytes() if isinstance(cubin, (str, Path)) else cubin
        mod = _check(self.cu.cuModuleLoadData(np.frombuffer(data, dtype=np.uint8).ctypes.data))
        self._modules[kernel.name] = mod
        fn = _check(self.cu.cuModuleGetFunction(mod, kernel.name.encode()))
        if kernel.smem_bytes > 48 * 1024:  # dynamic shared memory above 48 KB needs an explicit opt-in
            attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(self.cu.cuFuncSetAttribute(fn, attr, kernel.smem_bytes))
        self._functions[kernel.name] = fn
        return fn

    # ---- memory ------------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int, zero: bool = True) -> Buffer:
        ptr = int(_check(self.cu.cuMemAlloc(max(1, nbytes))))
        buf = Buffer(ptr, nbytes)
        self._buffers.append(buf)
        if zero and nbytes:
            _check(self.cu.cuMemsetD8Async(ptr, 0, nbytes, self.stream))
        return buf

    def upload(self, arr: np.ndarray) -> Buffer:
        arr = np.ascontiguousarray(arr)
        buf = self.alloc(arr.nbytes, zero=False)
        if arr.nbytes:
            _check(self.cu.cuMemcpyHtoDAsync(buf.ptr, arr.ctypes.data, arr.nbytes, self.stream))
            self.sync()
        return buf

    def download(self, buf: Buffer, shape: tuple[int, ...], dtype) -> np.ndarray:
        out = np.empty(shape, dtype=dtype)
        if out.nbytes > buf.nbytes:
            raise DeviceError(f"download of {out.nbytes} B from a {buf.nbytes} B buffer")
        self.sync()
        if out.nbytes:
            _check(self.cu.cuMemcpyDtoH(out.ctypes.data, buf.ptr, out.nbytes))
        return out

    def free_all(self) -> None:
        self.sync()
        for b in self._buffers:
            self.cu.cuMemFree(b.ptr)
        self._buffers.clear()

    def sync(self) -> None:
        _check(self.cu.cuStreamSynchronize(self.stream))

    # ---- launches ----------------------------------------------------------------------------------------------
    @staticmethod
    def pack_args(args: list) -> tuple[np.ndarray, list[np.ndarray]]:
        """Kernel parameter array: Buffers / None become pointers; numpy scalars keep their type."""
        holders = []
        for a in args:
            if isinstance(a, Buffer):
                holders.append(np.array([a.ptr], dtype=np.uint64))
            elif a is None:
                holders.append(np.array([0], dtype=np.uint64))
            elif isinstance(a, np.generic):
                holders.append(np.array([a], dtype=a.dtype))
            elif isinstance(a, (bool, int)):
                holders.append(np.array([a], dtype=np.int32))
            elif isinstance(a, float):
                holders.append(np.array([a], dtype=np.float32))
            else:
                raise DeviceError(f"unsupported kernel argument {a!r}")
        ptrs = np.array([h.ctypes.data for h in holders], dtype=np.uint64)
        return ptrs, holders

    def launch(self, fn, kernel: KernelSpec, args: list, grid: tuple[int, int, int] | None = None) -> None:
        if kernel.args and len(args) != len(kernel.args):
            raise DeviceError(f"{kernel.name} takes {len(kernel.args)} args {kernel.args}, got {len(args)}")
        g = grid or kernel.grid
        ptrs, _holders = self.pack_args(args)
        _check(self.cu.cuLaunchKernel(fn, *g, *kernel.block, kernel.smem_bytes, self.stream, ptrs.ctypes.data, 0))

    def time_ms(self, launch, iters: int = 20, warmup: int = 3, before=None) -> float:
        """Median milliseconds of `launch()` over `iters` event-timed runs (`before()` runs untimed each time)."""
        start = _check(self.cu.cuEventCreate(0))
        end = _check(self.cu.cuEventCreate(0))
        for _ in range(warmup):
            launch()
        self.sync()
        times = []
        for _ in range(iters):
            if before is not None:
                before()
            _check(self.cu.cuEventRecord(start, self.stream))
            launch()
            _check(self.cu.cuEventRecord(end, self.stream))
            _check(self.cu.cuEventSynchronize(end))
            times.append(_check(self.cu.cuEventElapsedTime(start, end)))
        self.cu.cuEventDestroy(start)
        self.cu.cuEventDestroy(end)
        return statistics.median(times)

    def graph_time_ms(self, launch, reps: int = 10, iters: int = 5) -> float:
        """Milliseconds per launch of `reps` back-to-back launches captured in a CUDA graph (no host overhead)."""
        cu = self.cu
        _check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        try:
            for _ in range(reps):
                launch()
        finally:
            graph = _check(cu.cuStreamEndCapture(self.stream))
        exe = _check(cu.cuGraphInstantiate(graph, 0))
        try:
            return self.time_ms(lambda: _check(cu.cuGraphLaunch(exe, self.stream)), iters) / reps
        finally:
            cu.cuGraphExecDestroy(exe)
            cu.cuGraphDestroy(graph)

    def copy_bandwidth_gbps(self, nbytes: int = 1 << 30, iters: int = 10) -> float:
        """Device-to-device copy bandwidth, counting bytes read + written (the usual 'copy bandwidth')."""
        src, dst = self.alloc(nbytes), self.alloc(nbytes)
        ms = self.time_ms(lambda: _check(self.cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, self.stream)), iters)
        return 2 * nbytes / (ms * 1e-3) / 1e9
