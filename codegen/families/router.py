"""Codegen stage: the MoE router family — logits (norm, scale, bf16 projection) and softmax/top-k/renorm.

router_fused (one launch: logits, then each token's last block runs the top-k; bit-identical to the pair) is what
the decode step (one row) uses; steps of more rows use the pair router_logits + router_topk, which measured faster
at 16 rows on the H200 (graph-replayed: fused 12.7 us vs 7.2 + 4.6 us; a likely cause: the 16 tokens' counters
share a cache line), and it is the fused kernel's GPU oracle.
router_logits comes in two blockings (param mmax: the rows it is for). Up to 16 rows: 2 warps (2 experts) a block,
so many blocks pull the router weight at once. A prefill chunk: 16 warps a block. Every block stages and
normalises each of its tokens' rows one at a time (~3.5 us a token), so at 512 rows the 2-warp blocking took 116 us
a layer (H200, 2026-12-01, eager: 3.5 of a 29.4 ms chunk) and the 16-warp one 95 (109 graph-replayed; one
block per SM fits). Tried and removed: warps that read and normalise their own rows with no barrier, 155 us (each
warp re-reads every token row from L2: 740 MB a layer at 512 rows). What would help: x tiles shared by many
experts, as in a GEMM."""

from __future__ import annotations

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ..kernel_spec import BenchCase, Buf, KernelSpec, Scalar, make_params
from . import MAX_STEP_TOKENS
from ._util import ftag, require

LM_TOKENS = 16  # grid.y token groups of router_logits (a verify step's 16 tokens)
WIDE_WARPS, WIDE_TOKENS = 16, 128  # the prefill blocking: warps (experts) a block, grid.y token groups
# counters: u32 [rows], zeroed once by the runtime, left zeroed by the kernel
FUSED_ARGS = ("x", "scale", "proj", "per_expert_scale", "logits", "counters", "topk_idx", "topk_w", "T")


def _warps(experts: int, most: int) -> int:
    """Warps (one expert each) a router_logits block holds: the most, up to `most`, that divide the experts."""
    return max(w for w in range(1, most + 1) if experts % w == 0)


def plan_router(spec: ModelSpec, arch: ArchSpec) -> list[KernelSpec]:
    t = spec.target
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    require(H % 8 == 0, f"router: hidden {H} must be a multiple of 8")
    require(E <= 1024 and K <= 32, f"router: {E} experts / top-{K} exceed the kernel's limits (1024 / 32)")
    warps = _warps(E, 2)  # few warps per block: more blocks pull the router weight in parallel
    # shared memory: the scaled token row (H floats) + scratch
    require(H * 4 + 128 <= 48 * 1024, f"router: hidden {H} does not fit the static shared-memory row buffer")
    eps_tag = "" if t.rms_norm_eps == 1e-6 else f"_eps{ftag(t.rms_norm_eps)}"
    logits = KernelSpec(f"router_logits__h{H}_e{E}{eps_tag}", "router_logits.cu.j2",
                        make_params(H=H, E=E, EPS=float(t.rms_norm_eps), mmax=LM_TOKENS, ROW_AXIS=1),
                        grid=(E // warps, LM_TOKENS, 1), block=(32 * warps, 1, 1),
                        args=("x", "scale", "proj", "logits", "T"), family="router")
    wide = _warps(E, WIDE_WARPS)
    prefill = KernelSpec(f"router_logits__h{H}_e{E}_m{MAX_STEP_TOKENS}{eps_tag}", "router_logits.cu.j2",
                         make_params(H=H, E=E, EPS=float(t.rms_norm_eps), mmax=MAX_STEP_TOKENS, ROW_AXIS=1),
                         grid=(E // wide, WIDE_TOKENS, 1), block=(32 * wide, 1, 1), args=logits.args, family="router")
    threads = max(32, (E + 31) // 32 * 32)
    topk = KernelSpec(f"router_topk__e{E}_k{K}", "router_topk.cu.j2", make_params(E=E, K=K, ROW_AXIS=0),
                      grid=(MAX_STEP_TOKENS, 1, 1), block=(threads, 1, 1),
                      args=("logits", "per_expert_scale", "topk_idx", "topk_w", "T"), family="router")
    fused = KernelSpec(f"router_fused__h{H}_e{E}_k{K}{eps_tag}", "router_fused.cu.j2",
                       make_params(H=H, E=E, K=K, EPS=float(t.rms_norm_eps), ROW_AXIS=1), grid=logits.grid,
                       block=logits.block, args=FUSED_ARGS, family="router")
    return [fused, logits, prefill, topk]


def bench_router(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    t = spec.target
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    fu, lg, wide, tk = plan_router(spec, arch)
    out = []
    for T in (1, 16):
        out.append(BenchCase(fu, (Buf("x", "f32", T * H), Buf("scale", "bf16", H), Buf("proj", "bf16", E * H),
                                  Buf("per_expert_scale", "bf16", E), Buf("logits", "f32", T * E),
                                  Buf("counters", "u32", T, 0, 0), Buf("topk_idx", "i32", T * K),
                                  Buf("topk_w", "f32", T * K), Scalar("T", "i32", T)),
                             bytes_moved=E * H * 2 + T * H * 4 + T * E * 4 + T * K * 8, grid=(fu.grid[0], T, 1),
                             note=f"fused T={T}"))
    for k, T in ((lg, 1), (lg, 16), (wide, MAX_STEP_TOKENS)):
        out.append(BenchCase(k, (Buf("x", "f32", T * H), Buf("scale", "bf16", H), Buf("proj", "bf16", E * H),
                                 Buf("logits", "f32", T * E), Scalar("T", "i32", T)),
                             bytes_moved=E * H * 2 + T * H * 4 + T * E * 4, grid=(k.grid[0], min(T, k.grid[1]), 1),
                             note=f"T={T}"))
    for T in (1, 16):
        out.append(BenchCase(tk, (Buf("logits", "f32", T * E), Buf("per_expert_scale", "bf16", E),
                                  Buf("topk_idx", "i32", T * K), Buf("topk_w", "f32", T * K), Scalar("T", "i32", T)),
                             bytes_moved=T * (E * 4 + K * 8), grid=(T, 1, 1), note=f"T={T}"))
    return out
