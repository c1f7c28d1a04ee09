"""Runtime stage: GPU memory — checked allocations, host<->device copies, and a planned arena for static buffers.

Every allocation goes through `alloc()`, which compares the request with the driver's free memory first so an
oversized model or context fails with "not enough GPU memory: needed X GiB, free Y GiB" instead of a bare
CUDA_ERROR_OUT_OF_MEMORY. Activations and the KV cache are planned as named regions (`ArenaPlan`, pure
Python, testable on a CPU) and allocated in one block, so the decode step's pointers never change and a
captured CUDA graph stays valid.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..backend import BackendError
from ..convert.artifact import ALIGN, ArtifactError, WeightsArtifact, np_dtype  # noqa: F401  (ALIGN: the engine's too)
from .device import CudaError, Device, Stream, check, driver, gib

_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class OutOfGpuMemory(BackendError):
    """Raised with the needed and free byte counts in the message."""


def out_of_memory(needed: int, free: int, what: str) -> OutOfGpuMemory:
    return OutOfGpuMemory(
        f"not enough GPU memory for {what}: needed {gib(needed)} GiB, free {gib(free)} GiB "
        "(lower --ctx, use --kv-dtype fp8, or free the GPU)"
    )


def check_fits(needed: int, free: int, what: str) -> None:
    """OutOfGpuMemory when `needed` bytes exceed `free` (pure arithmetic, so the planner can call it early)."""
    if needed > free:
        raise out_of_memory(needed, free, what)


class DeviceBuffer:
    """`nbytes` of device memory at `ptr` (an int). Owning buffers free on `free()`; views never free."""

    def __init__(self, ptr: int, nbytes: int, name: str = "", owner: "DeviceBuffer | None" = None) -> None:
        self.ptr, self.nbytes, self.name, self._owner = int(ptr), int(nbytes), name, owner
        self._freed = False

    def view(self, offset: int, nbytes: int, name: str = "") -> "DeviceBuffer":
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"view [{offset}, {offset + nbytes}) outside buffer {self.name!r} of {self.nbytes} bytes")
        return DeviceBuffer(self.ptr + offset, nbytes, name or f"{self.name}+{offset}", owner=self)

    def _bounds(self, offset: int, nbytes: int) -> None:
        if self._freed:
            raise BackendError(f"device buffer {self.name!r} used after free")
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"copy of {nbytes} bytes at {offset} overruns buffer {self.name!r} ({self.nbytes} bytes)")

    def upload(self, host: np.ndarray | bytes | memoryview, offset: int = 0, stream: Stream | None = None) -> None:
        """Copy host bytes to [offset, offset+len). Async on `stream` when given (the host memory must stay alive
        and, for real asynchrony, be pinned)."""
        arr = np.ascontiguousarray(
            np.frombuffer(host, dtype=np.uint8) if isinstance(host, (bytes, memoryview)) else host
        )
        self._bounds(offset, arr.nbytes)
        if arr.nbytes == 0:
            return
        cu = driver()
        src = arr.ctypes.data
        if stream is None:
            check(cu.cuMemcpyHtoD(self.ptr + offset, src, arr.nbytes), f"upload to {self.name!r}")
        else:
            check(cu.cuMemcpyHtoDAsync(self.ptr + offset, src, arr.nbytes, stream.handle), f"upload to {self.name!r}")

    def download_async(self, host: np.ndarray, stream: Stream, offset: int = 0) -> None:
        """Copy [offset, offset + host.nbytes) into `host` (contiguous, pinned for real asynchrony), ordered on
        `stream`: the bytes are there once the stream's work up to here has completed."""
        self._bounds(offset, host.nbytes)
        if host.nbytes:
            check(
                driver().cuMemcpyDtoHAsync(host.ctypes.data, self.ptr + offset, host.nbytes, stream.handle),
                f"download of {self.name!r}",
            )

    def download(self, dtype: Any = np.uint8, shape: tuple[int, ...] | None = None, offset: int = 0) -> np.ndarray:
        """A host copy of the buffer (synchronous), viewed as `dtype` with `shape` (default: all of it)."""
        dt = np.dtype(dtype)
        count = (self.nbytes - offset) // dt.itemsize if shape is None else int(np.prod(shape))
        out = np.empty(count, dtype=dt)
        self._bounds(offset, out.nbytes)
        if out.nbytes:
            check(driver().cuMemcpyDtoH(out.ctypes.data, self.ptr + offset, out.nbytes), f"download of {self.name!r}")
        return out if shape is None else out.reshape(shape)

    def zero(self, stream: Stream | None = None) -> None:
        cu = driver()
        if stream is None:
            check(cu.cuMemsetD8(self.ptr, 0, self.nbytes), f"memset {self.name!r}")
        else:
            check(cu.cuMemsetD8Async(self.ptr, 0, self.nbytes, stream.handle), f"memset {self.name!r}")

    def free(self) -> None:
        if self._owner is None and not self._freed and self.nbytes:
            check(driver().cuMemFree(self.ptr), f"cuMemFree {self.name!r}")
        self._freed = True


