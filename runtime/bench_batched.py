"""Runtime stage: batched decode steps timed per bucket for `thorgen bench --batch-sizes` (issue 9's per-bucket
bytes and bandwidth), and the per-kernel time of the largest bucket's step."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from .roofline import step_cost


def measure_batched(backend: Any, report: dict, sizes: list[int], position: int, steps: int = 20) -> None:
    """Add `batched_decode` ([{rows, bucket, step_ms, tok_s, bytes, gb_s, frac_copy}]) and `batched_step_kernels`
    (the largest size's step, eager launches event-timed) to a cuda `run_bench` report. Every row is its own
    sequence in its own KV lane at `position` (the lanes' K/V is whatever they hold: the cost does not depend on
    it); the time is the wall time of Engine.decode_batch, host staging and the token read-back included, as the
    server sees it."""
    from .forward import DECODE_BUCKETS

    eng, spec = backend.engine, backend.spec
    rows_out = []
    for n in sizes:
        rows = [(lane, position, 2, None) for lane in range(n)]
        for _ in range(3):  # capture + warm-up
            eng.decode_batch(rows)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            eng.decode_batch(rows)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        nbytes = step_cost(spec, "decode", position + 1, n, report["kv_dtype"], report["lm_head"])["bytes"]
        gbs = nbytes / ms / 1e6
        top = DECODE_BUCKETS[-1]  # more rows run as two forwards (Engine.decode_batch)
        rows_out.append({"rows": n, "bucket": next(b for b in DECODE_BUCKETS if b >= n) if n <= top else
                         f"{top}+{next(b for b in DECODE_BUCKETS if b >= n - top)}", "step_ms": round(ms, 3),
                         "tok_s": round(1e3 * n / ms, 1), "bytes": int(nbytes), "gb_s": round(gbs, 1),
                         "frac_copy": round(gbs / report["copy_gb_s"], 4)})
    report["batched_decode"] = rows_out
    report["batched_decode_position"] = position
    biggest = min(max(sizes), DECODE_BUCKETS[-1])  # the largest single forward
    report["batched_step_rows"] = biggest
    report["batched_step_kernels"] = _kernels(eng, biggest, position)


def _kernels(eng: Any, n: int, position: int) -> list[dict]:
    """One batched step of n rows, eager launches one stream, each timed with events, summed per kernel."""
    fork, pdl, eng.fork, eng.pdl = eng.fork, eng.pdl, False, False
    try:
        launches = eng.bind(eng.fwd.ops(n, decode=False, last=True, batched=True))
    finally:
        eng.fork, eng.pdl = fork, pdl
    for name, values in (("ids", np.full(n, 2)), ("positions", np.full(n, position)), ("lanes", np.arange(n))):
        eng.act[name].view(0, 4 * n).upload(values.astype(np.int32), stream=eng.stream)
    events = [eng.device.event() for _ in range(len(launches) + 1)]
    events[0].record(eng.stream)
    for (_, launch), ev in zip(launches, events[1:]):
        launch(eng.stream)
        ev.record(eng.stream)
    eng.stream.synchronize()
    agg: dict[str, dict] = {}
    for i, (_, launch) in enumerate(launches):
        name = launch.kernel.name if getattr(launch, "kernel", None) else "memcpy2d"
        a = agg.setdefault(name, {"kernel": name, "us": 0.0, "count": 0})
        a["us"] += 1e3 * events[i + 1].elapsed_ms(events[i])
        a["count"] += 1
    for e in events:
        e.destroy()
    return sorted(({**a, "us": round(a["us"], 2)} for a in agg.values()), key=lambda a: -a["us"])
