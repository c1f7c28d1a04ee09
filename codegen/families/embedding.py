"""Codegen stage: the embedding family — token rows of the bf16 table times the embedding scale."""

from __future__ import annotations

import math
from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from ._util import ftag, row_grid

# The residual stream is fp32, so the embedding writes fp32 rows (the scale is applied in fp32, like the NumPy
# reference: table row (bf16 -> f32) * float32(scale)). The bf16-output variant exists for callers that want it.
OUT_DTYPE = "f32"


def embed_kernel(H: int, V: int, scale: float, out: str, arch: ArchSpec) -> KernelSpec:
    threads = min(arch.threads_per_block, max(32, (H // 8 + 31) // 32 * 32))
    suffix = "" if math.isclose(scale, H**0.5, rel_tol=0, abs_tol=0) else f"_s{ftag(scale)}"
    return KernelSpec(
        name=f"embed__v{V}_h{H}_{out}{suffix}",
        template="embed.cu.j2",
        params=make_params(H=H, V=V, SCALE=float(scale), OUT=out, MASK_ID=-1, ROW_AXIS=0),
        grid=row_grid(),
        block=(threads, 1, 1),
        args=("ids", "table", "out", "T"),
        family="embedding",
    )


@cache
def target_embed(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """The target's token embedding (the drafter's block embedding is drafter_glue's)."""
    t = spec.target
    return embed_kernel(t.hidden_size, t.vocab_size, t.embed_scale, OUT_DTYPE, arch)


def bench_embedding(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    k = target_embed(spec, arch)
    T, H = 16, spec.target.hidden_size
    return [
        BenchCase(
            k,
            (
                Buf("ids", "i32", T, 0, spec.target.vocab_size),
                Buf("table", "bf16", spec.target.vocab_size * H),
                Buf("out", "f32", T * H),
                Scalar("T", "i32", T),
            ),
            bytes_moved=T * H * (2 + 4),
            grid=(T, 1, 1),
            note="T=16",
        )
    ]