def alloc(device: Device, nbytes: int, what: str) -> DeviceBuffer:
    """A new device buffer; OutOfGpuMemory naming `what`, the bytes needed and free when it cannot fit."""
    if nbytes <= 0:
        return DeviceBuffer(0, 0, what)
    free, _ = device.mem_info()
    check_fits(nbytes, free, what)
    try:
        ptr = check(driver().cuMemAlloc(nbytes), f"cuMemAlloc for {what}")
    except CudaError as exc:
        if exc.code == _OOM:  # fragmentation or a concurrent user: report it the same way
            raise out_of_memory(nbytes, device.mem_info()[0], what) from exc
        raise
    return DeviceBuffer(int(ptr), nbytes, what)


class PinnedBuffer:
    """Page-locked host memory (fast, truly asynchronous H2D/D2H copies) exposed as a uint8 NumPy array."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.ptr = int(check(driver().cuMemAllocHost(nbytes), f"cuMemAllocHost ({gib(nbytes)} GiB pinned)"))
        self.array = np.frombuffer((ctypes.c_ubyte * nbytes).from_address(self.ptr), dtype=np.uint8)

    def free(self) -> None:
        if self.ptr:
            self.array = np.empty(0, dtype=np.uint8)
            check(driver().cuMemFreeHost(self.ptr), "cuMemFreeHost")
            self.ptr = 0


# ---- planned arenas ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    nbytes: int
    dtype: str = "u8"
    shape: tuple[int, ...] = ()


@dataclass
class ArenaPlan:
    """Named, 256-byte aligned regions laid out back to back; `total` is what one allocation must hold."""

    name: str
    regions: dict[str, Region] = field(default_factory=dict)
    total: int = 0

    def add(self, name: str, nbytes: int, dtype: str = "u8", shape: tuple[int, ...] = ()) -> Region:
        if name in self.regions:
            raise ValueError(f"{self.name}: region {name!r} planned twice")
        if nbytes < 0:
            raise ValueError(f"{self.name}: region {name!r} has negative size {nbytes}")
        offset = align_up(self.total)
        region = Region(name, offset, int(nbytes), dtype, tuple(shape))
        self.regions[name] = region
        self.total = offset + align_up(int(nbytes))
        return region

    def add_array(self, name: str, shape: tuple[int, ...], dtype: str) -> Region:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np_dtype(dtype).itemsize
        return self.add(name, nbytes, dtype, shape)


class Arena:
    """One device allocation carved into a plan's regions: `arena["x"]` is a DeviceBuffer view of region x."""

    def __init__(self, device: Device, plan: ArenaPlan) -> None:
        self.plan = plan
        self.buffer = alloc(device, plan.total, plan.name)
        self._views = {
            r.name: self.buffer.view(r.offset, r.nbytes, r.name) if r.nbytes else DeviceBuffer(0, 0, r.name)
            for r in plan.regions.values()
        }

    def __getitem__(self, name: str) -> DeviceBuffer:
        try:
            return self._views[name]
        except KeyError:
            raise KeyError(f"arena {self.plan.name!r} has no region {name!r}") from None

    def free(self) -> None:
        self.buffer.free()


def upload_artifact(
    artifact: WeightsArtifact, device: Any, chunk_bytes: int = 64 << 20, progress: Callable[[int], None] | None = None
) -> Any:
    """Copy the whole weights.bin into one device allocation (offsets preserved) and return that DeviceBuffer.

    File reads land directly in two pinned staging buffers and are copied asynchronously, so the disk (or page
    cache) read of one chunk overlaps the PCIe copy of the previous one.
    """
    total = artifact.total_bytes
    dst = alloc(device, total, f"model weights ({artifact.folder.name})")
    stream = device.stream()
    bufs = [PinnedBuffer(min(chunk_bytes, max(total, 1))) for _ in range(2)]
    events = [device.event(timing=False), device.event(timing=False)]
    used = [False, False]
    try:
        with open(artifact.bin_path, "rb", buffering=0) as f:
            done, i = 0, 0
            while done < total:
                k = i % 2
                if used[k]:
                    events[k].synchronize()  # the copy out of this staging buffer has finished
                n = min(bufs[k].nbytes, total - done)
                view = memoryview(bufs[k].array)[:n]
                got = 0
                while got < n:
                    r = f.readinto(view[got:])
                    if not r:
                        raise ArtifactError(f"{artifact.bin_path}: ended at byte {done + got} of {total} during upload")
                    got += r
                dst.view(done, n).upload(bufs[k].array[:n], stream=stream)
                events[k].record(stream)
                used[k] = True
                done += n
                i += 1
                if progress is not None:
                    progress(n)
        stream.synchronize()
    except BaseException:
        stream.synchronize()
        dst.free()
        raise
    finally:
        for b in bufs:
            b.free()
        for e in events:
            e.destroy()
        stream.destroy()
    return dst
