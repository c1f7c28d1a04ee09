"""Codegen stage (benchmark): per-kernel time, bytes moved, achieved GB/s and fraction of a device-to-device copy
bandwidth probe measured in the same run, for a preset's plan on the local GPU.

Cases come from each family module's `bench_<family>(spec, arch) -> list[BenchCase]`. Two timings per kernel:
"single us" is the median of single event-timed launches after an L2 flush (a 256 MB memset): it includes
~4-5 us of launch + event overhead. "stream us" (which GB/s and the target use) is how the kernel runs inside a
decode-step CUDA graph: launches replayed back to back from a graph, each on its own copy of the inputs, with
enough copies (>= ROTATE_BYTES in all) that no launch finds its weights in L2 (~60 MB on the H200).
`python -m thorgen.codegen.bench_kernels [--preset gemma-4-26b-a4b] [--json out.json] [--iters 20]`
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from ..model_spec.nvfp4 import f32_to_bf16
from ..model_spec.presets import get_preset
from .arch import ArchSpec, native_arch
from .families import FAMILIES, family_function
from .kernel_spec import BenchCase, Buf, Scalar
from .render import render

TARGET_FRACTION = 0.70
ROTATE_BYTES = 512 << 20  # input copies cycled through by the stream timing, several times the L2
MAX_COPIES = 64
STREAM_LAUNCHES = 64  # launches per captured graph in the stream timing
_NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32, "u64": np.uint64, "i64": np.int64}
_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i32": 4, "u32": 4, "u64": 8, "i64": 8}


def bench_cases(spec, arch: ArchSpec) -> list[BenchCase]:
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


def _scalar(s: Scalar):
    return {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32,
            "f64": np.float64}[s.ctype](s.value)


def run_bench(preset: str = "gemma-4-26b-a4b", iters: int = 20, flush_l2: bool = True,
              families: tuple[str, ...] | None = None) -> dict:
    """Benchmark every bench case of `preset` on GPU 0; returns the JSON-ready report."""
    from .builder import compile_sources
    from .device import Gpu

    gpu = Gpu(0)
    arch = native_arch()
    spec = get_preset(preset)
    cases = [c for c in bench_cases(spec, arch) if families is None or c.kernel.family in families]
    kernels = {c.kernel.name: c.kernel for c in cases}
    import tempfile

    work = Path(tempfile.gettempdir()) / "thorgen-bench" / arch.name
    compiled = compile_sources({n: render(k, arch, spec.spec_hash) for n, k in kernels.items()}, arch, work)
    copy_gbps = gpu.copy_bandwidth_gbps()
    flush = gpu.alloc(256 << 20) if flush_l2 else None
    rng = np.random.default_rng(0)
    rows = []
    for case in cases:
        k = case.kernel
        fn = gpu.function(k, compiled[k.name][0])
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(case.bytes_moved, 1))))
        # a zero-count buffer is a null pointer (an optional output left off)
        host = [(None if a.count == 0 else fill(a, rng)) if isinstance(a, Buf) else _scalar(a) for a in case.args]
        sets = [[gpu.upload(h) if isinstance(h, np.ndarray) and isinstance(a, Buf) else h
                 for a, h in zip(case.args, host)] for _ in range(copies)]
        before = (lambda: gpu.cu.cuMemsetD8Async(flush.ptr, 0, flush.nbytes, gpu.stream)) if flush else None
        single = gpu.time_ms(lambda: gpu.launch(fn, k, sets[0], case.grid), iters=iters, before=before)
        turn = iter(range(1 << 30))
        stream = gpu.graph_time_ms(lambda: gpu.launch(fn, k, sets[next(turn) % copies], case.grid),
                                   reps=STREAM_LAUNCHES)
        gbps = case.bytes_moved / (stream * 1e-3) / 1e9
        rows.append({"kernel": k.name, "family": k.family, "note": case.note, "single_us": single * 1e3,
                     "stream_us": stream * 1e3, "input_copies": copies, "bytes": case.bytes_moved, "gbps": gbps,
                     "fraction_of_copy": gbps / copy_gbps, "weight_streaming": case.weight_streaming,
                     "meets_target": (gbps / copy_gbps >= TARGET_FRACTION) if case.weight_streaming else None})
        for a in (a for args in sets for a in args):  # free this case's buffers (keep the flush buffer)
            if a is not None and hasattr(a, "ptr"):
                gpu.cu.cuMemFree(a.ptr)
        gpu._buffers = [b for b in gpu._buffers if b is flush]
    return {"preset": preset, "arch": arch.name, "device": gpu.name, "copy_gbps": copy_gbps, "iters": iters,
            "l2_flushed": flush_l2, "target_fraction": TARGET_FRACTION, "kernels": rows}


def format_report(report: dict) -> str:
    lines = [f"{report['device']} ({report['arch']}), preset {report['preset']}: copy bandwidth "
             f"{report['copy_gbps']:.0f} GB/s (read+write); single: median of {report['iters']} launches, L2 "
             f"flushed: {report['l2_flushed']}; stream: graph-replayed launches on rotated inputs (GB/s uses it)",
             f"{'kernel':<52} {'case':<18} {'single us':>9} {'stream us':>9} {'MB':>9} {'GB/s':>8} {'of copy':>8}  target"]
    for r in report["kernels"]:
        tgt = "" if r["meets_target"] is None else ("ok" if r["meets_target"] else "BELOW")
        lines.append(f"{r['kernel'][:52]:<52} {r['note'][:18]:<18} {r['single_us']:>9.1f} {r['stream_us']:>9.2f} {r['bytes'] / 1e6:>9.2f} "
                     f"{r['gbps']:>8.0f} {r['fraction_of_copy']:>7.1%}  {tgt}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="thorgen per-kernel bandwidth benchmark")
    ap.add_argument("--preset", default="gemma-4-26b-a4b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between launches")
    ap.add_argument("--family", action="append", help="only these families (repeatable)")
    args = ap.parse_args(argv)
    report = run_bench(args.preset, args.iters, not args.no_flush, tuple(args.family) if args.family else None)
    sys.stdout.write(format_report(report) + "\n")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
