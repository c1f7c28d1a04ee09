"""Runtime stage: CUDA driver access through cuda.bindings — errors, device/context setup, streams and events.

cuda-python is imported lazily (first `driver()` call), so every runtime module imports on a machine without a
GPU, a driver or cuda-python; what cannot work there fails with a BackendError that points to
`--backend reference`. Tests swap the driver module with `set_driver()` to exercise the error paths on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..backend import BackendError, EngineStateLost

NO_GPU_HINT = "run with `--backend reference` (the NumPy backend, CPU only) instead"

_driver: Any = None


def set_driver(module: Any) -> None:
    """Use `module` as the driver API (tests pass a fake; None: import cuda.bindings.driver on next use)."""
    global _driver
    _driver = module


def driver() -> Any:
    """The `cuda.bindings.driver` module; BackendError (suggesting the reference backend) when it is missing."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as cu
        except ImportError as exc:
            raise BackendError(
                f"the cuda backend needs cuda-python >= 12.6 (pip install 'thorgen[cuda]'): {exc}; or {NO_GPU_HINT}"
            ) from exc
        _driver = cu
    return _driver


class CudaError(EngineStateLost):
    """A CUDA driver call failed; `.code` is the CUresult value and `.name` its enum name. The device's state is
    then unknown (many errors are sticky to the context), so the engine fails its requests and is rebuilt."""

    def __init__(self, what: str, code: int, name: str, detail: str = "") -> None:
        self.what, self.code, self.name = what, int(code), name
        super().__init__(f"{what} failed: {name} ({int(code)}){': ' + detail if detail else ''}")


def error_name(err: Any) -> tuple[str, str]:
    """(enum name, driver description) of a CUresult; works even when the driver library cannot describe it."""
    name = getattr(err, "name", None) or f"CUresult {int(err)}"
    detail = ""
    try:
        res, text = driver().cuGetErrorString(err)
        if int(res) == 0 and text:
            detail = text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # describing an error must never hide the error itself
        pass
    return name, detail


CUDA_ERROR_NOT_READY = 600  # cuEventQuery / cuStreamQuery: the work is still running


def check(ret: Any, what: str = "CUDA call") -> Any:
    """Unwrap a cuda-python return `(CUresult, *values)`: raise CudaError on failure, else the value(s).

    Returns None for no value, the value itself for one, a tuple for several.
    """
    if isinstance(ret, tuple):
        err, vals = ret[0], ret[1:]
    else:
        err, vals = ret, ()
    if int(err) != 0:
        name, detail = error_name(err)
        raise CudaError(what, int(err), name, detail)
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


def _result(ret: Any) -> Any:
    """The CUresult of a cuda-python return (a tuple whose first item it is, or the result alone)."""
    return ret[0] if isinstance(ret, tuple) else ret


def gib(nbytes: int | float) -> str:
    return f"{nbytes / 2**30:.2f}"


@dataclass(frozen=True)
class DeviceInfo:
    ordinal: int
    name: str
    capability: tuple[int, int]
    sm_count: int
    total_mem: int
    smem_per_block_optin: int

    @property
    def arch(self) -> str:
        """The arch-specific target thorgen compiles for on this device, e.g. sm_90a for an H100/H200."""
        return f"sm_{self.capability[0]}{self.capability[1]}a"


