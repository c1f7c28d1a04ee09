"""Codegen stage: `ArchSpec`, the per-architecture facts and tuning knobs the planner sizes kernels with."""

from __future__ import annotations

from dataclasses import dataclass

from ..model_spec.weight_layout import fp4_order_for


class ArchError(ValueError):
    """An architecture thorgen cannot build for: names it and lists the supported ones."""


@dataclass(frozen=True)
class ArchSpec:
    name: str  # "sm_90a" ...; also the nvcc code= target
    compute_capability: tuple[int, int]
    sm_count: int  # of the reference device of that arch (H200, B200, Jetson AGX Thor, RTX 5090)
    smem_per_block_max: int  # opt-in dynamic shared memory per block, bytes
    dram_gbps: float  # nominal DRAM bandwidth of the reference device (planning only, not a measurement)
    warps_per_block: int  # default warps per block of the bandwidth-bound elementwise/row kernels
    prefetch_depth: int  # software prefetch depth (loads in flight per thread) of weight-streaming loops
    max_threads_per_block: int = 1024
    has_wgmma: bool = False  # warpgroup MMA from shared memory (wgmma.mma_async): sm_90a only

    @property
    def threads_per_block(self) -> int:
        return 32 * self.warps_per_block

    @property
    def has_fp4_cvt(self) -> bool:
        """Hardware E2M1 -> half conversion (cvt.rn.f16x2.e2m1x2): the arch's kernels and weights use the "nat" fp4
        byte order (model_spec/weight_layout.py decides it from the name, as the repack does)."""
        return fp4_order_for(self.name) == "nat"


# Tuning: the H200 (132 SMs, ~4.3 TB/s) wants many bytes in flight per SM; Thor (20 SMs, ~200 GB/s LPDDR5X) is
# saturated with fewer warps, and the seed's Thor ledger found deeper unrolls neutral there.
ARCHS: dict[str, ArchSpec] = {
    a.name: a
    for a in (
        ArchSpec("sm_90a", (9, 0), 132, 232448, 4800.0, warps_per_block=8, prefetch_depth=4, has_wgmma=True),
        ArchSpec("sm_100a", (10, 0), 148, 232448, 8000.0, warps_per_block=8, prefetch_depth=4),
        ArchSpec("sm_110a", (11, 0), 20, 232448, 273.0, warps_per_block=4, prefetch_depth=2),
        ArchSpec("sm_120a", (12, 0), 170, 101376, 1792.0, warps_per_block=8, prefetch_depth=4),
    )
}


def get_arch(name: str) -> ArchSpec:
    """The ArchSpec for "sm_90a" etc. (also accepts "sm_90", "90a", "90"); ArchError for anything else."""
    key = name.strip().lower()
    if not key.startswith("sm_"):
        key = "sm_" + key
    if not key.endswith("a"):
        key += "a"
    try:
        return ARCHS[key]
    except KeyError:
        raise ArchError(f"unsupported arch {name!r}; thorgen builds for {', '.join(ARCHS)} (or 'native')") from None


def arch_for_capability(major: int, minor: int) -> ArchSpec:
    """Map a device compute capability to the arch we build for; ArchError when there is none."""
    for arch in ARCHS.values():
        if arch.compute_capability == (major, minor):
            return arch
    raise ArchError(
        f"GPU compute capability {major}.{minor} is not supported; thorgen builds for "
        + ", ".join(f"{a.name} ({a.compute_capability[0]}.{a.compute_capability[1]})" for a in ARCHS.values())
    )


def native_arch(device: int = 0) -> ArchSpec:
    """The arch of local GPU `device`, read through cuda.bindings; ArchError with the reason when there is none."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise ArchError(
            "--arch native needs cuda-python (pip install cuda-python) and an NVIDIA GPU; "
            "or name the arch explicitly, e.g. --arch sm_90a"
        ) from exc
    try:
        (err,) = cu.cuInit(0)
    except Exception as exc:  # the driver library itself is missing (no GPU driver installed)
        raise ArchError(
            f"--arch native: no NVIDIA driver here ({exc}); name the arch explicitly, e.g. --arch sm_90a"
        ) from exc
    if err != cu.CUresult.CUDA_SUCCESS:
        raise ArchError(
            f"--arch native: no usable NVIDIA GPU/driver here (cuInit: {err.name}); name the arch explicitly"
        )
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count <= device:
        raise ArchError(f"--arch native: GPU {device} not found ({count if not err else 0} devices)")
    err, dev = cu.cuDeviceGet(device)
    attr = cu.CUdevice_attribute
    _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return arch_for_capability(major, minor)
