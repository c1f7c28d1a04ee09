"""Runtime stage: `EngineOptions`, the CUDA engine's typed switches (each on by default; off for A/B timing)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """How the CUDA engine launches its work. Every switch keeps the engine's output the same; turning one off
    measures what it buys (docs/BENCHMARKS.md). The reference backend ignores them."""

    # programmatic dependent launch between consecutive kernels, where the kernels' convention allows it
    pdl: bool = True
    # the dense MLP on a side stream beside router + MoE (off: every launch on one stream)
    fork: bool = True
    # each decode step (batched, one-sequence or DFlash) launched before the step before it is read, its input
    # tokens carried on the device (off: each step is launched when it is scheduled)
    launch_ahead: bool = True
    # batched (rowwise) attention launches the planner's key-split count for the batch's rows (off: every planned
    # split)
    rowwise_splits: bool = True


__all__ = ["EngineOptions"]
