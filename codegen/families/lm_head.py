"""Codegen stage: the lm_head epilogue family — softcap fused with argmax, and seeded top-k/top-p/min-p sampling."""

from __future__ import annotations

from functools import cache

from ...model_spec.conventions import VERIFY_ROWS  # grid.y: rows at once (more loop grid-stride)
from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from ._util import ftag, require

SAMPLE_CANDIDATES = 64  # C: exact sampling while the kept set lies within the top C (Gemma's default top_k is 64)


def exact_softcap(arch: ArchSpec) -> bool:
    """fp64 tanh (bit-equal to the reference) where fp64 is fast; tanhf on the fp64-poor arches."""
    return arch.name in ("sm_90a", "sm_100a")


def vocab_chunk(V: int, cap: int = 2048) -> int:
    """The vocabulary chunk of one block: the largest power of two <= cap dividing V (at least 128)."""
    c = 1
    while c * 2 <= min(V, cap) and V % (c * 2) == 0:
        c *= 2
    require(c >= 128 and V % c == 0, f"lm_head: vocab {V} needs a power-of-two chunk >= 128 dividing it")
    return c


def chunk_threads(chunk: int) -> int:
    """Threads of the float4-per-thread chunk kernels (argmax, logits processing)."""
    return max(32, min(256, chunk // 4 // 32 * 32))


def sampler_shape(V: int, chunk: int, arch: ArchSpec) -> tuple[int, int, int]:
    """(C candidates per chunk, workspace row bytes, select stage's shared memory) of the sampler."""
    C = min(SAMPLE_CANDIDATES, chunk)
    nc = (V // chunk) * C
    require(nc & (nc - 1) == 0, f"lm_head sampler: {V // chunk} chunks x {C} candidates must be a power of two")
    require(
        nc * 8 <= arch.smem_per_block_max,
        f"lm_head sampler: {nc * 8} B of candidates exceed {arch.name}'s shared memory per block",
    )
    return C, ws_row_bytes(V, chunk, C), nc * 8


def ws_row_bytes(V: int, chunk: int, C: int) -> int:
    nch = V // chunk
    off_mode = (8 * nch * C + 16 * nch + 8 * nch + 4 * nch + 15) // 16 * 16  # doubles after it stay aligned
    return off_mode + 32


def _tag(spec: ModelSpec, arch: ArchSpec) -> str:
    t = spec.target
    return f"v{t.vocab_size}_c{ftag(float(t.final_logit_softcapping or 0.0))}" + (
        "" if exact_softcap(arch) else "_fast"
    )


@cache
def lm_argmax(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """Softcap fused with the greedy argmax of up to VERIFY_ROWS logits rows."""
    V, cap, exact = spec.target.vocab_size, float(spec.target.final_logit_softcapping or 0.0), exact_softcap(arch)
    chunk = vocab_chunk(V)
    return KernelSpec(
        f"lm_argmax__{_tag(spec, arch)}",
        "lm_argmax.cu.j2",
        make_params(V=V, CHUNK=chunk, SOFTCAP=cap, EXACT=exact, ROW_AXIS=1),
        grid=(V // chunk, VERIFY_ROWS, 1),
        block=(chunk_threads(chunk), 1, 1),
        args=("logits", "capped", "best", "counters", "out_ids", "T"),
        family="lm_head",
    )


SAMPLE_STAGES = ("prep", "select", "finish")


@cache
def lm_sample(spec: ModelSpec, arch: ArchSpec, stage: str) -> KernelSpec:
    """One stage of the seeded top-k / top-p / min-p sampler over softcapped logits (SAMPLE_STAGES, in order)."""
    V, cap, exact = spec.target.vocab_size, float(spec.target.final_logit_softcapping or 0.0), exact_softcap(arch)
    chunk = vocab_chunk(V)
    C, ws, select_smem = sampler_shape(V, chunk, arch)
    common = dict(V=V, CHUNK=chunk, C=C, SOFTCAP=cap, EXACT=exact, WS_ROW_BYTES=ws, ROW_AXIS=1)
    grid, threads, smem, args = {
        "prep": ((V // chunk, VERIFY_ROWS, 1), 512, 0, ("logits", "params", "workspace", "T")),
        "select": (
            (1, VERIFY_ROWS, 1),
            1024,
            select_smem,
            ("params", "positions", "workspace", "out_ids", "status", "T"),
        ),
        "finish": (
            (V // chunk, VERIFY_ROWS, 1),
            512,
            0,
            ("logits", "params", "positions", "workspace", "counters", "out_ids", "T"),
        ),
    }[stage]
    return KernelSpec(
        f"lm_sample_{stage}__{_tag(spec, arch)}",
        "lm_sample.cu.j2",
        make_params(STAGE=stage, **common),
        grid=grid,
        block=(min(threads, max(32, chunk)), 1, 1),
        smem_bytes=smem,
        args=args,
        family="lm_head",
    )


def bench_lm_head(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    V = spec.target.vocab_size
    k = lm_argmax(spec, arch)
    out = []
    for T in (1, 16):
        out.append(
            BenchCase(
                k,
                (
                    Buf("logits", "f32", T * V, -20, 20),
                    Buf("capped", "f32", 0),
                    Buf("best", "u64", T, 0, 0),
                    Buf("counters", "u32", T, 0, 0),
                    Buf("out_ids", "i32", T),
                    Scalar("T", "i32", T),
                ),
                bytes_moved=T * V * 4,
                grid=(k.grid[0], T, 1),
                note=f"T={T}, capped=null",
            )
        )
    return out
