"""The per-kernel benchmark (`thorgen bench --kernels`): each kernel's time, bytes moved, achieved GB/s and its
fraction of a device-to-device copy bandwidth probe measured in the same run, for the kernels of a build folder.

It reads what `thorgen build` wrote: manifest.json (the kernels, their cubins and arch, checked against the GPU)
and bench_cases.json (each kernel's arguments and bytes moved: runtime/bench/cases.py), and runs them on the
runtime's CUDA driver wrapper (KernelRig, which the GPU kernel tests use too). Two timings per kernel: "single us"
is the median of single event-timed launches after an L2 flush (a 256 MB memset): it includes ~4-5 us of launch +
event overhead. "stream us" (which GB/s and the target use) is how the kernel runs inside a decode-step CUDA graph:
launches replayed back to back from a graph, each on its own copy of the inputs, with enough copies
(>= ROTATE_BYTES in all) that no launch finds its weights in L2 (~60 MB on the H200).
With --chain N, the chain benchmark instead (runtime/bench/kernel_chain.py): the decode GEMVs and their bench-only
prologue forms, each in a graph of N dependent launches.
`thorgen bench kernels [--kernel-dir DIR | --model DIR | --preset gemma-4-26b-a4b] [--json out.json] [--iters 20]
[--family F] [--chain N]`
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import click
import numpy as np

from ...model_spec.paths import MANIFEST_NAME
from ...model_spec.presets import get_preset
from ..backend import BackendError
from ..cuda.device import Device, check, driver
from ..cuda.graphs import CudaGraph
from ..cuda.kernels import Kernel, KernelSet, Ptr
from ..cuda.memory import DeviceBuffer, alloc
from ..manifest import KernelEntry, KernelManifest, find_kernels
from .cases import host_args, load_bench_cases
from .kernel_chain import ROTATE_BYTES, format_chain, run_chain

TARGET_FRACTION = 0.70
MAX_COPIES = 64
STREAM_LAUNCHES = 64  # launches per captured graph in the stream timing
DEFAULT_PRESET = "gemma-4-26b-a4b"


def _write_cubin(folder: Path, name: str, cubin: bytes) -> Path:
    """`folder/<name>.<content hash>.cubin`: rigs sharing the folder never overwrite each other's cubins; written
    through a temporary file and a rename, so a concurrent reader never sees half a cubin."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{hashlib.blake2b(cubin, digest_size=8).hexdigest()}.cubin"
    if not path.is_file():
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    return path


class KernelRig:
    """Compiled kernels on one GPU with a stream of their own: buffers, launches and event/graph timings.

    Kernels are added as manifest entries with their cubins (a file, or bytes written to `work/cubins`) and load
    through the runtime's KernelSet from a manifest made in memory for `arch` (default: the device's, so the
    check against the device passes), so launches get the runtime's argument packing (widths from the cubin).
    """

    def __init__(self, device: Device, work: Path, arch: str | None = None) -> None:
        self.device = device
        self.arch = arch or device.info.arch
        self.stream = device.stream(non_blocking=False)  # ordered after the synchronous copies of upload()
        self.cubin_dir = work / "cubins"
        self._entries: dict[str, KernelEntry] = {}
        self._set: KernelSet | None = None
        self._buffers: list[DeviceBuffer] = []

    # ---- kernels -------------------------------------------------------------------------------------------------
    def add(self, entries: Iterable[KernelEntry], cubins: Mapping[str, bytes | Path] | None = None) -> None:
        """Make `entries` launchable; each loads `cubins[name]` (bytes or a file) when given, else its entry's
        cubin file. A kernel added again under its name replaces it."""
        for e in entries:
            cubin = (cubins or {}).get(e.name, e.cubin)
            path = _write_cubin(self.cubin_dir, e.name, cubin) if isinstance(cubin, bytes) else Path(cubin)
            self._entries[e.name] = dataclasses.replace(e, cubin=path)
        if self._set is not None:  # loaded again, with the new kernels, on the next launch
            self.sync()
            self._set.unload()
            self._set = None

    def kernel(self, name: str) -> Kernel:
        if self._set is None:
            manifest = KernelManifest(
                path=self.cubin_dir / MANIFEST_NAME,
                model="",
                spec_hash="",
                arch=self.arch,
                conventions={},
                kernels=dict(self._entries),
            )
            self._set = KernelSet(manifest, self.device)
        return self._set.kernel(name)

    def launch(
        self, name: str, args: Sequence[Any], grid: tuple[int, int, int] | None = None, pdl: bool = False
    ) -> None:
        """Enqueue kernel `name` on the rig's stream; None in `args` passes a null pointer (an optional buffer
        left off). `pdl`: with programmatic dependent launch, as the engine launches a kernel after another."""
        self.kernel(name).launch(self.stream, [Ptr(0) if a is None else a for a in args], grid=grid, pdl=pdl)

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
    def time_ms(
        self, launch: Callable[[], None], iters: int = 20, warmup: int = 3, before: Callable[[], None] | None = None
    ) -> float:
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
            ms = self.time_ms(
                lambda: check(
                    driver().cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, self.stream.handle), "copy bandwidth probe"
                ),
                iters,
            )
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


