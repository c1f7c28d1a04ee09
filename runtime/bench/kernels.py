"""The per-kernel benchmark (`thorgen bench --kernels`): each kernel's time, bytes moved, achieved GB/s and its
fraction of a device-to-device copy bandwidth probe measured in the same run, for a preset's plan on the local GPU.

Cases come from each codegen family module's `bench_<family>(spec, arch) -> list[BenchCase]`; the kernels are
compiled through codegen's cubin cache and run on the runtime's CUDA driver wrapper (KernelRig, which the GPU
kernel tests use too). Two timings per kernel: "single us" is the median of single event-timed launches after an
L2 flush (a 256 MB memset): it includes ~4-5 us of launch + event overhead. "stream us" (which GB/s and the target
use) is how the kernel runs inside a decode-step CUDA graph: launches replayed back to back from a graph, each on
its own copy of the inputs, with enough copies (>= ROTATE_BYTES in all) that no launch finds its weights in L2
(~60 MB on the H200).
`python -m thorgen.runtime.bench.kernels [--preset gemma-4-26b-a4b] [--json out.json] [--iters 20] [--family F]`
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import click
import numpy as np

from ...codegen.arch import ArchSpec, arch_for_capability
from ...codegen.builder import compile_sources
from ...codegen.families import FAMILIES, family_function
from ...codegen.kernel_spec import BenchCase, Buf, KernelSpec
from ...codegen.render import render
from ...model_spec.nvfp4 import f32_to_bf16
from ...model_spec.presets import get_preset
from ..backend import BackendError
from ..cuda.device import Device, check, driver
from ..cuda.graphs import CudaGraph
from ..cuda.kernels import Kernel, KernelSet, Ptr
from ..cuda.memory import DeviceBuffer, alloc
from ..manifest import KernelEntry, KernelManifest

TARGET_FRACTION = 0.70
ROTATE_BYTES = 512 << 20  # input copies cycled through by the stream timing, several times the L2
MAX_COPIES = 64
STREAM_LAUNCHES = 64  # launches per captured graph in the stream timing
_NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32, "u64": np.uint64, "i64": np.int64}
_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i32": 4, "u32": 4, "u64": 8, "i64": 8}
_SCALAR = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32, "f64": np.float64}


def compile_kernels(kernels: Iterable[KernelSpec], arch: ArchSpec, spec_hash: str, work: Path) -> dict[str, bytes]:
    """{kernel name: cubin} for `kernels`, compiled in parallel through codegen's content-addressed cubin cache."""
    sources = {k.name: render(k, arch, spec_hash) for k in kernels}
    return {name: cubin for name, (cubin, _) in compile_sources(sources, arch, work).items()}


def _write_cubin(folder: Path, name: str, cubin: bytes) -> Path:
    """`folder/<name>.<content hash>.cubin`: rigs sharing the folder never overwrite each other's cubins; written
    through a temporary file and a rename, so a concurrent reader never sees half a cubin."""
    path = folder / f"{name}.{hashlib.blake2b(cubin, digest_size=8).hexdigest()}.cubin"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    return path


