"""Codegen stage: the MoE router family — logits (norm, scale, bf16 projection) and softmax/top-k/renorm.

router_fused (one launch: logits, then each token's last block runs the top-k; bit-identical to the pair) is what
the decode step (one row) uses; steps of more rows use the pair router_logits + router_topk, which measured faster
at 16 rows on the H200 (graph-replayed: fused 12.7 us vs 7.2 + 4.6 us; a likely cause: the 16 tokens' counters
share a cache line), and it is the fused kernel's GPU oracle.
Up to 16 rows, router_logits: 2 warps (2 experts) a block, each warp's W row in registers, so many blocks pull the
router weight at once; every block stages and normalises its tokens' rows one at a time (~3.5 us a token).
A prefill chunk (MAX_STEP_TOKENS rows): router_logits_tiled, the logits as a small fp32 GEMM ([T, H] x [H, E], a long
K). Why: at 512 rows the per-token staging above took 116 us a layer with 2 warps a block (H200, 2026-12-01, eager:
3.5 of a 29.4 ms chunk) and 94.6 with 16 (109 graph-replayed), for 185 M FMAs; warps that read and normalise their own
rows with no barrier were slower still, 155 us (each warp re-reads every token row from L2: 740 MB a layer). The
first tiled form (each warp a K-slice of every 128-column chunk, lane 4 x 4 outputs, the warps' partials added in the
epilogue) measured 26.7 us a layer at 512 rows on the H200, but it summed every logit in another order than
router_logits, and the top-k flips an expert on near-ties: the engine's scoring pass (<= 16 / 32-row kernels) then
disagreed with its own prefill by 0.2 nats on a prompt logprob. So the tiled form now runs router_logits' exact
arithmetic (router.cuh): 256-column chunks, lane l of a warp takes columns 8l..8l+7 of each (router_logits' lane l
takes chunks l, l + 32, ... of 8 columns: the same fmaf chain), a warp owns 8 tokens x 8 experts (64 accumulators a
lane), the lanes' partials are summed in warp_sum's butterfly, and the sum of squares keeps block_sum<64>'s 64 classes
(columns mod 64) and their combination; it is bit-identical to router_logits on the same inputs (a NumPy simulation of
both in tests/test_router_order.py; the GPU test asserts it). A block: 16 tokens x 32 experts (TILE_T x TILE_E; 8
warps, 256 threads). The tile shape: at 512 rows it gives (128 / 32) x (512 / 16) = 128 blocks for the H200's 132 SMs,
and it balances the L2 re-reads (x, fp32, is read E / TILE_E times, W, bf16, T / TILE_T times; at a fixed tile area
their sum is least for TILE_E = 2 TILE_T): 23 + 23 MB a layer. FP32 FMAs only (no tensor cores). Launch: grid.y =
ceil(T / TILE_T) (ROW_GRID), grid.x = E / TILE_E. Measured on the H200 (2026-12-02, eager, in a 512-row chunk):
19.6 us a layer, against 26.7 for the first tiled form (per 256-column chunk a warp issues 512 FMAs and 24 shared
16-byte loads instead of 64, with half as many barriers)."""

from __future__ import annotations

from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import MAX_STEP_TOKENS
from ._util import ftag, require

# router_logits' token groups (a verify step's 16 tokens; a 32-row batched step loops 2 a block: 32 groups, a block
# a row, measured slower on the H200, 461 against 420 us a step)
LM_TOKENS = 16
TOPK_WARPS = 4  # router_topk: a warp a token, 4 tokens a block
TILE_T, TILE_E = 16, 32  # router_logits_tiled: tokens x experts a block (experts: at most); a warp per 8 x 8 of them
TILE_KC = 256  # its H chunk (router.cuh: 8 columns a lane, router_logits' order)
# counters: u32 [rows], zeroed once by the runtime, left zeroed by the kernel
FUSED_ARGS = ("x", "scale", "proj", "per_expert_scale", "logits", "counters", "topk_idx", "topk_w", "T")


def _warps(experts: int, most: int) -> int:
    """Warps (one expert each) a router_logits block holds: the most, up to `most`, that divide the experts."""
    return max(w for w in range(1, most + 1) if experts % w == 0)


def _eps_tag(spec: ModelSpec) -> str:
    eps = spec.target.rms_norm_eps
    return "" if eps == 1e-6 else f"_eps{ftag(eps)}"