def find_build(
    device_arch: str, kernel_dir: Path | None = None, model_dir: Path | None = None, preset: str | None = None
) -> KernelManifest:
    """The manifest of the build to benchmark, found as the cuda backend finds its kernels (runtime/manifest.py
    find_kernels: --kernel-dir, $THORGEN_KERNELS, ./thorgen-build/<model>/<arch>, <model>/thorgen-build/<arch>),
    of the checkpoint folder, else of the preset."""
    if model_dir is not None:
        return find_kernels(device_arch, model_dir.name, model_dir, kernel_dir, option="--kernel-dir")
    return find_kernels(device_arch, get_preset(preset or DEFAULT_PRESET).name, None, kernel_dir, option="--kernel-dir")


def run_bench(
    kernel_dir: Path | None = None,
    model_dir: Path | None = None,
    preset: str | None = None,
    iters: int = 20,
    flush_l2: bool = True,
    families: tuple[str, ...] | None = None,
    chain: int | None = None,
) -> dict:
    """Benchmark every bench case of a build folder (see find_build) on GPU 0; returns the JSON-ready report. With
    `chain`, the chain benchmark of its decode GEMVs (kernel_chain.py) instead."""
    device = Device.open(0)
    try:
        manifest = find_build(device.info.arch, kernel_dir, model_dir, preset)
        manifest.check(device_arch=device.info.arch)
        rig = KernelRig(device, Path(tempfile.gettempdir()) / "thorgen-bench" / "rig", arch=manifest.arch)
        try:
            if chain is not None:
                return _chain_bench(rig, manifest, iters, chain)
            return _bench(rig, manifest, iters, flush_l2, families)
        finally:
            rig.close()
    finally:
        device.close()


def _bench(
    rig: KernelRig, manifest: KernelManifest, iters: int, flush_l2: bool, families: tuple[str, ...] | None
) -> dict:
    cases = [c for c in load_bench_cases(manifest) if families is None or manifest.kernel(c.kernel).family in families]
    rig.add(manifest.kernel(name) for name in dict.fromkeys(c.kernel for c in cases))
    copy_gbps = rig.copy_bandwidth_gbps()
    flush = rig.alloc(256 << 20) if flush_l2 else None
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        entry = manifest.kernel(case.kernel)
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(case.bytes_moved, 1))))
        host = host_args(case, rng)
        sets = [[rig.upload(h) if isinstance(h, np.ndarray) else h for h in host] for _ in range(copies)]
        before = (lambda: flush.zero(rig.stream)) if flush is not None else None
        single = rig.time_ms(lambda: rig.launch(entry.name, sets[0], case.grid), iters=iters, before=before)
        turn = iter(range(1 << 30))
        stream = rig.graph_time_ms(
            lambda: rig.launch(entry.name, sets[next(turn) % copies], case.grid), reps=STREAM_LAUNCHES
        )
        gbps = case.bytes_moved / (stream * 1e-3) / 1e9
        rows.append(
            {
                "kernel": entry.name,
                "family": entry.family,
                "note": case.note,
                "single_us": single * 1e3,
                "stream_us": stream * 1e3,
                "input_copies": copies,
                "bytes": case.bytes_moved,
                "gbps": gbps,
                "fraction_of_copy": gbps / copy_gbps,
                "weight_streaming": case.weight_streaming,
                "meets_target": (gbps / copy_gbps >= TARGET_FRACTION) if case.weight_streaming else None,
            }
        )
        rig.free(keep=[flush] if flush is not None else [])  # this case's buffers
    return {
        **_report_head(rig, manifest, copy_gbps, iters),
        "l2_flushed": flush_l2,
        "target_fraction": TARGET_FRACTION,
        "kernels": rows,
    }


