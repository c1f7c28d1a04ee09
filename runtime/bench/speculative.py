"""Runtime stage: `thorgen bench --speculative [--emulate-acceptance K]`, the draft -> verify -> commit pipeline timed.

Each of `runs` greedy speculative generations of the bench's prompt is timed like plain decoding (runtime/bench/cli.py):
spec tok/s = (tokens - 1) / (last - first token), step ms = that time / verify steps, tau = the mean tokens a verify
step commits. On the cuda backend every DFlash step also records CUDA events around its draft graph and its
verify graph (DFlashSteps.timing), giving draft_step_ms and verify_step_ms, and one draft and one verify forward
are profiled per kernel.

With random weights no draft is ever accepted, so `--emulate-acceptance K` makes every verify step commit K drafts
+ 1 whatever the drafter proposed (CudaRunner.decode; the reference's Decoder.step): the work per step is a real
step's and the positions advance K + 1 a step, so tok/s is the speed at tau = K + 1. The tokens are then not the
model's; the report says so (emulated_acceptance). On the cuda engine the drafts are then also replaced by 15
different tokens a step (DFlashSteps.draft_hook): random weights make the drafter propose one token over and over (the
H200's timed verify blocks were [last, 4, 4, ..., 4] before 9f16c38), 16 rows that route alike and read fewer experts
than a block of text does (that verify graph replayed in 3.75 ms, on 16 distinct tokens in 4.04).
"""

from __future__ import annotations

import statistics
from typing import Any

from ..backend import BackendError
from ..options import DraftOptions
from .timing import timed_stream


def _dflash(backend: Any) -> Any:
    """The cuda engine's DFlash steps (their hooks), or None for the reference backend."""
    engine = getattr(backend, "engine", None)
    return None if engine is None else engine.dflash


def _emulate(backend: Any, k: int | None, timing: bool) -> None:
    """Every verify step commits `k` drafts + 1 (None: what the drafts earn); `timing`: every step drafts the
    most it may (the adaptive policy would switch a low acceptance off: the bench times speculative steps), else
    the draft policy is the default again."""
    backend.emulate_acceptance(k)
    backend.draft_options = DraftOptions(adaptive=not timing)


def measure_speculative(backend: Any, report: dict, prompt: list[int], gen: int, runs: int, accept: int | None) -> None:
    """Add `speculative` (and its headline keys verify_step_ms, draft_step_ms, tau, emulated_acceptance,
    spec_tok_s) to a run_bench report."""
    if not backend.features.speculative:
        raise BackendError("--speculative needs a checkpoint with a DFlash drafter (MODEL/dflash or --draft DIR)")
    block = backend.spec.drafter.block_size
    steps = _dflash(backend)
    _emulate(backend, accept, timing=True)
    try:
        timed_stream(backend, prompt, min(gen, 2 * block), speculative=True)  # warm-up: the DFlash graphs
        rates, step_ms, taus, timing = [], [], [], []
        for _ in range(runs):
            if steps is not None:
                steps.timing = []
            r = timed_stream(backend, prompt, gen, speculative=True)
            n, lengths = len(r["token_ids"]), r["accepted_lengths"]
            if n > 1 and r["decode_s"] > 0 and lengths:
                rates.append((n - 1) / r["decode_s"])
                step_ms.append(1e3 * r["decode_s"] / len(lengths))
                taus.append(statistics.mean(lengths))
            if steps is not None:
                timing += steps.timing
    finally:
        _emulate(backend, None, timing=False)
        if steps is not None:
            steps.timing = None
    if not rates:
        raise BackendError("the speculative runs made no verify step (raise --gen)")
    out = {
        "emulated_acceptance": accept,
        "tau": round(statistics.median(taus), 4),
        "spec_tok_s": round(statistics.median(rates), 3),
        "step_ms": round(statistics.median(step_ms), 4),
        "draft_step_ms": round(statistics.median(t[0] for t in timing), 4) if timing else None,
        "verify_step_ms": round(statistics.median(t[1] for t in timing), 4) if timing else None,
        "spec_tok_s_runs": [round(x, 3) for x in rates],
    }
    if accept is not None:
        out["note"] = f"emulated: every verify step committed {accept} drafts + 1; the tokens are not the model's"
    engine = getattr(backend, "engine", None)
    if engine is not None and "verify_step_kernels" not in report:  # (--roofline took them at this position)
        from ..cuda.profile import per_kernel, profile_speculative

        draft, verify = profile_speculative(engine, len(prompt) + gen // 2)
        report["draft_step_kernels"], report["verify_step_kernels"] = per_kernel(draft), per_kernel(verify)
    report["speculative"] = out
    report.update({k: out[k] for k in ("verify_step_ms", "draft_step_ms", "tau", "emulated_acceptance", "spec_tok_s")})