@cache
def router_logits(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """Router logits of up to LM_TOKENS rows (loops more grid-stride), a warp an expert."""
    t = spec.target
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    require(H % 8 == 0, f"router: hidden {H} must be a multiple of 8")
    require(E <= 1024 and K <= 32, f"router: {E} experts / top-{K} exceed the kernel's limits (1024 / 32)")
    warps = _warps(E, 2)  # few warps per block: more blocks pull the router weight in parallel
    # shared memory: the scaled token row (H floats) + scratch
    require(H * 4 + 128 <= 48 * 1024, f"router: hidden {H} does not fit the static shared-memory row buffer")
    return KernelSpec(
        f"router_logits__h{H}_e{E}{_eps_tag(spec)}",
        "router_logits.cu.j2",
        make_params(H=H, E=E, EPS=float(t.rms_norm_eps), mmax=LM_TOKENS, ROW_AXIS=1),
        grid=(E // warps, LM_TOKENS, 1),
        block=(32 * warps, 1, 1),
        args=("x", "scale", "proj", "logits", "T"),
        family="router",
    )


@cache
def router_logits_tiled(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """Router logits of a prefill chunk, as a tiled fp32 GEMM with router_logits' arithmetic."""
    t = spec.target
    H, E = t.hidden_size, t.num_experts
    logits = router_logits(spec, arch)
    # the prefill chunk: tiles of TILE_T tokens x be experts (32, else the largest of 16 / 8 that divides them), a
    # warp per 8 x 8; bit-identical to `logits` only while that one runs 2 warps (block_sum<64>'s norm order)
    be = next((b for b in (TILE_E, TILE_E // 2, TILE_E // 4) if E % b == 0), None)
    require(
        be is not None and H % TILE_KC == 0 and logits.block[0] == 64,
        f"router: the tiled prefill logits need an even number of experts, a multiple of 8, and hidden a multiple"
        f" of {TILE_KC} ({E} / {H})",
    )
    # shared memory: x * scale (16 token rows of 2 x 144 floats), W (be rows of 256 bf16), the scale, the norms
    smem = TILE_T * 288 * 4 + be * TILE_KC * 2 + H * 2 + TILE_T * 65 * 4
    require(smem <= 48 * 1024, f"router: hidden {H} does not fit the tiled logits' static shared memory ({smem} B)")
    return KernelSpec(
        f"router_logits_tiled__h{H}_e{E}_m{MAX_STEP_TOKENS}{_eps_tag(spec)}",
        "router_logits_tiled.cu.j2",
        make_params(
            H=H, E=E, EPS=float(t.rms_norm_eps), BT=TILE_T, BE=be, mmax=MAX_STEP_TOKENS, ROW_GRID=(1, 1, TILE_T)
        ),
        grid=(E // be, -(-MAX_STEP_TOKENS // TILE_T), 1),
        block=(32 * (TILE_T // 8) * (be // 8), 1, 1),
        args=logits.args,
        family="router",
    )


@cache
def router_topk(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """Softmax, top-k and renormalisation of the router logits, a warp a token."""
    E, K = spec.target.num_experts, spec.target.top_k_experts
    return KernelSpec(
        f"router_topk__e{E}_k{K}",
        "router_topk.cu.j2",
        make_params(E=E, K=K, ROW_GRID=(0, 1, TOPK_WARPS)),
        grid=(-(-MAX_STEP_TOKENS // TOPK_WARPS), 1, 1),
        block=(32 * TOPK_WARPS, 1, 1),
        args=("logits", "per_expert_scale", "topk_idx", "topk_w", "T"),
        family="router",
    )


@cache
def router_fused(spec: ModelSpec, arch: ArchSpec) -> KernelSpec:
    """router_logits whose last block of each token runs its top-k (the one-row step's router, one launch)."""
    t = spec.target
    logits = router_logits(spec, arch)
    return KernelSpec(
        f"router_fused__h{t.hidden_size}_e{t.num_experts}_k{t.top_k_experts}{_eps_tag(spec)}",
        "router_fused.cu.j2",
        make_params(H=t.hidden_size, E=t.num_experts, K=t.top_k_experts, EPS=float(t.rms_norm_eps), ROW_AXIS=1),
        grid=logits.grid,
        block=logits.block,
        args=FUSED_ARGS,
        family="router",
    )


def bench_router(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    t = spec.target
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    fu, lg, tiled, tk = (f(spec, arch) for f in (router_fused, router_logits, router_logits_tiled, router_topk))
    out = []
    for T in (1, 16):
        out.append(
            BenchCase(
                fu,
                (
                    Buf("x", "f32", T * H),
                    Buf("scale", "bf16", H),
                    Buf("proj", "bf16", E * H),
                    Buf("per_expert_scale", "bf16", E),
                    Buf("logits", "f32", T * E),
                    Buf("counters", "u32", T, 0, 0),
                    Buf("topk_idx", "i32", T * K),
                    Buf("topk_w", "f32", T * K),
                    Scalar("T", "i32", T),
                ),
                bytes_moved=E * H * 2 + T * H * 4 + T * E * 4 + T * K * 8,
                grid=(fu.grid[0], T, 1),
                note=f"fused T={T}",
            )
        )
    for k, T in ((lg, 1), (lg, 16), (tiled, MAX_STEP_TOKENS)):
        # lg: grid-stride rows (min(T, grid.y) blocks on y); tiled: ceil(T / TILE_T) blocks on y (its ROW_GRID)
        gy = min(T, k.grid[1]) if k is lg else -(-T // tiled.param("BT"))
        out.append(
            BenchCase(
                k,
                (
                    Buf("x", "f32", T * H),
                    Buf("scale", "bf16", H),
                    Buf("proj", "bf16", E * H),
                    Buf("logits", "f32", T * E),
                    Scalar("T", "i32", T),
                ),
                bytes_moved=E * H * 2 + T * H * 4 + T * E * 4,
                grid=(k.grid[0], gy, 1),
                note=f"T={T}",
            )
        )
    for T in (1, 16):
        out.append(
            BenchCase(
                tk,
                (
                    Buf("logits", "f32", T * E),
                    Buf("per_expert_scale", "bf16", E),
                    Buf("topk_idx", "i32", T * K),
                    Buf("topk_w", "f32", T * K),
                    Scalar("T", "i32", T),
                ),
                bytes_moved=T * (E * 4 + K * 8),
                grid=(-(-T // TOPK_WARPS), 1, 1),
                note=f"T={T}",
            )
        )
    return out
