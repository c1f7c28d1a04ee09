"""Test support (not a test module): run the real CUDA engine on a CPU — a fake cuda.bindings.driver whose device
memory is host NumPy arrays and whose kernel launches dispatch to NumPy references of each kernel's contract
(tests/emulated_kernels.py).

Everything above the driver is the production code (open_backend, Engine, Forward, KernelSet argument packing,
graph capture/replay, pinned staging, strided copies), so a wiring bug (wrong pointer, row offset, stride, launch
order, position or slot arithmetic, stale graph argument) shows up as a divergence from the reference backend,
while the kernels themselves are replaced by float64 references that round where the kernel stores (through
float32, as the kernels convert their float32 registers: `RK.store`). Accesses are bounds-checked against the
allocation they start in. The reference backend's numerics="w4a16" mode rounds at the same points, so the two
agree token for token (tests/test_reference_w4a16.py).
"""

from __future__ import annotations

import bisect
import ctypes
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from thorgen.model_spec.nvfp4 import bf16_to_f32, f32_to_bf16

from emulated_kernels import EmuError, KernelEmulator
INT_ARGS = {"T", "m", "tap_stride", "tap_col"}


class _Result(int):
    """A CUresult: int 0 for success, with a .name like cuda-python's enum members."""

    @property
    def name(self) -> str:
        return "CUDA_SUCCESS" if self == 0 else f"CUDA_ERROR_{int(self)}"


OK = _Result(0)
INVALID = _Result(1)
INVALID_CONTEXT = _Result(201)  # CUDA_ERROR_INVALID_CONTEXT: a context-bound call on a thread with none current
# Calls that need no current context, as in the real driver; every other cu* call fails without one.
CONTEXT_FREE = {"cuInit", "cuGetErrorString", "cuDeviceGetCount", "cuDeviceGet", "cuDeviceGetAttribute",
                "cuDeviceGetName", "cuDeviceTotalMem", "cuDevicePrimaryCtxRetain", "cuDevicePrimaryCtxRelease",
                "cuCtxSetCurrent"}


class FakeDriver:
    """The subset of cuda.bindings.driver the runtime uses, executing synchronously on host memory."""

    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major",
                                         CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
                                         CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT="sms",
                                         CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="smem")
    CUstreamCaptureMode = SimpleNamespace(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1, CU_STREAM_DEFAULT=0)
    CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
    CUfunction_attribute = SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES="smem")
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)

    class CUDA_MEMCPY2D(SimpleNamespace):
        pass

    CUlaunchAttributeID = SimpleNamespace(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION=6)

    class CUlaunchConfig(SimpleNamespace):
        pass

    class CUlaunchAttribute(SimpleNamespace):
        def __init__(self) -> None:
            super().__init__(id=None, value=SimpleNamespace())

    def __init__(self, manifest_dir: Path) -> None:
        self._ctx = threading.local()
        man = json.loads((Path(manifest_dir) / "manifest.json").read_text())
        self.entries = man["kernels"]
        self._bases: list[int] = []
        self._arrays: dict[int, np.ndarray] = {}
        self._next = 1 << 32
        self._host: dict[int, Any] = {}
        self._capture: dict[Any, list] = {}
        self._joined: dict[Any, Any] = {}  # side stream -> the capturing stream it forked from
        self._recorded_on: dict[int, Any] = {}  # id(event) -> stream of its last record
        self.launches: list[str] = []  # kernel names, in execution order (tests may inspect)
        self.pdl_launches = 0  # launches made with programmatic stream serialization
        self.emu = KernelEmulator(self)

    # ---- device / context ----------------------------------------------------------------------------------
    def cuInit(self, flags): return (OK,)
    def cuGetErrorString(self, err): return OK, b"emulated error"
    def cuDeviceGetCount(self): return OK, 1
    def cuDeviceGet(self, i): return OK, i
    def cuDeviceGetAttribute(self, attr, d): return OK, {"major": 9, "minor": 0, "sms": 132, "smem": 232448}[attr]
    def cuDeviceGetName(self, n, d): return OK, b"Emulated H200\0"
    def cuDeviceTotalMem(self, d): return OK, 141 << 30
    def cuDevicePrimaryCtxRetain(self, d): return OK, "ctx"
    def cuDevicePrimaryCtxRelease(self, d): return (OK,)
    def cuCtxSetCurrent(self, c):
        self._ctx.current = c
        return (OK,)

    def __getattribute__(self, name: str) -> Any:
        """Model the driver's per-thread current context: a context-bound call from a thread on which no
        context was made current answers CUDA_ERROR_INVALID_CONTEXT (what `serve --backend cuda` once hit)."""
        attr = object.__getattribute__(self, name)
        if name.startswith("cu") and name not in CONTEXT_FREE and callable(attr) \
                and getattr(object.__getattribute__(self, "_ctx"), "current", None) is None:
            return lambda *args, **kwargs: (INVALID_CONTEXT,)
        return attr
    def cuCtxSynchronize(self): return (OK,)
    def cuMemGetInfo(self): return OK, 100 << 30, 141 << 30

    # ---- memory ---------------------------------------------------------------------------------------------
    def cuMemAlloc(self, n):
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
        return arr[off:off + nbytes]

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
                self.span(p.dstDevice + r * p.dstPitch, p.WidthInBytes, "2D copy dst")[:] = \
                    self.span(p.srcDevice + r * p.srcPitch, p.WidthInBytes, "2D copy src")
        return self._run(stream, go)

    def cuMemsetD8(self, p, v, n):
        self.span(p, n, "memset")[:] = v
        return (OK,)

    def cuMemsetD8Async(self, p, v, n, stream):
        return self._run(stream, lambda: self.cuMemsetD8(p, v, n))

    # ---- streams, events, graphs ------------------------------------------------------------------------------
    def cuStreamCreate(self, flags): return OK, object()
    def cuStreamDestroy(self, s): return (OK,)
    def cuStreamSynchronize(self, s): return (OK,)
    def cuEventCreate(self, flags): return OK, object()
    def cuEventDestroy(self, e): return (OK,)
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
    def cuEventSynchronize(self, e): return (OK,)
    def cuEventElapsedTime(self, a, b): return OK, 0.0

    def cuStreamBeginCapture(self, s, mode):
        self._capture[s] = []
        return (OK,)

    def cuStreamEndCapture(self, s):
        for side in [k for k, origin in self._joined.items() if origin is s]:
            del self._capture[side], self._joined[side]
        return OK, self._capture.pop(s)

    def cuGraphInstantiate(self, g, flags): return OK, list(g)
    def cuGraphUpload(self, g, s): return (OK,)
    def cuGraphDestroy(self, g): return (OK,)
    def cuGraphExecDestroy(self, g): return (OK,)

    def cuGraphLaunch(self, g, s):
        for fn in g:
            fn()
        return (OK,)

    # ---- modules and launches ---------------------------------------------------------------------------------
    def cuModuleLoadData(self, image): return OK, "module"
    def cuModuleUnload(self, m): return (OK,)
    def cuFuncSetAttribute(self, fn, attr, v): return (OK,)

    def cuModuleGetFunction(self, mod, name):
        name = name.decode() if isinstance(name, bytes) else name
        if name not in self.entries:
            return (INVALID, None)
        return OK, name

    def cuFuncGetParamInfo(self, fn, i):
        args = self.entries[fn]["args"]
        if i >= len(args):
            return INVALID, 0, 0
        return OK, 8 * i, 4 if args[i] in INT_ARGS else 8

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        """A PDL launch: executes like any other here (the emulator runs launches in order)."""
        ids = [a.id for a in cfg.attrs[:cfg.numAttrs]]
        if ids != [self.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]:
            raise EmuError(f"unexpected launch attributes {ids}")
        self.pdl_launches += 1
        return self.cuLaunchKernel(fn, cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY,
                                   cfg.blockDimZ, cfg.sharedMemBytes, cfg.hStream, params, extra)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
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


