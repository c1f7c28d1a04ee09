"""Runtime stage: batched decode steps timed per bucket for `thorgen bench --batch-sizes` (the per-bucket
step time, bytes and bandwidth), and the per-kernel time of the largest bucket's step."""

from __future__ import annotations

import statistics
import time
from typing import Any

from .roofline import step_cost


def measure_batched(backend: Any, report: dict, sizes: list[int], position: int, steps: int = 20) -> None:
    """Add `batched_decode` ([{rows, bucket, step_ms, tok_s, bytes, gb_s, frac_copy}, plus taps_step_ms]) and
    `batched_step_kernels` (the largest size's step, eager launches event-timed) to a cuda `run_bench` report. Every
    row is its own sequence in its own KV lane at `position`, with its own token (the lanes' K/V is whatever they
    hold: the cost does not depend on it); the time is the wall time of a launched and waited-for batched step
    (DecodeSteps), host staging and the token read-back included, as the server sees it. `taps_step_ms` (a build
    with the batched verify's programs, from 2 rows): the same step with the DFlash taps, as the server runs a plain
    step with a speculative sequence in it (the drafter context of every row kept current)."""
    from ...model_spec.conventions import DECODE_BUCKETS, decode_bucket
    from ..cuda.profile import distinct_tokens

    eng, spec = backend.engine, backend.spec
    taps = _has_verify_programs(eng)
    rows_out = []
    for n in sizes:  # a different token per row: routed to different experts, as a real batch is
        rows = [(lane, position, int(t), None) for lane, t in enumerate(distinct_tokens(n, spec.target.vocab_size))]
        ms = _step_ms(eng.steps, rows, steps, taps=False)
        nbytes = step_cost(spec, "decode", position + 1, n, report["kv_dtype"], report["lm_head"])["bytes"]
        gbs = nbytes / ms / 1e6
        row = {
            "rows": n,
            "bucket": decode_bucket(n),
            "step_ms": round(ms, 3),
            "tok_s": round(1e3 * n / ms, 1),
            "bytes": int(nbytes),
            "gb_s": round(gbs, 1),
            "frac_copy": round(gbs / report["copy_gb_s"], 4),
        }
        if taps and n >= 2:
            row["taps_step_ms"] = round(_step_ms(eng.steps, rows, steps, taps=True), 3)
        rows_out.append(row)
    report["batched_decode"] = rows_out
    report["batched_decode_position"] = position
    biggest = min(max(sizes), DECODE_BUCKETS[-1])  # the largest single forward
    report["batched_step_rows"] = biggest
    report["batched_step_kernels"] = _kernels(eng, biggest, position)


def _kernels(eng: Any, n: int, position: int) -> list[dict]:
    """One batched step of n rows (runtime/cuda/profile.py), summed per kernel, largest first."""
    from ..cuda.profile import per_kernel, profile_batched

    return [{**a, "us": round(a["us"], 2)} for a in per_kernel(profile_batched(eng, n, position))]


def _step_ms(steps_: Any, rows: list, count: int, taps: bool) -> float:
    """The median wall time of `count` launched and waited-for batched steps of `rows` (after capture + warm-up)."""
    for _ in range(3):
        steps_.wait(steps_.launch_batch(rows, taps=taps))
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        steps_.wait(steps_.launch_batch(rows, taps=taps))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _has_verify_programs(eng: Any) -> bool:
    """Whether the engine holds the batched verify's programs (a DFlash build): its batched steps can take the taps."""
    from ..cuda.spec_batch import batched_verify_keys

    return eng.dflash is not None and not eng.fwd.missing("speculative", *batched_verify_keys())
