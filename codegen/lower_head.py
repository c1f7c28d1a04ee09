"""Codegen stage: the model's head lowered to launches (lm_head, then argmax or the sampler, or the logits
processing, the processed pick and the logprobs), for the forwards of codegen/lower.py and codegen/lower_draft.py."""

from __future__ import annotations

from typing import Protocol

from ..model_spec.step_program import Op
from ..model_spec.types import ModelSpec
from .arch import ArchSpec
from .families import lm_head, lm_logits
from .kernel_spec import KernelSpec
from .symbols import NULL, Sym, Symbols


class Lowering(Protocol):
    """What the head's lowering reads of a forward's (codegen/lower.py's Lower): its model, arch, row capacity and
    symbols, its kernel ledger (`use`) and its launch of a stored matrix's GEMM (`gemm_op`)."""

    spec: ModelSpec
    arch: ArchSpec
    max_rows: int
    ptr: Symbols

    def use(self, kernel: KernelSpec, what: str) -> KernelSpec: ...

    def gemm_op(
        self,
        label: str,
        base: str,
        n: int,
        k: int,
        rows: int,
        x: Sym,
        y: Sym,
        epi: str = "store",
        batched: bool = False,
    ) -> Op: ...


def head_ops(
    low: Lowering, x: Sym, n: int, out_ids: Sym, greedy: bool = True, r0: int = 0, ext: bool = False
) -> list[Op]:
    """lm_head over n rows of x, then argmax (or the sampler with params[r0..], at positions[max_rows+r0..])
    into out_ids[0..n). `ext` (requests with penalties, logit_bias, a grammar or logprobs): lm_process first
    writes each row's processed, softcapped logits (logit_rows[r0..] say how) that the lm_pick kernels pick
    from, and lm_logprobs then writes each row's top-20 and picked-token logprobs from the unprocessed ones."""
    t, A = low.spec.target, low.ptr.A
    ops = [low.gemm_op("lm_head", "lm_head", t.vocab_size, t.hidden_size, n, x, A("logits"))]
    if ext:
        return ops + _ext_head_ops(low, n, out_ids, greedy, r0)
    return ops + pick_ops(low, n, A("logits"), out_ids, greedy, r0)


def pick_ops(low: Lowering, n: int, logits: Sym, out_ids: Sym, greedy: bool, r0: int) -> list[Op]:
    """Argmax (or the sampler with params[r0..], at positions[max_rows+r0..]) of the n logits rows from
    `logits` into out_ids[0..n)."""
    A = low.ptr.A
    if greedy:
        am = low.use(lm_head.lm_argmax(low.spec, low.arch), "greedy argmax")
        return [
            Op(
                "argmax",
                am,
                dict(logits=logits, capped=NULL, best=A("best"), counters=A("counters"), out_ids=out_ids, T=n),
                n,
            )
        ]
    common = dict(
        logits=logits,
        params=A("params", r0),
        positions=A("positions", low.max_rows + r0),
        workspace=A("workspace"),
        counters=A("counters"),
        out_ids=out_ids,
        status=A("status", r0),
        T=n,
    )
    ops = []
    for stage in ("prep", "select", "finish"):
        k = low.use(lm_head.lm_sample(low.spec, low.arch, stage), f"sampler {stage}")
        ops.append(Op(f"sample_{stage}", k, {a: common[a] for a in k.args if a in common}, n))
    return ops


def _ext_head_ops(low: Lowering, n: int, out_ids: Sym, greedy: bool, r0: int) -> list[Op]:
    A = low.ptr.A
    proc = low.use(lm_logits.lm_process(low.spec, low.arch), "logits processing")
    ops = [
        Op(
            "lm_process",
            proc,
            dict(
                logits=A("logits"),
                rows=A("logit_rows", r0),
                counts=A("logit_counts"),
                biases=A("logit_biases"),
                masks=A("logit_masks"),
                out=A("processed"),
                counters=A("proc_counters"),
                status=A("proc_status", r0),
                T=n,
            ),
            n,
        )
    ]
    common = dict(
        logits=A("processed"),
        params=A("params", r0),
        positions=A("positions", low.max_rows + r0),
        workspace=A("workspace"),
        counters=A("counters"),
        out_ids=out_ids,
        best=A("best"),
        status=A("status", r0),
        T=n,
    )
    pick, sample = lm_logits.lm_pick, lm_head.lm_sample  # (select never reads the logits: the sampler's)
    stages = [(pick, "argmax")] if greedy else [(pick, "prep"), (sample, "select"), (pick, "finish")]
    for kernel, stage in stages:
        k = low.use(kernel(low.spec, low.arch, stage), f"processed pick {stage}")
        ops.append(Op(f"pick_{stage}", k, {a: common[a] for a in k.args}, n))
    return ops + logprobs_ops(low, n, out_ids, r0)


def logprobs_ops(low: Lowering, n: int, out_ids: Sym, r0: int) -> list[Op]:
    """Each row's top-20 logprobs of the softcapped logits, and the logprob of the id in out_ids[row]."""
    A, ops = low.ptr.A, []
    lp = dict(
        logits=A("logits"),
        workspace=A("workspace"),
        out_ids=out_ids,
        top_ids=A("lp_ids", r0),
        top_lps=A("lp_lps", r0),
        chosen_lp=A("lp_chosen", r0),
        T=n,
    )
    for stage in ("prep", "finish"):
        k = low.use(lm_logits.lm_logprobs(low.spec, low.arch, stage), f"logprobs {stage}")
        ops.append(Op(f"logprobs_{stage}", k, {a: lp[a] for a in k.args}, n))
    return ops