def _chain_bench(rig: KernelRig, manifest: KernelManifest, iters: int, n: int) -> dict:
    copy_gbps = rig.copy_bandwidth_gbps()
    try:
        chain = run_chain(rig, manifest, load_bench_cases(manifest), n, copy_gbps, iters)
    except ValueError as exc:  # a build without the prologue forms
        raise BackendError(str(exc)) from exc
    return {**_report_head(rig, manifest, copy_gbps, iters), "chain": chain}


def _report_head(rig: KernelRig, manifest: KernelManifest, copy_gbps: float, iters: int) -> dict:
    """What both kernel reports open with: the build, the device, its copy bandwidth and the timed iterations."""
    return {
        "model": manifest.model,
        "kernel_dir": str(manifest.path.parent),
        "arch": manifest.arch,
        "device": rig.device.info.name,
        "copy_gbps": copy_gbps,
        "iters": iters,
    }


def format_report(report: dict) -> str:
    if "chain" in report:
        return format_chain(report)
    lines = [
        f"{report['device']} ({report['arch']}), {report['model']} kernels of {report['kernel_dir']}: copy "
        f"bandwidth {report['copy_gbps']:.0f} GB/s (read+write); single: median of {report['iters']} launches, L2 "
        f"flushed: {report['l2_flushed']}; stream: graph-replayed launches on rotated inputs (GB/s uses it)",
        f"{'kernel':<52} {'case':<18} {'single us':>9} {'stream us':>9} {'MB':>9} {'GB/s':>8} {'of copy':>8}  target",
    ]
    for r in report["kernels"]:
        tgt = "" if r["meets_target"] is None else ("ok" if r["meets_target"] else "BELOW")
        lines.append(
            f"{r['kernel'][:52]:<52} {r['note'][:18]:<18} {r['single_us']:>9.1f} {r['stream_us']:>9.2f} "
            f"{r['bytes'] / 1e6:>9.2f} {r['gbps']:>8.0f} {r['fraction_of_copy']:>7.1%}  {tgt}"
        )
    return "\n".join(lines)


@click.command("kernels")
@click.option(
    "--kernel-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Built kernels folder (manifest.json and bench_cases.json from `thorgen build`).",
)
@click.option(
    "--model",
    "model_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Checkpoint folder: its build is found as the cuda backend finds it.",
)
@click.option("--preset", default=None, help=f"Without --model: the build of this preset (default {DEFAULT_PRESET}).")
@click.option("--iters", type=click.IntRange(min=1), default=20, show_default=True)
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the report here.",
)
@click.option("--no-flush", is_flag=True, help="Do not flush L2 between single launches.")
@click.option("--family", "families", multiple=True, help="Only these kernel families (repeatable).")
@click.option(
    "--chain",
    type=click.IntRange(min=1),
    default=None,
    help="Instead: the one-row decode GEMVs and their prologue forms (a build made with `thorgen build "
    "--prologue-variants`), each in a CUDA graph of this many dependent PDL launches, and all of them in the "
    "decode step's order over this many layers: us a launch, GB/s, fraction of copy bandwidth.",
)
def kernels_bench(
    kernel_dir: Path | None,
    model_dir: Path | None,
    preset: str | None,
    iters: int,
    json_file: Path | None,
    no_flush: bool,
    families: tuple[str, ...],
    chain: int | None,
) -> None:
    """Per-kernel time and bandwidth of a build's kernels on GPU 0."""
    if model_dir is not None and preset is not None:
        raise click.UsageError("give --model or --preset, not both")
    try:
        report = run_bench(kernel_dir, model_dir, preset, iters, not no_flush, families or None, chain)
    except BackendError as exc:  # no GPU, no cuda-python, no build, or a build for another GPU
        raise click.ClickException(str(exc)) from exc
    click.echo(format_report(report))
    if json_file is not None:
        json_file.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    kernels_bench()