class Device:
    """One GPU with its primary context made current on this thread. Use `Device.open()`."""

    def __init__(self, info: DeviceInfo, handle: Any, ctx: Any, green: Any = None, sms: int | None = None) -> None:
        self.info, self._handle, self._ctx = info, handle, ctx
        self._green = green  # the green context the work runs in (None: the whole GPU)
        self.sms = info.sm_count if sms is None else sms  # multiprocessors the kernels may run on
        self._closed = False
        self._peak_used = 0
        self.last_used = 0  # what `used()` saw last (health reports read it from other threads)

    @classmethod
    def open(cls, ordinal: int = 0, sms: int | None = None) -> "Device":
        """Initialise the driver and retain GPU `ordinal`'s primary context; BackendError with a remedy if none.
        `sms`: run every kernel on that many multiprocessors only, through a green context made current instead
        (the driver may round the count up: `Device.sms` is what it granted)."""
        cu = driver()
        try:
            ret = cu.cuInit(0)
        except Exception as exc:  # cuda-python raises when libcuda.so itself cannot be loaded (no driver installed)
            raise BackendError(f"no NVIDIA driver found ({type(exc).__name__}: {exc}); {NO_GPU_HINT}") from exc
        err = ret[0] if isinstance(ret, tuple) else ret
        if int(err) != 0:
            name, detail = error_name(err)
            raise BackendError(
                f"no usable NVIDIA GPU: cuInit failed with {name}{' (' + detail + ')' if detail else ''}; {NO_GPU_HINT}"
            )
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if count == 0:
            raise BackendError(f"no CUDA GPU found (the driver reports 0 devices); {NO_GPU_HINT}")
        if not 0 <= ordinal < count:
            raise BackendError(f"GPU {ordinal} does not exist: this machine has {count} GPU(s) (0..{count - 1})")
        dev = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        attr = cu.CUdevice_attribute

        def get(a: Any) -> int:
            return int(check(cu.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute"))

        raw_name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
        name = raw_name.split(b"\0", 1)[0].decode(errors="replace") if isinstance(raw_name, bytes) else str(raw_name)
        info = DeviceInfo(
            ordinal=ordinal,
            name=name,
            capability=(
                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
            ),
            sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            total_mem=int(check(cu.cuDeviceTotalMem(dev), "cuDeviceTotalMem")),
            smem_per_block_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )
        ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        if sms is None:
            return cls(info, dev, ctx)
        try:
            green, green_ctx, granted = _green_context(dev, sms, info.sm_count)
        except BaseException:
            check(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
            raise
        check(cu.cuCtxSetCurrent(green_ctx), "cuCtxSetCurrent")
        return cls(info, dev, green_ctx, green, granted)

    # ---- queries ---------------------------------------------------------------------------------------------
    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes, as the driver sees it now."""
        free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def used(self) -> int:
        """Device memory in use now (driver view: the CUDA context and other processes included); the peak of
        what was seen is kept for `peak_used`."""
        free, total = self.mem_info()
        self.last_used = total - free
        self._peak_used = max(self._peak_used, self.last_used)
        return self.last_used

    def peak_used(self) -> int:
        """The most memory in use that `used()` saw, including now."""
        return max(self._peak_used, self.used())

    def synchronize(self) -> None:
        check(driver().cuCtxSynchronize(), "cuCtxSynchronize")

    def stream(self, non_blocking: bool = True, priority: str | None = None) -> "Stream":
        """A new stream; `priority` "least" or "greatest" (the device's range), else the default. Where blocks of
        several streams wait for multiprocessors, the greater priority's are placed first."""
        cu = driver()
        flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING if non_blocking else cu.CUstream_flags.CU_STREAM_DEFAULT
        if priority is None:
            return Stream(check(cu.cuStreamCreate(int(flags)), "cuStreamCreate"))
        least, greatest = check(cu.cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange")
        level = least if priority == "least" else greatest
        return Stream(check(cu.cuStreamCreateWithPriority(int(flags), int(level)), "cuStreamCreateWithPriority"))

    def event(self, timing: bool = True) -> "Event":
        cu = driver()
        flags = cu.CUevent_flags.CU_EVENT_DEFAULT if timing else cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return Event(check(cu.cuEventCreate(int(flags)), "cuEventCreate"))

    def close(self) -> None:
        """Release the green and the primary context (idempotent). Buffers must be freed before. After a fault on
        the device (a kernel's trap, an illegal address: an error sticky to the context, so the frees before may
        have failed) the primary context is reset too, which frees all it still holds: the next `Device.open`
        then gets a fresh context, not the broken one (the engine client reopens the backend after such a fault).
        Every step is tried; the first error is raised after the last."""
        if self._closed:
            return
        self._closed = True
        cu = driver()
        cu.cuCtxSetCurrent(self._ctx)  # (ours: a thread without it current would read another's state, or none)
        faulted = int(_result(cu.cuCtxSynchronize())) != 0  # the context's sticky error, if it has one
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self._green is not None:
            steps.append(("cuGreenCtxDestroy", lambda: cu.cuGreenCtxDestroy(self._green)))
        if faulted:
            steps.append(("cuDevicePrimaryCtxReset", lambda: cu.cuDevicePrimaryCtxReset(self._handle)))
        steps.append(("cuDevicePrimaryCtxRelease", lambda: cu.cuDevicePrimaryCtxRelease(self._handle)))
        first: CudaError | None = None
        for what, call in steps:
            try:
                check(call(), what)
            except CudaError as exc:
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _green_context(dev: Any, sms: int, total: int) -> tuple[Any, Any, int]:
    """(green context, its CUcontext, SMs granted) of `sms` of the device's multiprocessors. The split ignores SM
    co-scheduling (no kernel here launches clusters), which lowers the driver's granularity from 8 SMs to 2 on
    Hopper, so a 20-SM request gets 20 rather than 24."""
    if not 1 <= sms <= total:
        raise BackendError(f"--sms {sms}: this GPU has {total} multiprocessors (1..{total})")
    cu = driver()
    if not hasattr(cu, "cuGreenCtxCreate") or not hasattr(cu, "cuCtxFromGreenCtx"):
        raise BackendError(f"--sms {sms} needs green contexts: cuda-python >= 12.6 and a CUDA 12.4+ driver")
    whole = check(
        cu.cuDeviceGetDevResource(dev, cu.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource"
    )
    split_flags = getattr(cu, "CUdevSmResourceSplit_flags", None)  # (older bindings: the default 8-SM granularity)
    flags = int(getattr(split_flags, "CU_DEV_SM_RESOURCE_SPLIT_IGNORE_SM_COSCHEDULING", 0))
    groups, count, _rest = check(cu.cuDevSmResourceSplitByCount(1, whole, flags, sms), "cuDevSmResourceSplitByCount")
    if count < 1:
        raise BackendError(f"--sms {sms}: the driver cannot split that many multiprocessors off this GPU")
    part = groups[0]
    desc = check(cu.cuDevResourceGenerateDesc([part], 1), "cuDevResourceGenerateDesc")
    green = check(
        cu.cuGreenCtxCreate(desc, dev, int(cu.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)), "cuGreenCtxCreate"
    )
    try:
        return green, check(cu.cuCtxFromGreenCtx(green), "cuCtxFromGreenCtx"), int(part.sm.smCount)
    except BaseException:
        check(cu.cuGreenCtxDestroy(green), "cuGreenCtxDestroy")
        raise


class Stream:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def synchronize(self) -> None:
        check(driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        """Later work on this stream waits for the event's recorded work (a fork or join inside a graph capture)."""
        check(driver().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def destroy(self) -> None:
        if self.handle is not None:
            check(driver().cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def record(self, stream: Stream) -> None:
        check(driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def done(self) -> bool:
        """Whether the recorded work has completed (without waiting for it)."""
        cu = driver()
        (err,) = cu.cuEventQuery(self.handle)
        if int(err) == CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def elapsed_ms(self, start: "Event") -> float:
        """Milliseconds from `start` to this event (both recorded and complete)."""
        return float(check(driver().cuEventElapsedTime(start.handle, self.handle), "cuEventElapsedTime"))

    def destroy(self) -> None:
        if self.handle is not None:
            check(driver().cuEventDestroy(self.handle), "cuEventDestroy")
            self.handle = None