class KernelRig:
    """Compiled KernelSpecs on one GPU with a stream of their own: buffers, launches and event/graph timings.

    The kernels load through the runtime's KernelSet from a manifest made in memory (their cubins written to
    `work/cubins`), so launches get the runtime's argument packing (widths from the cubin) and arch checks.
    """

    def __init__(self, device: Device, work: Path) -> None:
        self.device = device
        self.arch = arch_for_capability(*device.info.capability)
        self.stream = device.stream(non_blocking=False)  # ordered after the synchronous copies of upload()
        self.cubin_dir = work / "cubins"
        self.cubin_dir.mkdir(parents=True, exist_ok=True)
        self._entries: dict[str, KernelEntry] = {}
        self._set: KernelSet | None = None
        self._buffers: list[DeviceBuffer] = []

    # ---- kernels -------------------------------------------------------------------------------------------------
    def add(self, kernels: Iterable[KernelSpec], cubins: Mapping[str, bytes]) -> None:
        """Make `kernels` launchable (cubins: {name: cubin}); a kernel added again under its name replaces it."""
        for k in kernels:
            self._entries[k.name] = KernelEntry(
                name=k.name, cubin=_write_cubin(self.cubin_dir, k.name, cubins[k.name]), entry=k.name,
                family=k.family, grid=k.grid, block=k.block, smem_bytes=k.smem_bytes, args=k.args,
                params=dict(k.params), template=k.template)
        if self._set is not None:  # loaded again, with the new kernels, on the next launch
            self.sync()
            self._set.unload()
            self._set = None

    def kernel(self, spec: KernelSpec) -> Kernel:
        if self._set is None:
            manifest = KernelManifest(path=self.cubin_dir / "manifest.json", model="", spec_hash="",
                                      arch=self.arch.name, conventions={}, kernels=dict(self._entries))
            self._set = KernelSet(manifest, self.device)
        return self._set.kernel(spec.name)

    def launch(self, spec: KernelSpec, args: Sequence[Any], grid: tuple[int, int, int] | None = None) -> None:
        """Enqueue `spec` on the rig's stream; None in `args` passes a null pointer (an optional buffer left off)."""
        self.kernel(spec).launch(self.stream, [Ptr(0) if a is None else a for a in args], grid=grid)

    # ---- memory --------------------------------------------------------------------------------------------------
    def alloc(self, nbytes: int, zero: bool = True) -> DeviceBuffer:
        buf = alloc(self.device, nbytes, "kernel rig buffer")
        self._buffers.append(buf)
        if zero and nbytes:
            buf.zero(self.stream)
        return buf

    def upload(self, arr: np.ndarray) -> DeviceBuffer:
        arr = np.ascontiguousarray(arr)
        buf = self.alloc(arr.nbytes, zero=False)
        buf.upload(arr)
        return buf

    def download(self, buf: DeviceBuffer, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        self.sync()
        return buf.download(dtype, tuple(shape))

    def free(self, keep: Iterable[DeviceBuffer] = ()) -> None:
        """Free every buffer of the rig but those in `keep`."""
        self.sync()
        kept = {id(b) for b in keep}
        for buf in self._buffers:
            if id(buf) not in kept:
                buf.free()
        self._buffers = [b for b in self._buffers if id(b) in kept]

    def sync(self) -> None:
        self.stream.synchronize()

    # ---- timing --------------------------------------------------------------------------------------------------
    def time_ms(self, launch: Callable[[], None], iters: int = 20, warmup: int = 3,
                before: Callable[[], None] | None = None) -> float:
        """Median milliseconds of `launch()` over `iters` event-timed runs (`before()` runs untimed each time)."""
        start, end = self.device.event(), self.device.event()
        try:
            for _ in range(warmup):
                launch()
            self.sync()
            times = []
            for _ in range(iters):
                if before is not None:
                    before()
                start.record(self.stream)
                launch()
                end.record(self.stream)
                end.synchronize()
                times.append(end.elapsed_ms(start))
            return statistics.median(times)
        finally:
            start.destroy()
            end.destroy()

    def graph_time_ms(self, launch: Callable[[], None], reps: int = 10, iters: int = 5) -> float:
        """Milliseconds per launch of `reps` back-to-back launches captured in a CUDA graph (no host overhead)."""
        def body() -> None:
            for _ in range(reps):
                launch()
        graph = CudaGraph.capture(self.stream, body, "kernel timing")
        try:
            return self.time_ms(lambda: graph.replay(self.stream), iters) / reps
        finally:
            graph.destroy()

    def copy_bandwidth_gbps(self, nbytes: int = 1 << 30, iters: int = 10) -> float:
        """Device-to-device copy bandwidth, counting bytes read + written (the usual 'copy bandwidth')."""
        src, dst = (alloc(self.device, nbytes, "copy bandwidth probe") for _ in range(2))
        try:
            ms = self.time_ms(lambda: check(driver().cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, self.stream.handle),
                                            "copy bandwidth probe"), iters)
        finally:
            self.sync()
            src.free()
            dst.free()
        return 2 * nbytes / (ms * 1e-3) / 1e9

    def close(self) -> None:
        """Free the buffers, unload the kernels and destroy the stream (the device stays open)."""
        self.free()
        if self._set is not None:
            self._set.unload()
            self._set = None
        self.stream.destroy()


# ---- the benchmark -----------------------------------------------------------------------------------------------

def bench_cases(spec: Any, arch: ArchSpec) -> list[BenchCase]:
    cases = []
    for fam in FAMILIES:
        fn = family_function(fam, "bench")
        if fn is not None:
            cases.extend(fn(spec, arch))
    return cases


def fill(buf: Buf, rng: np.random.Generator) -> np.ndarray:
    """Host data for a bench buffer (see Buf's docstring)."""
    n = buf.count
    if buf.dtype not in _SIZE:
        raise ValueError(f"bench buffer {buf.name}: unknown dtype {buf.dtype}")
    if buf.values:
        vals = np.resize(np.asarray(buf.values), n)
        if buf.dtype == "bf16":
            return f32_to_bf16(vals.astype(np.float32))
        return vals.astype(_NP.get(buf.dtype, np.uint8))
    if buf.low == buf.high:
        if buf.dtype == "bf16":
            return np.full(n, f32_to_bf16(np.array([buf.low], np.float32))[0], np.uint16)
        return np.full(n, buf.low, _NP.get(buf.dtype, np.uint8))
    if buf.dtype == "u8":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if buf.dtype in ("i32", "u32", "u64", "i64"):
        return rng.integers(int(buf.low), int(buf.high), n).astype(_NP[buf.dtype])
    vals = rng.uniform(buf.low, buf.high, n).astype(np.float32)
    return f32_to_bf16(vals) if buf.dtype == "bf16" else vals.astype(_NP[buf.dtype])


