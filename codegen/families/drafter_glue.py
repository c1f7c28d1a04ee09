"""Codegen stage: DFlash drafter glue — the block embedding [last token, mask x (B-1)] built on the device, and the
acceptance of a verify step on the device (spec_accept: the next step's block, so the host can launch it ahead).

The rest of the drafter glue reuses other families: the DFlash taps are written by the target's ffn_tail kernel
(tap pointer), the context `fc` is a bf16 GEMM (drafter_gemm family) and `hidden_norm` is the rmsnorm kernel.
"""

from __future__ import annotations

from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ..kernel_spec import KernelSpec, make_params
from .embedding import OUT_DTYPE


@cache
def block_embed(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """The draft blocks' embedding (the target's table): each block of block_size rows its last token's row, then
    the mask token's rows (a batched draft step runs several blocks)."""
    d, H, V = spec.drafter, spec.target.hidden_size, spec.target.vocab_size
    threads = min(arch.threads_per_block, max(32, (H // 8 + 31) // 32 * 32))
    return KernelSpec(
        f"dflash_block_embed__v{V}_h{H}_m{d.mask_token_id}_b{d.block_size}",
        "embed.cu.j2",
        make_params(
            H=H, V=V, SCALE=float(d.embed_scale), OUT=OUT_DTYPE, MASK_ID=d.mask_token_id, BLOCK=d.block_size, ROW_AXIS=0
        ),
        grid=(d.block_size, 1, 1),
        block=(threads, 1, 1),
        args=("ids", "table", "out", "T"),
        family="drafter_glue",
    )


@cache
def accept(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """The acceptance of a verify step on the device (the next step's block from the verified tokens)."""
    B = spec.drafter.block_size
    return KernelSpec(
        f"dflash_accept__b{B}",
        "spec_accept.cu.j2",
        make_params(B=B),
        grid=(1, 1, 1),
        block=(32, 1, 1),
        args=("ids", "out_ids", "positions", "sampled", "rule", "accepted"),
        family="drafter_glue",
    )
