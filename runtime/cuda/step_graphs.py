"""Runtime stage: `capture_step_graphs`, every decode, verify and draft graph a runner may replay, captured when the
runner is made, so no request waits while the first step of a new shape is captured.

Captured on first use instead, a full-size graph of ~400 kernels costs tens of milliseconds to bind, capture and
instantiate, and a server meets its shapes one at a time as traffic grows: the first request at 4, 8, 16 streams,
the first batched verify of each bucket and drafter head size, each stalled every running stream (through
`thorgen bench serve`, the first request of a new concurrency level waited 0.4-0.6 s against ~0.05 s for the next).
vLLM captures its decode graphs at start-up for the same reason.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...model_spec.conventions import DECODE_BUCKETS, MAX_BATCH, decode_bucket

if TYPE_CHECKING:
    from .runner import CudaRunner


def capture_step_graphs(runner: CudaRunner) -> tuple[int, float]:
    """Capture every step graph `runner` can replay (those already captured are kept): the one-row steps (with the
    tap ring's taps where the build keeps them), the batched steps up to its max_num_seqs, and with a drafter the
    one-sequence DFlash graphs, the batched verify steps (up to MAX_BATCH rows), the batched drafter's passes and its
    heads. Returns (graphs captured now, seconds)."""
    engine, steps = runner.engine, runner.engine.steps
    graphs = engine.launches.graphs
    before, t0 = len(graphs), time.perf_counter()
    exts = (False, True) if not engine.ext_missing else (False,)
    modes = [(greedy, ext) for greedy in (True, False) for ext in exts]
    dflash = engine.dflash
    for greedy, ext in modes:
        steps.row_graph(greedy, ext)
        if dflash is not None and dflash.ring.keeps(greedy, ext):
            steps.row_graph(greedy, ext, taps=True)
        for B in DECODE_BUCKETS[: DECODE_BUCKETS.index(decode_bucket(runner.max_num_seqs)) + 1]:
            steps.batch_graph(B, greedy, ext)
    if dflash is not None:
        dflash.graph("draft")
        for greedy in (True, False):
            dflash.graph("verify", greedy)
    batched = runner.batched
    if batched is not None:
        for greedy, ext in modes:
            for B in DECODE_BUCKETS[1:]:  # (a verify's programs start at 2 rows)
                steps.batch_graph(B, greedy, ext, taps=True)
        most = decode_bucket(max(2, min(batched.drafter.most, runner.max_num_seqs)))
        for nb in DECODE_BUCKETS[1 : DECODE_BUCKETS.index(most) + 1]:
            batched.drafter.batch_graph(nb)
        for rows in range(1, MAX_BATCH + 1):
            batched.drafter.head_graph(rows)
    return len(graphs) - before, time.perf_counter() - t0


__all__ = ["capture_step_graphs"]