def run_bench(preset: str = "gemma-4-26b-a4b", iters: int = 20, flush_l2: bool = True,
              families: tuple[str, ...] | None = None) -> dict:
    """Benchmark every bench case of `preset` on GPU 0; returns the JSON-ready report."""
    device = Device.open(0)
    rig = KernelRig(device, Path(tempfile.gettempdir()) / "thorgen-bench" / "rig")
    try:
        return _bench(rig, preset, iters, flush_l2, families)
    finally:
        rig.close()
        device.close()


def _bench(rig: KernelRig, preset: str, iters: int, flush_l2: bool, families: tuple[str, ...] | None) -> dict:
    arch = rig.arch
    spec = get_preset(preset)
    cases = [c for c in bench_cases(spec, arch) if families is None or c.kernel.family in families]
    kernels = {c.kernel.name: c.kernel for c in cases}
    work = Path(tempfile.gettempdir()) / "thorgen-bench" / arch.name
    rig.add(kernels.values(), compile_kernels(kernels.values(), arch, spec.spec_hash, work))
    copy_gbps = rig.copy_bandwidth_gbps()
    flush = rig.alloc(256 << 20) if flush_l2 else None
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        k = case.kernel
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(case.bytes_moved, 1))))
        # a zero-count buffer is a null pointer (an optional output left off)
        host = [(None if a.count == 0 else fill(a, rng)) if isinstance(a, Buf) else _SCALAR[a.ctype](a.value)
                for a in case.args]
        sets = [[rig.upload(h) if isinstance(h, np.ndarray) and isinstance(a, Buf) else h
                 for a, h in zip(case.args, host)] for _ in range(copies)]
        before = (lambda: flush.zero(rig.stream)) if flush is not None else None
        single = rig.time_ms(lambda: rig.launch(k, sets[0], case.grid), iters=iters, before=before)
        turn = iter(range(1 << 30))
        stream = rig.graph_time_ms(lambda: rig.launch(k, sets[next(turn) % copies], case.grid), reps=STREAM_LAUNCHES)
        gbps = case.bytes_moved / (stream * 1e-3) / 1e9
        rows.append({"kernel": k.name, "family": k.family, "note": case.note, "single_us": single * 1e3,
                     "stream_us": stream * 1e3, "input_copies": copies, "bytes": case.bytes_moved, "gbps": gbps,
                     "fraction_of_copy": gbps / copy_gbps, "weight_streaming": case.weight_streaming,
                     "meets_target": (gbps / copy_gbps >= TARGET_FRACTION) if case.weight_streaming else None})
        rig.free(keep=[flush] if flush is not None else [])  # this case's buffers
    return {"preset": preset, "arch": arch.name, "device": rig.device.info.name, "copy_gbps": copy_gbps,
            "iters": iters, "l2_flushed": flush_l2, "target_fraction": TARGET_FRACTION, "kernels": rows}


def format_report(report: dict) -> str:
    lines = [f"{report['device']} ({report['arch']}), preset {report['preset']}: copy bandwidth "
             f"{report['copy_gbps']:.0f} GB/s (read+write); single: median of {report['iters']} launches, L2 "
             f"flushed: {report['l2_flushed']}; stream: graph-replayed launches on rotated inputs (GB/s uses it)",
             f"{'kernel':<52} {'case':<18} {'single us':>9} {'stream us':>9} {'MB':>9} {'GB/s':>8} {'of copy':>8}"
             "  target"]
    for r in report["kernels"]:
        tgt = "" if r["meets_target"] is None else ("ok" if r["meets_target"] else "BELOW")
        lines.append(f"{r['kernel'][:52]:<52} {r['note'][:18]:<18} {r['single_us']:>9.1f} {r['stream_us']:>9.2f} "
                     f"{r['bytes'] / 1e6:>9.2f} {r['gbps']:>8.0f} {r['fraction_of_copy']:>7.1%}  {tgt}")
    return "\n".join(lines)


@click.command("kernels")
@click.option("--preset", default="gemma-4-26b-a4b", show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--json", "json_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report here.")
@click.option("--no-flush", is_flag=True, help="Do not flush L2 between single launches.")
@click.option("--family", "families", multiple=True, help="Only these kernel families (repeatable).")
def kernels_bench(preset: str, iters: int, json_file: Path | None, no_flush: bool, families: tuple[str, ...]) -> None:
    """Per-kernel time and bandwidth of a preset's plan on GPU 0."""
    try:
        report = run_bench(preset, iters, not no_flush, families or None)
    except BackendError as exc:  # no GPU or no cuda-python here
        raise click.ClickException(str(exc)) from exc
    click.echo(format_report(report))
    if json_file is not None:
        json_file.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    kernels_bench()
