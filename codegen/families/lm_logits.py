"""Codegen stage: the lm_logits family — logits processing (penalties, logit_bias, grammar mask), the token pick
over processed logits, and logprobs, beside the lm_head epilogue.

A step that processes logits runs, after the lm_head GEMM: lm_process (logits -> processed, softcapped), then
lm_pick argmax, or lm_pick prep -> lm_head's lm_sample select -> lm_pick finish (select never reads logits);
a step that reports logprobs then runs lm_logprobs prep -> finish on the unprocessed logits and the picked ids.
The pick kernels are lm_head's argmax / sampler code with softcap 0, in their own template (lm_pick.cu.j2).
"""

from __future__ import annotations

import struct
from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from ._util import ftag, require
from ...model_spec.conventions import VERIFY_ROWS
from .lm_head import chunk_threads, exact_softcap, sampler_shape, vocab_chunk

TOP_LOGPROBS = 20  # TOPN: OpenAI's (and runtime.backend's MAX_TOP_LOGPROBS) most top entries per token
LOGPROB_CANDIDATES = 32  # K: per-chunk candidates of the logprobs top-N (a power of two >= TOPN)
# thorgen::LogitRow of a row without processing (r = 1, f = p = 0, no entries, mask_row -1) as 12 u32 words
PLAIN_ROW_WORDS = struct.unpack("<12I", struct.pack("<3d6i", 1.0, 0.0, 0.0, 0, 0, 0, 0, -1, 0))


def logprobs_shape(V: int, chunk: int) -> tuple[int, int]:
    """(workspace row bytes, finish stage's shared memory) of the logprobs kernels (thorgen::LmLogprobs)."""
    nch = V // chunk
    nc = nch * LOGPROB_CANDIDATES
    ncp = 1
    while ncp < nc:
        ncp *= 2
    return 8 * nc + 16 * nch, 8 * ncp


def _tags(spec: ModelSpec, arch: ArchSpec) -> tuple[str, str]:
    """(tag of the softcapping kernels, tag of the pick kernels, which see processed logits: no softcap)."""
    V, fast = spec.target.vocab_size, "" if exact_softcap(arch) else "_fast"
    return f"v{V}_c{ftag(float(spec.target.final_logit_softcapping or 0.0))}{fast}", f"v{V}{fast}"


@cache
def lm_process(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """Penalties, logit_bias and the grammar mask over up to VERIFY_ROWS rows -> processed, softcapped logits."""
    V, cap = spec.target.vocab_size, float(spec.target.final_logit_softcapping or 0.0)
    chunk = vocab_chunk(V)
    require(V % 32 == 0, f"lm_logits: vocab {V} must be a multiple of 32 (grammar mask words)")
    return KernelSpec(
        f"lm_process__{_tags(spec, arch)[0]}",
        "lm_process.cu.j2",
        make_params(V=V, CHUNK=chunk, SOFTCAP=cap, EXACT=exact_softcap(arch), ROW_AXIS=1),
        grid=(V // chunk, VERIFY_ROWS, 1),
        block=(chunk_threads(chunk), 1, 1),
        args=("logits", "rows", "counts", "biases", "masks", "out", "counters", "status", "T"),
        family="lm_logits",
    )


@cache
def lm_pick(spec: ModelSpec, arch: ArchSpec, stage: str) -> KernelSpec:
    """A pick over processed logits: "argmax", or the sampler's "prep" / "finish" (lm_head's select between)."""
    V = spec.target.vocab_size
    chunk = vocab_chunk(V)
    C, ws, _ = sampler_shape(V, chunk, arch)
    pick = dict(V=V, CHUNK=chunk, C=C, EXACT=exact_softcap(arch), WS_ROW_BYTES=ws, ROW_AXIS=1)
    threads, args = {
        "argmax": (chunk_threads(chunk), ("logits", "best", "counters", "out_ids", "T")),
        "prep": (512, ("logits", "params", "workspace", "T")),
        "finish": (512, ("logits", "params", "positions", "workspace", "counters", "out_ids", "T")),
    }[stage]
    return KernelSpec(
        f"lm_pick_{stage}__{_tags(spec, arch)[1]}",
        "lm_pick.cu.j2",
        make_params(STAGE=stage, **pick),
        grid=(V // chunk, VERIFY_ROWS, 1),
        block=(min(threads, max(32, chunk)), 1, 1),
        args=args,
        family="lm_logits",
    )


@cache
def lm_logprobs(spec: ModelSpec, arch: ArchSpec, stage: str) -> KernelSpec:
    """A stage ("prep", "finish") of each row's top-TOP_LOGPROBS logprobs and the picked token's logprob."""
    V, cap = spec.target.vocab_size, float(spec.target.final_logit_softcapping or 0.0)
    chunk = vocab_chunk(V)
    lp_ws, finish_smem = logprobs_shape(V, chunk)
    require(
        finish_smem <= arch.smem_per_block_max,
        f"lm_logits: {finish_smem} B of logprob candidates exceed {arch.name}'s shared memory per block",
    )
    lp = dict(
        V=V,
        CHUNK=chunk,
        K=LOGPROB_CANDIDATES,
        TOPN=TOP_LOGPROBS,
        SOFTCAP=cap,
        EXACT=exact_softcap(arch),
        WS_ROW_BYTES=lp_ws,
        SMEM_FINISH=finish_smem,
        ROW_AXIS=1,
    )
    name = f"lm_logprobs_{stage}__{_tags(spec, arch)[0]}"
    if stage == "prep":
        return KernelSpec(
            name,
            "lm_logprobs.cu.j2",
            make_params(STAGE=stage, **lp),
            grid=(V // chunk, VERIFY_ROWS, 1),
            block=(min(512, chunk), 1, 1),
            args=("logits", "workspace", "T"),
            family="lm_logits",
        )
    return KernelSpec(
        name,
        "lm_logprobs.cu.j2",
        make_params(STAGE=stage, **lp),
        grid=(1, VERIFY_ROWS, 1),
        block=(min(1024, max(32, finish_smem // 16)), 1, 1),
        smem_bytes=finish_smem,
        args=("logits", "workspace", "out_ids", "top_ids", "top_lps", "chosen_lp", "T"),
        family="lm_logits",
    )


def bench_lm_logits(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    """lm_process over plain rows (softcap only: no entries, no mask): the full-vocabulary read + write."""
    V = spec.target.vocab_size
    k = lm_process(spec, arch)
    out = []
    for T in (1, 16):
        words = PLAIN_ROW_WORDS * T
        out.append(
            BenchCase(
                k,
                (
                    Buf("logits", "f32", T * V, -20, 20),
                    Buf("rows", "u32", len(words), values=words),
                    Buf("counts", "u32", 2),
                    Buf("biases", "u32", 4),
                    Buf("masks", "u32", 0),
                    Buf("out", "f32", T * V),
                    Buf("counters", "u32", 2 * T, 0, 0),
                    Buf("status", "i32", T),
                    Scalar("T", "i32", T),
                ),
                bytes_moved=2 * T * V * 4,
                grid=(k.grid[0], T, 1),
                note=f"T={T}, plain rows",
            )
        )
    return out
