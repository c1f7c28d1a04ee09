"""Test support (not a test module): one CPU stand-in for cuda.bindings.driver (runtime.cuda.device.set_driver).

Device memory is host NumPy arrays, bounds-checked against the allocation an access starts in; kernel launches
dispatch to NumPy references of each kernel's contract (tests/emulated_kernels.py) named by a build's manifest;
graph captures record launches and replay them in order; the current context is per thread, as in the driver.
Knobs make the driver fail as a machine without a GPU (or with too small or too new a GPU) does, so the runtime's
error paths run on any machine (tests/test_runtime_cpu.py), and the same driver runs the whole engine
(tests/engine_emulator.py).
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from emulated_kernels import EmuError, KernelEmulator

GiB = 2**30
IGNORE_SM_COSCHEDULING = 1  # CUdevSmResourceSplit_flags' value
INT_ARGS = {"T", "m", "tap_stride", "tap_col"}  # kernel arguments passed as 32-bit ints (the rest: 64-bit)


class CUresult(enum.IntEnum):
    """The driver results the runtime and the tests meet (values and names as in cuda-python)."""

    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_CONTEXT = 201  # a context-bound call on a thread with no context current
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901


OK = CUresult.CUDA_SUCCESS
INVALID_VALUE = CUresult.CUDA_ERROR_INVALID_VALUE
# Calls that need no current context, as in the real driver; every other cu* call fails without one.
CONTEXT_FREE = {
    "cuInit",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDeviceGetName",
    "cuDeviceTotalMem",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuDevicePrimaryCtxReset",
    "cuCtxSetCurrent",
    "cuDeviceGetDevResource",
    "cuDevSmResourceSplitByCount",
    "cuDevResourceGenerateDesc",
    "cuGreenCtxCreate",
}


class FakeDriver:
    """The subset of cuda.bindings.driver the runtime uses, executing synchronously on host memory. Knobs for the
    error paths: `init` (cuInit's result), `devices`, `free` (bytes cuMemGetInfo reports), `capability`,
    `alloc_result` (cuMemAlloc's result), `name`; `calls` logs allocations and graph captures."""

    CUresult = CUresult

    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms",
        CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="smem",
    )
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1, CU_STREAM_DEFAULT=0)
    CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="smem")
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUdevSmResourceSplit_flags = SimpleNamespace(CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING=IGNORE_SM_COSCHEDULING)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)

    class CUDA_MEMCPY2D(SimpleNamespace):
        pass

    CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)

    class CUlaunchConfig(SimpleNamespace):
        pass

    class CUlaunchAttribute(SimpleNamespace):
        def __init__(self) -> None:
            super().__init__(id=None, value=SimpleNamespace())

    def __init__(
        self,
        manifest_dir: Path | None = None,
        devices: int = 1,
        init: CUresult = OK,
        free: int = 100 * GiB,
        capability: tuple[int, int] = (9, 0),
        alloc_result: CUresult = OK,
        name: str = "Emulated H200",
    ) -> None:
        """`manifest_dir`: the build whose kernels launches run (None: no kernels, cuModuleGetFunction fails)."""
        self.devices, self.init, self.free, self.capability = devices, init, free, capability
        self.alloc_result, self.name = alloc_result, name
        self.calls: list[str] = []  # "alloc N", "begin", "end", "destroy graph", in call order
        self._ctx = threading.local()
        self.entries = (
            {} if manifest_dir is None else json.loads((Path(manifest_dir) / "manifest.json").read_text())["kernels"]
        )
        self._bases: list[int] = []
        self._arrays: dict[int, np.ndarray] = {}
        self._next = 1 << 32
        self._host: dict[int, Any] = {}
        self._capture: dict[Any, list] = {}
        self._joined: dict[Any, Any] = {}  # side stream -> the capturing stream it forked from
        self._recorded_on: dict[int, Any] = {}  # id(event) -> stream of its last record
        self.sms = 132  # multiprocessors of the device
        self.green_contexts: list[SimpleNamespace] = []  # created by cuGreenCtxCreate (sms, ctx, destroyed)
        self.launch_contexts: set[Any] = set()  # the contexts current at kernel and graph launches
        self.launches: list[str] = []  # kernel names, in execution order (tests may inspect)
        self.pdl_launches = 0  # launches made with programmatic stream serialization
        self.emu = KernelEmulator(self)

    # ---- device / context ----------------------------------------------------------------------------------
    def cuInit(self, flags):
        return (self.init,)

    def cuGetErrorString(self, err):
        name = CUresult(err).name if int(err) in set(CUresult) else f"CUresult {int(err)}"
        return OK, f"fake description of {name}".encode()

    def cuDeviceGetCount(self):
        return OK, self.devices

    def cuDeviceGet(self, i):
        return OK, i

    def cuDeviceGetAttribute(self, attr, d):
        major, minor = self.capability
        return OK, {"major": major, "minor": minor, "sms": self.sms, "smem": 232448}[attr]

    def cuDeviceGetName(self, n, d):
        return OK, self.name.encode() + b"\0\0"

    def cuDeviceTotalMem(self, d):
        return OK, 141 * GiB

    def cuDevicePrimaryCtxRetain(self, d):
        return OK, "ctx"

    def cuDevicePrimaryCtxRelease(self, d):
        return (OK,)

    def cuDevicePrimaryCtxReset(self, d):
        return (OK,)

    def cuCtxSetCurrent(self, c):
        self._ctx.current = c
        return (OK,)

    def __getattribute__(self, name: str) -> Any:
        """Model the driver's per-thread current context: a context-bound call from a thread on which no
        context was made current answers CUDA_ERROR_INVALID_CONTEXT (what `serve --backend cuda` once hit)."""
        attr = object.__getattribute__(self, name)
        if (
            name.startswith("cu")
            and name not in CONTEXT_FREE
            and callable(attr)
            and getattr(object.__getattribute__(self, "_ctx"), "current", None) is None
        ):
            return lambda *args, **kwargs: (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        return attr

    # ---- green contexts: an SM partition of the device (kernels run as before; tests read what was asked) -------
    def cuDeviceGetDevResource(self, d, kind):
        if kind != self.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM:
            return INVALID_VALUE, None
        return OK, SimpleNamespace(type=kind, sm=SimpleNamespace(smCount=self.sms))

    def cuDevSmResourceSplitByCount(self, nb_groups, whole, flags, min_count):
        """The driver's granularity on compute capability 9.0+: 8 SMs, or 2 when co-scheduling is ignored; a
        request the device cannot hold gives no group."""
        step = 2 if flags & IGNORE_SM_COSCHEDULING else 8
        count = max(step, -(-int(min_count) // step) * step)
        total = whole.sm.smCount
        if nb_groups < 1 or count > total:
            return OK, [], 0, whole
        part = SimpleNamespace(type=whole.type, sm=SimpleNamespace(smCount=count))
        return OK, [part], 1, SimpleNamespace(type=whole.type, sm=SimpleNamespace(smCount=total - count))

    def cuDevResourceGenerateDesc(self, resources, n):
        return OK, SimpleNamespace(resources=tuple(resources[:n]))

    def cuGreenCtxCreate(self, desc, d, flags):
        green = SimpleNamespace(sms=sum(r.sm.smCount for r in desc.resources), destroyed=False, ctx=None)
        green.ctx = ("green", len(self.green_contexts))
        self.green_contexts.append(green)
        return OK, green

    def cuCtxFromGreenCtx(self, green):
        return OK, green.ctx

    def cuGreenCtxDestroy(self, green):
        green.destroyed = True
        return (OK,)

    def cuCtxSynchronize(self):
        return (OK,)

    def cuMemGetInfo(self):
        return OK, self.free, 141 * GiB

    # ---- memory ---------------------------------------------------------------------------------------------
    def cuMemAlloc(self, n):
        self.calls.append(f"alloc {n}")
        if self.alloc_result != OK:
            return self.alloc_result, None
        base = self._next
        self._next += (int(n) + (1 << 20)) // (1 << 16) * (1 << 16) + (1 << 16)
        self._arrays[base] = np.full(int(n), 0xFF, np.uint8)  # NaN-ish garbage: uninitialised memory is not zero
        bisect.insort(self._bases, base)
        return OK, base

    def cuMemFree(self, p):
        self._arrays.pop(int(p), None)
        if int(p) in self._bases:
            self._bases.remove(int(p))
        return (OK,)

    def cuMemAllocHost(self, n):
        buf = (ctypes.c_ubyte * int(n))()
        self._host[ctypes.addressof(buf)] = buf
        return OK, ctypes.addressof(buf)

    def cuMemFreeHost(self, p):
        self._host.pop(int(p), None)
        return (OK,)

    def span(self, addr: int, nbytes: int, what: str = "access") -> np.ndarray:
        """The uint8 view of [addr, addr+nbytes) of one allocation; EmuError when it leaves the allocation."""
        addr = int(addr)
        if addr == 0:
            raise EmuError(f"{what}: null pointer")
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            raise EmuError(f"{what}: address {addr:#x} is not device memory")
        base = self._bases[i]
        arr = self._arrays[base]
        off = addr - base
        if off + nbytes > arr.size:
            raise EmuError(f"{what}: [{off}, {off + nbytes}) overruns an allocation of {arr.size} bytes")
        return arr[off : off + nbytes]

    def view(self, addr: int, dtype: Any, shape: tuple[int, ...] | int, what: str = "access") -> np.ndarray:
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        return self.span(addr, n, what).view(dt).reshape(shape)

    def _host_view(self, addr: int, n: int) -> np.ndarray:
        return np.ctypeslib.as_array((ctypes.c_ubyte * n).from_address(int(addr)))

    def _run(self, stream, fn) -> tuple:
        if stream in self._capture:
            self._capture[stream].append(fn)
        else:
            fn()
        return (OK,)

    def cuMemcpyHtoD(self, dst, src, n):
        self.span(dst, n, "HtoD")[:] = self._host_view(src, n)
        return (OK,)

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        if stream in self._capture:
            raise EmuError("host copy inside a graph capture")
        return self.cuMemcpyHtoD(dst, src, n)

    def cuMemcpyDtoH(self, dst, src, n):
        self._host_view(dst, n)[:] = self.span(src, n, "DtoH")
        return (OK,)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self.cuMemcpyDtoH(dst, src, n)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        return self._run(stream, lambda: self.span(dst, n, "DtoD").__setitem__(slice(None), self.span(src, n)))

    def cuMemcpy2DAsync(self, p, stream):
        p = SimpleNamespace(**vars(p))  # parameters are taken at call (capture) time

        def go():
            for r in range(p.Height):
                self.span(p.dstDevice + r * p.dstPitch, p.WidthInBytes, "2D copy dst")[:] = self.span(
                    p.srcDevice + r * p.srcPitch, p.WidthInBytes, "2D copy src"
                )

        return self._run(stream, go)

    def cuMemsetD8(self, p, v, n):
        self.span(p, n, "memset")[:] = v
        return (OK,)

    def cuMemsetD8Async(self, p, v, n, stream):
        return self._run(stream, lambda: self.cuMemsetD8(p, v, n))

    # ---- streams, events, graphs ------------------------------------------------------------------------------
    def cuStreamCreate(self, flags):
        return OK, object()

    def cuCtxGetStreamPriorityRange(self):
        return OK, 0, -5  # (least, greatest), as on Hopper

    def cuStreamCreateWithPriority(self, flags, priority):
        return OK, object()

    def cuEventQuery(self, e):
        return (OK,)  # launches run when issued here: every recorded event is complete

    def cuStreamDestroy(self, s):
        return (OK,)

    def cuStreamSynchronize(self, s):
        return (OK,)

    def cuEventCreate(self, flags):
        return OK, object()

    def cuEventDestroy(self, e):
        return (OK,)

    def cuEventRecord(self, e, s):
        self._recorded_on[id(e)] = s
        return (OK,)

    def cuStreamWaitEvent(self, s, e, flags):
        """Launches run in issue order here; a stream that waits on an event recorded on a capturing stream joins
        that capture (as in CUDA: the fork of a side stream inside a graph capture)."""
        src = self._recorded_on.get(id(e))
        if src in self._capture and s not in self._capture:
            self._capture[s] = self._capture[src]
            self._joined[s] = src
        return (OK,)

    def cuEventSynchronize(self, e):
        return (OK,)

    def cuEventElapsedTime(self, a, b):
        return OK, 0.0

    def cuStreamBeginCapture(self, s, mode):
        self.calls.append("begin")
        self._capture[s] = []
        return (OK,)

    def cuStreamEndCapture(self, s):
        self.calls.append("end")
        for side in [k for k, origin in self._joined.items() if origin is s]:
            del self._capture[side], self._joined[side]
        return OK, self._capture.pop(s)

    def cuGraphInstantiate(self, g, flags):
        return OK, list(g)

    def cuGraphUpload(self, g, s):
        return (OK,)

    def cuGraphDestroy(self, g):
        self.calls.append("destroy graph")
        return (OK,)

    def cuGraphExecDestroy(self, g):
        return (OK,)

    def cuGraphLaunch(self, g, s):
        self.launch_contexts.add(self._ctx.current)
        for fn in g:
            fn()
        return (OK,)

    # ---- modules and launches ---------------------------------------------------------------------------------
    def cuModuleLoadData(self, image):
        return OK, "module"

    def cuModuleUnload(self, m):
        return (OK,)

    def cuFuncSetAttribute(self, fn, attr, v):
        return (OK,)

    def cuModuleGetFunction(self, mod, name):
        name = name.decode() if isinstance(name, bytes) else name
        if name not in self.entries:
            return (INVALID_VALUE, None)
        return OK, name

    def cuFuncGetParamInfo(self, fn, i):
        args = self.entries[fn]["args"]
        if i >= len(args):
            return INVALID_VALUE, 0, 0
        return OK, 8 * i, 4 if args[i] in INT_ARGS else 8

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        """A PDL launch: executes like any other here (the emulator runs launches in order)."""
        ids = [a.id for a in cfg.attrs[: cfg.numAttrs]]
        if ids != [self.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]:
            raise EmuError(f"unexpected launch attributes {ids}")
        self.pdl_launches += 1
        return self.cuLaunchKernel(
            fn,
            cfg.gridDimX,
            cfg.gridDimY,
            cfg.gridDimZ,
            cfg.blockDimX,
            cfg.blockDimY,
            cfg.blockDimZ,
            cfg.sharedMemBytes,
            cfg.hStream,
            params,
            extra,
        )

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launch_contexts.add(self._ctx.current)
        names = self.entries[fn]["args"]
        slots = (ctypes.c_void_p * len(names)).from_address(params)
        vals = {}
        for i, n in enumerate(names):  # read now: a captured launch keeps the values it was captured with
            ct = ctypes.c_int32 if n in INT_ARGS else ctypes.c_uint64
            vals[n] = int(ct.from_address(slots[i]).value)
        grid = (gx, gy, gz)

        def go():
            self.launches.append(fn)
            self.emu.run(fn, self.entries[fn], vals, grid)

        return self._run(stream, go)


def install(manifest_dir: Path | None = None, **knobs: Any) -> FakeDriver:
    """Make the runtime use a fresh FakeDriver (undo with runtime.cuda.device.set_driver(None))."""
    from thorgen.runtime.cuda import device as dev

    drv = FakeDriver(manifest_dir, **knobs)
    dev.set_driver(drv)
    return drv
