"""Codegen stage: the vision tower's kernels — its row kernels (patch input, position tables + first norm, q/k/v
norm + 2-D RoPE, sandwich norms, the pool tail), its fp16 GEMMs and its bidirectional attention.

  vis_patch_prep__pd{PD}                     uint8 pixels v -> 2 * (v / 255 - 0.5) f16 patch rows
  vis_embed_norm__h{H}                       x += table[0][x] + table[1][y]; a = rmsnorm(x) * w (f16, pitch HP)
  vis_qkv_rope__h{NH}x{D}                    q|k|v f32 -> q, k (RMSNorm + 2-D RoPE), v (RMSNorm) bf16 [NH][DP]
  vis_sandwich__h{H}                         x += rmsnorm(y) * w_post; a = rmsnorm(x) * w_next
  vis_pool__h{H}_p{POOL}                     3x3 mean, x sqrt(H), standardize, weightless RMSNorm (fp32) -> f16
  vis_gemmL__n{N}_k{K}[_gelu]                the tower's linears on the drafter's fp16 tile engine (WeightKind HALF)
  vis_attn__h{NH}x{D}_dp{DP}                 each image's patches attending each other (scale 1, no mask, G = 1)
An encode of B images of one patch grid runs them back to back: the row kernels and GEMMs see B L rows, the attention
and the pool keep to each image's own rows.
Widths are padded to the tiles (model_spec/vision_layout.py); the GEMMs and the attention run on those.
"""

from __future__ import annotations

from functools import cache

from ...model_spec.types import ModelSpec
from ...model_spec.vision_layout import MAX_ENCODE_IMAGES, VisionDims, vision_dims
from ..arch import ArchSpec
from ..kernel_spec import KernelSpec, make_params
from ._util import ftag, require, row_grid
from .matmul import gemm_large


def _threads(width: int, arch: ArchSpec) -> int:
    """A row kernel's block: up to the arch's block size, no more warps than the row has 32-wide chunks."""
    return min(arch.threads_per_block, 32 * -(-width // 32))


def _row_kernel(name: str, template: str, width: int, arch: ArchSpec, args: tuple[str, ...], **params) -> KernelSpec:
    return KernelSpec(
        name,
        template,
        make_params(ROW_AXIS=0, **params),
        row_grid(),
        (_threads(width, arch), 1, 1),
        args=args,
        family="vision",
    )


def _eps_tag(eps: float) -> str:
    return "" if eps == 1e-6 else f"_eps{ftag(eps)}"


@cache
def patch_prep(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    return _row_kernel(
        f"vis_patch_prep__pd{d.patch_dim}", "vis_patch_prep.cu.j2", d.patch_dim, arch, ("p", "out", "T"), PD=d.patch_dim
    )


@cache
def embed_norm(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    return _row_kernel(
        f"vis_embed_norm__h{d.hidden}_hp{d.hp}_t{d.table}{_eps_tag(d.eps)}",
        "vis_embed_norm.cu.j2",
        d.hidden,
        arch,
        ("x", "table", "pos", "w", "a", "T"),
        H=d.hidden,
        HP=d.hp,
        P=d.table,
        EPS=float(d.eps),
    )


@cache
def sandwich(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    return _row_kernel(
        f"vis_sandwich__h{d.hidden}_hp{d.hp}{_eps_tag(d.eps)}",
        "vis_sandwich.cu.j2",
        d.hidden,
        arch,
        ("x", "y", "w_post", "w_next", "a", "T"),
        H=d.hidden,
        HP=d.hp,
        EPS=float(d.eps),
    )


@cache
def qkv_rope(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    require(
        32 * d.heads <= arch.max_threads_per_block, f"vision qkv_rope: {d.heads} heads, a warp each, exceed a block"
    )
    return KernelSpec(
        f"vis_qkv_rope__h{d.heads}x{d.head_dim}_dp{d.dp}_th{ftag(d.theta)}{_eps_tag(d.eps)}",
        "vis_qkv_rope.cu.j2",
        make_params(ROW_AXIS=0, NH=d.heads, D=d.head_dim, DP=d.dp, THETA=float(d.theta), EPS=float(d.eps)),
        row_grid(),
        (32 * d.heads, 1, 1),
        args=("qkv", "q_norm_w", "k_norm_w", "pos", "q", "k", "v", "T"),
        family="vision",
    )


@cache
def pool(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    return _row_kernel(
        f"vis_pool__h{d.hidden}_hp{d.hp}_p{d.pool}{_eps_tag(d.eps)}",
        "vis_pool.cu.j2",
        d.hidden,
        arch,
        ("x", "pos", "std_bias", "std_scale", "out", "T", "TI"),
        H=d.hidden,
        HP=d.hp,
        POOL=d.pool,
        EPS=float(d.eps),
        ROOT_H=float(d.hidden) ** 0.5,
    )


@cache
def gemm(n: int, k: int, epi: str, d: VisionDims, arch: ArchSpec) -> KernelSpec:
    """A tower linear [n, k] over up to max_patches rows (fp16 weights, f32 out; gelu_mul: f16 gelu(gate) * up)."""
    return gemm_large(n, k, epi, arch, kind="half", prefix="vis", family="vision", mmax=d.max_patches)


# 64 queries a block (16 a warp), key tiles of 64. H100, 9,900 patches: 215 TFLOP/s (2.33 ms a layer); 8 warps a
# block (half the blocks' K / V reads from L2) measured slower, 2.67 ms a layer (2,376 patches: 0.21 against 0.17).
ATTN_WARPS, ATTN_TK = 4, 64


@cache
def attention(d: VisionDims, arch: ArchSpec) -> KernelSpec:
    """Every patch of an image attends every other of that image (scale 1, no mask, a KV head a query head),
    flash-attention style (attn_bidir.cuh) on head_dim rounded up to the mma's k16 (72 -> 80), not to the GEMMs'
    padded width; B images back to back, one a block index on grid axis 2 (IMAGE_AXIS: the runtime launches B)."""
    dc = -(-d.head_dim // 16) * 16
    require(dc <= d.dp, f"vision attention: head_dim {d.head_dim} rounds to {dc} > padded width {d.dp}")
    smem = 2 * 2 * ATTN_TK * (dc + 8) * 2  # attn_bidir.cuh BidirSmem::BYTES
    rows = 16 * ATTN_WARPS
    return KernelSpec(
        f"vis_attn__h{d.heads}x{d.head_dim}_dp{d.dp}",
        "vis_attn.cu.j2",
        make_params(
            NH=d.heads, D=d.head_dim, DP=d.dp, DC=dc, WARPS=ATTN_WARPS, TK=ATTN_TK, ROW_GRID=(0, 1, rows), IMAGE_AXIS=2
        ),
        grid=(-(-d.max_patches // rows), d.heads, MAX_ENCODE_IMAGES),
        block=(32 * ATTN_WARPS, 1, 1),
        smem_bytes=smem,
        args=("q", "k", "v", "out", "T", "B"),
        family="vision",
    )


def vision_shapes(spec: ModelSpec) -> list[tuple[str, int, int, str]]:
    """(role, N, K, epilogue) of the tower's GEMMs on their padded widths."""
    d = vision_dims(spec)
    return [
        ("patch", d.hidden, d.patch_dim, "store"),
        ("qkv", 3 * d.hidden, d.hp, "store"),
        ("o", d.hidden, d.heads * d.dp, "store"),
        ("gate_up", 2 * d.ip, d.hp, "gelu_mul"),
        ("down", d.hidden, d.ip, "store"),
        ("projection", d.text_hidden, d.hp, "store"),
    ]
