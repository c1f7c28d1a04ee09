"""Codegen stage: the attention-prologue family — Q/K norm + RoPE + V norm + KV-cache write, per layer kind.

rope_kv__{role}_d{D}_...         any rows: a block per token, a warp per head unit (reads the q|k|v GEMM rows)
nvfp4_gemv__n{N}_k{K}_rope__...  one row (decode): the q|k|v GEMV whose last block of each head runs that head's
                                 rope_kv warp (thorgen/rope.cuh RopeKv::unit: the same bits; one launch a layer
                                 fewer on the decode critical path); half_gemv__... for bf16 attention weights
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import KV_DTYPES, KV_PAGE, MAX_STEP_TOKENS, Q_DTYPE, page_pitch, ring_slots
from ._util import ftag, require
from .matmul import layout_bytes, target_gemm, weight_bufs

# q_stride / kv_stride: floats between two tokens' q (k, v) inputs (the target passes its fused q|k|v row width)
ARGS = (
    "q_raw",
    "k_raw",
    "v_raw",
    "q_norm_w",
    "k_norm_w",
    "positions",
    "q_out",
    "k_cache",
    "v_cache",
    "lanes",
    "lane_bytes",
    "pages",
    "q_stride",
    "kv_stride",
    "T",
)
# the folded GEMV's arguments after the GEMM's (matmul.gemm_args; y: the q|k|v row; counters: a u32 a head, zero at
# entry, left zeroed)
FOLD_ARGS = (
    "q_norm_w",
    "k_norm_w",
    "positions",
    "q_out",
    "k_cache",
    "v_cache",
    "lanes",
    "lane_bytes",
    "pages",
    "counters",
)
DRAFTER_KV_DTYPE = "bf16"  # the drafter is precision-sensitive (seed ledger: quantizing it lost acceptance)


@cache
def rope_kv_kernel(
    role: str,
    *,
    HQ: int,
    HKV: int,
    D: int,
    rot: int,
    theta: float,
    slots: int,
    has_q: bool,
    v_from_k: bool,
    v_norm: bool,
    kv: str,
    eps: float,
    arch: ArchSpec,
    page: int = 0,
    pitch: int = 0,
) -> KernelSpec:
    """slots > 0: a ring cache; page > 0: a paged one (pitch page-table entries a sequence); else linear."""
    require(D % 64 == 0, f"rope_kv {role}: head_dim {D} must be a multiple of 64")
    require(0 <= rot <= D // 2, f"rope_kv {role}: {rot} rotating pairs out of range for head_dim {D}")
    require(not (page and slots) and bool(page) == bool(pitch), f"rope_kv {role}: a paged cache is not a ring")
    units = (HQ if has_q else 0) + 2 * HKV
    # a warp a head unit (up to 32): a decode step's one block then runs every head at once, where 8 warps ran the
    # target's 32 units in 4 rounds of load -> norm -> RoPE -> store
    warps = max(1, min(32, units))
    cache = f"ring{slots}" if slots else f"p{page}" if page else "lin"
    name = f"rope_kv__{role}_d{D}_q{HQ if has_q else 0}_kv{HKV}_r{rot}_t{ftag(theta)}_{cache}_{kv}"
    return KernelSpec(
        name,
        "rope_kv.cu.j2",
        make_params(
            HQ=HQ,
            HKV=HKV,
            D=D,
            ROT=rot,
            THETA=float(theta),
            SLOTS=slots,
            PAGE=page,
            PITCH=pitch,
            HAS_Q=has_q,
            V_FROM_K=v_from_k,
            V_NORM=v_norm,
            KV=kv,
            Q=Q_DTYPE,
            EPS=float(eps),
            ROW_AXIS=0,
        ),
        grid=(MAX_STEP_TOKENS, 1, 1),
        block=(32 * warps, 1, 1),
        args=ARGS,
        family="rope_kv",
    )


def gemv_rope_kv(rope: KernelSpec, k: int, arch: ArchSpec, fmt: str = "nvfp4") -> KernelSpec:
    """The M = 1 q|k|v GEMV (the plain one's knobs, weights stored as `fmt`) folded with the target rope_kv kernel
    `rope` (K = hidden size): each head's rows come from D / 16 blocks, and the last of them to finish runs
    rope_kv's warp for the head."""
    p = rope.param_dict
    n = (p["HQ"] + p["HKV"] * (1 if p["V_FROM_K"] else 2)) * p["D"]
    plain = target_gemm(n, k, 1, "store", arch, fmt)
    require(p["D"] % (16 * plain.param("un")) == 0, f"{rope.name}: a block would straddle two heads")
    rope_params = {key: v for key, v in p.items() if key != "ROW_AXIS"}
    return replace(
        plain,
        name=f"{plain.name}_rope__{rope.name.removeprefix('rope_kv__')}",
        params=make_params(**dict(plain.param_dict, epi="rope_kv"), **rope_params),
        args=plain.args + FOLD_ARGS,
        family="rope_kv",
    )


def _rot(rope, D: int) -> int:
    return D // 2 if rope.rope_type == "default" else int(rope.partial_rotary_factor * D // 2)


@cache
def target_rope_kv(spec: ModelSpec, arch: ArchSpec, layer: int, kv: str) -> KernelSpec:
    """rope_kv of target layer `layer` with a `kv` cache: sliding layers write their ring, full layers their pages."""
    t = spec.target
    D, rope, window = t.layer_head_dim(layer), t.layer_rope(layer), t.layer_window(layer) or 0
    page = 0 if window else KV_PAGE  # the full layers are paged
    return rope_kv_kernel(
        "tgt_" + t.layer_types[layer][0],
        HQ=t.num_attention_heads,
        HKV=t.layer_kv_heads(layer),
        D=D,
        rot=_rot(rope, D),
        theta=rope.rope_theta,
        slots=ring_slots(window) if window else 0,
        has_q=True,
        v_from_k=not t.layer_has_v_proj(layer),
        v_norm=True,
        kv=kv,
        eps=t.rms_norm_eps,
        arch=arch,
        page=page,
        pitch=page_pitch(t.max_position_embeddings) if page else 0,
    )


@cache
def target_gemv_rope_kv(spec: ModelSpec, arch: ArchSpec, layer: int, kv: str) -> KernelSpec:
    """The one-row q|k|v GEMV of target layer `layer` with its rope_kv folded in."""
    return gemv_rope_kv(
        target_rope_kv(spec, arch, layer, kv), spec.target.hidden_size, arch, spec.linear_formats.attention
    )


@cache
def drafter_rope_kv(spec: ModelSpec, arch: ArchSpec, layer: int, has_q: bool) -> KernelSpec:
    """rope_kv of drafter layer `layer`: the block's (queries and K/V, `has_q`) or the context's (K/V only)."""
    d = spec.drafter
    window = d.layer_window(layer) or 0
    return rope_kv_kernel(
        ("dblk_" if has_q else "dctx_") + d.layer_types[layer][0],
        HQ=d.num_attention_heads,
        HKV=d.num_key_value_heads,
        D=d.head_dim,
        rot=d.head_dim // 2,
        theta=d.rope_theta,
        slots=ring_slots(window) if window else 0,
        has_q=has_q,
        v_from_k=False,
        v_norm=False,
        kv=DRAFTER_KV_DTYPE,
        eps=d.rms_norm_eps,
        arch=arch,
    )


def first_layers(layer_types) -> list[int]:
    """The first layer of each layer kind, in layer order (the kernels' shapes follow the kind)."""
    return [layer_types.index(kind) for kind in dict.fromkeys(layer_types)]


def bench_rope_kv(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    out = []
    T = 16
    for k in (target_rope_kv(spec, arch, l, kv) for l in first_layers(spec.target.layer_types) for kv in KV_DTYPES):
        p = k.param_dict
        HQ, HKV, D = p["HQ"], p["HKV"], p["D"]
        slots = p["SLOTS"] or 4096
        kvb = 2 if p["KV"] == "bf16" else 1
        # a paged cache: the identity page table (one sequence on the pool's first pages)
        pages = (
            Buf("pages", "i32", p["PITCH"], values=tuple(range(p["PITCH"]))) if p["PAGE"] else Buf("pages", "i32", 0)
        )
        args = (
            Buf("q_raw", "f32", T * HQ * D),
            Buf("k_raw", "f32", T * HKV * D),
            Buf("v_raw", "f32", T * HKV * D),
            Buf("q_norm_w", "bf16", D),
            Buf("k_norm_w", "bf16", D),
            Buf("positions", "i32", T, 0, slots - 1),
            Buf("q_out", "bf16", T * HQ * D),
            Buf("k_cache", "u8", slots * HKV * D * kvb),
            Buf("v_cache", "u8", slots * HKV * D * kvb),
            Buf("lanes", "i32", 0),
            Scalar("lane_bytes", "i64", 0),
            pages,
            Scalar("q_stride", "i32", HQ * D),
            Scalar("kv_stride", "i32", HKV * D),
            Scalar("T", "i32", T),
        )
        nbytes = T * D * (HQ * (4 + 2) + HKV * (8 if not p["V_FROM_K"] else 4) + 2 * HKV * kvb)
        out.append(BenchCase(k, args, bytes_moved=nbytes, grid=(T, 1, 1), note="T=16"))
    out += [
        gemv_rope_kv_bench_case(target_gemv_rope_kv(spec, arch, l, kv))
        for l in first_layers(spec.target.layer_types)
        for kv in KV_DTYPES
    ]
    return out


def gemv_rope_kv_bench_case(kern: KernelSpec) -> BenchCase:
    """One decode step's q|k|v GEMV with rope_kv folded in: the weight, the row in, the q|k|v row out (read back
    from L2 by each head's last block), q and the step's K / V written (one position of a ring or paged cache)."""
    p = kern.param_dict
    n, k, HQ, HKV, D = p["n"], p["k"], p["HQ"], p["HKV"], p["D"]
    slots, kvb = p["SLOTS"] or 4096, 2 if p["KV"] == "bf16" else 1
    pages = Buf("pages", "i32", p["PITCH"], values=tuple(range(p["PITCH"]))) if p["PAGE"] else Buf("pages", "i32", 0)
    args = (
        *weight_bufs(p["kind"], n, k),
        Buf("x", "f16", k),
        Buf("y", "f32", n),
        Scalar("m", "i32", 1),
        Buf("q_norm_w", "bf16", D, 0.5, 1.5),
        Buf("k_norm_w", "bf16", D, 0.5, 1.5),
        Buf("positions", "i32", 1, 0, slots - 1),
        Buf("q_out", p["Q"], HQ * D),
        Buf("k_cache", "u8", slots * HKV * D * kvb),
        Buf("v_cache", "u8", slots * HKV * D * kvb),
        Buf("lanes", "i32", 0),
        Scalar("lane_bytes", "i64", 0),
        pages,
        Buf("counters", "u32", n // D, 0, 0),
    )
    nbytes = layout_bytes(p["kind"], n, k) + 2 * k + 4 * n + 2 * HQ * D + 2 * HKV * D * kvb
    return BenchCase(kern, args, bytes_moved=nbytes, note="M=1 + rope_kv", weight_streaming=True)