def write_fake_manifest(spec, out_dir: Path, arch_name: str = "sm_90a") -> Path:
    """manifest.json of codegen's real plan (nothing compiled) plus empty cubin files beside it."""
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.manifest import build_manifest, write_manifest
    from thorgen.codegen.plan import plan
    from thorgen.codegen.render import render

    arch = get_arch(arch_name)
    kernels = plan(spec, arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    for k in kernels:
        (out_dir / f"{k.name}.cubin").write_bytes(b"")
    sources = {k.name: render(k, arch, spec.spec_hash) for k in kernels}  # (for each arg's access)
    write_manifest(out_dir, build_manifest(spec, arch, kernels, {}, "emulated", [], sources))
    return out_dir


def install(manifest_dir: Path) -> FakeDriver:
    """Make the runtime use a fresh FakeDriver (undo with runtime.cuda.device.set_driver(None))."""
    from thorgen.runtime.cuda import device as dev

    drv = FakeDriver(manifest_dir)
    dev.set_driver(drv)
    return drv


__all__ = ["EmuError", "FakeDriver", "install", "write_fake_manifest", "bf16_to_f32", "f32_to_bf16"]


def open_emulated(checkpoint: Path, root: Path, **kwargs):
    """The cuda backend (runtime.cuda.backend.open_backend) of `checkpoint` on a freshly installed fake driver:
    weights repacked and a fake manifest written under `root`."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.convert.repack import repack

    weights = repack(checkpoint, root / "weights")
    kernels = write_fake_manifest(Checkpoint.open(checkpoint).spec, root / "kernels")
    install(kernels)
    return open_backend(checkpoint, weights_dir=weights, kernels_dir=kernels, **kwargs)


def decode_step(engine, position: int, greedy: bool = True, token: int | None = None, lane: int = 0) -> int:
    """One graphed one-row step of the engine, launched and then waited for: its new token."""
    return engine.steps.wait(engine.steps.launch_one(position, greedy, token, lane))[0]


def batch_step(engine, rows: list) -> list[int]:
    """One batched step of rows (lane, position, token, sampling or None), launched and then waited for."""
    return engine.steps.wait(engine.steps.launch_batch(rows))


def spec_step(engine, start: int, last: int, greedy: bool = True, lane: int = 0) -> tuple[list[int], list[int]]:
    """One DFlash step, launched and then waited for: (15 drafts, the target's 16 tokens)."""
    drafts, target, _ = engine.dflash.wait(engine.dflash.launch(start, last, greedy, lane=lane))
    return drafts, target


def run_requests(backend, ahead: bool, requests: list, speculative: bool = False, stop_ids=frozenset()):
    """Requests (prompt, max_tokens, params) one after another through the engine core on one cuda runner, its steps
    launched ahead or not (`ahead`): (tokens, accepted lengths, finish reason) of each, and the steps launched ahead
    that were used."""
    from thorgen.runtime.engine.core import EngineCore

    from thorgen.runtime.cuda.runner import CudaRunner

    runner = CudaRunner(backend.engine, launch_ahead=ahead)
    core, out = EngineCore(runner), []
    for n, (prompt, max_tokens, params) in enumerate(requests):
        core.add(str(n), prompt, max_tokens, params, stop_ids, speculative)
        toks: list[int] = []
        while core.unfinished:
            for o in core.step():
                toks += o.token_ids
                if o.finished:
                    out.append((toks, o.result.accepted_lengths, o.result.finish_reason))
    return out, runner.ahead_steps
