"""Codegen stage: the target-linear matrix family (NVFP4 W4A16 or fp16-weight) — decode GEMV (M = 1), verify and
batched-decode GEMMs (M <= 16, M <= 32), prefill GEMM.

The kernels the step programs launch for the target's linears, on the t16x64 weight layout
(model_spec/weight_layout.py, packed by runtime/convert/layouts.py):
  nvfp4_gemv__n{N}_k{K}[_gelu]   M = 1      grid N/16 units, KS warps split K (bytes in flight: KS * PF * 512 B);
                                            "swap" form: weights are the 16-row mma A operand (half the mma count);
                                            its first weights load before griddepcontrol.wait, the warp's whole K
                                            slice where it fits in registers (codegen/gemv_prologue.py)
  nvfp4_gemv__n{H}_k{K}_attn_tail M = 1     the o_proj GEMV with Gemma's attention tail folded in: its last block
                                            runs attn_tail on the row (bit-identical; one launch a layer fewer)
  nvfp4_gemm16__n{N}_k{K}[_gelu] M <= 16    same, 16 tensor-core rows, each weight byte read once for all rows
  nvfp4_gemm32__n{N}_k{K}[_gelu] M <= 32    same, two 16-row tiles on each decoded weight step (batched decode of
                                            17..32 sequences, its lm_head included: one pass over the 416 MB)
  nvfp4_gemmL__n{N}_k{K}[_gelu]  any M      prefill: BM-row blocks, A tiles through shared memory; on sm_90a
                                            (N % 128 == 0) warpgroup MMAs over 128 x 128 tiles (gemm_wgmma.cuh)
Shapes: the fused q|k|v of each layer kind (one launch, per-projection scales in the per-tile gscale; its one-row
GEMV folds rope_kv in: rope_kv.py), o of each kind, dense gate|up (fused, GELU-tanh epilogue -> f16) and down, and
the tied lm_head (f32 logits; one row, 16 or 32: prefill needs the last position's logits only).
A linear whose checkpoint format is bf16 (ModelSpec.linear_formats) runs the same kernels with WeightKind HALF: fp16
weights (bf16 converted once at repack, runtime/convert/linears.py) in the step-major half layout, named
half_gemv__, half_gemm16__, half_gemm32__, half_gemmL__ (args w, x, y, m: no scales), with the same fused
epilogues (gelu, the attention tail, rope_kv). Their prefill GEMM runs mma.sync, except the vision tower's: on
sm_90a those take the warpgroup form (the fp16 weights copied into its stages with the tokens, no decode).
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import cache

from ...model_spec.conventions import MAX_BATCH
from ...model_spec.weight_layout import TILE_K, TILE_N, W_LAYOUT, fits_tile, fp4_order_for, nvfp4_sizes, tile_params
from ...model_spec.types import FULL, SLIDING, ModelSpec
from ..arch import ArchSpec
from ..gemv_prologue import planned_gemv
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import ACT_DTYPE, GEMM_OUT_DTYPE, MAX_STEP_TOKENS
from ._util import require
from .norms import attn_tail_kernel

GEMM_ARGS = ("w", "s", "gscale", "x", "y", "m")
HALF_GEMM_ARGS = ("w", "x", "y", "m")  # fp16 weights: no block scales, no tile factors
WEIGHT_PREFIX = {"nvfp4": "nvfp4", "bf16": "half"}  # kernel-name prefix of a target linear by checkpoint format
# attn_tail: the GEMM part stores o as "store" does; the template adds the tail (gemv_attn_tail)
EPI_ENUM = {"store": "EPI_STORE", "gelu_mul": "EPI_GELU_MUL", "silu_mul": "EPI_SILU_MUL", "attn_tail": "EPI_STORE"}
EPI_TAG = {"store": "", "gelu_mul": "_gelu", "silu_mul": "_silu", "attn_tail": "_attn_tail"}
TAIL_ARGS = ("resid", "w_post", "w_pre1", "w_pre2", "a1", "a2", "counters")  # after GEMM_ARGS (resid: the residual x)
LARGE_BM, LARGE_STAGES = 64, 3
LARGE_PITCH = TILE_K + 8  # halves a shared-memory activation row holds (LargeSmem::PITCH): a step, padded by 8
# sm_90a prefill (gemm_wgmma.cuh): 128 tokens x 128 weight rows a block, 8 warps, 6 stages of 32 KB, 4 raw weight
# steps in flight a warp. H200 sweep at 512 rows (stages 3-6 x prefetch 2-8): 6 stages 5 % faster than 4 on every
# shape (q|k|v n8192: 63.3 vs 66.9 us), 3 stages 40 % slower; the prefetch depth within noise
WGMMA_BM, WGMMA_BN, WGMMA_STAGES, WGMMA_PF, WGMMA_WARPS = 128, 128, 6, 4, 8
SMALL_MAX_ROWS = MAX_BATCH  # the weight-streaming kernels' largest row count (two 16-row tensor-core tiles)


def fp4_order(arch: ArchSpec) -> str:
    """Byte order of the NVFP4 layout for `arch` (model_spec/weight_layout.py)."""
    return fp4_order_for(arch.name)


def weight_kind(fmt: str, arch: ArchSpec) -> str:
    """The kernels' weight kind of a linear stored in checkpoint format `fmt`: the arch's fp4 byte order for nvfp4,
    "half" for bf16 (fp16 weights)."""
    require(fmt in WEIGHT_PREFIX, f"linear format {fmt!r}: expected one of {tuple(WEIGHT_PREFIX)}")
    return "half" if fmt == "bf16" else fp4_order(arch)


def gemm_args(kind: str) -> tuple[str, ...]:
    """The GEMM kernels' leading arguments for weight kind `kind`."""
    return HALF_GEMM_ARGS if kind == "half" else GEMM_ARGS


def weight_args(args: tuple[str, ...], kind: str) -> tuple[str, ...]:
    """A weight-streaming kernel's arguments for weight kind `kind`: fp16 weights have no block scales ("s") and no
    per-tile factors ("gscale")."""
    return tuple(a for a in args if kind != "half" or a not in ("s", "gscale"))


def kind_enum(kind: str) -> str:
    return {"shift": "FP4_SHIFT", "nat": "FP4_NAT", "half": "HALF"}[kind]


def target_warps(arch: ArchSpec) -> int:
    """Resident warps to aim for in a weight-streaming launch. Measured on the H200 (ncu, lm_head GEMV): these
    kernels are latency-bound by occupancy, so many warps with a shallow prefetch beat few deep ones
    (1 warp/block, PF 8: 18 warps/SM, 2.2 TB/s; 2 warps/block, PF 4: 3.2 TB/s)."""
    return 24 * arch.sm_count


def split_k(units: int, steps: int, arch: ArchSpec, blocks_per_unit: int = 1) -> int:
    """Warps per block splitting K: fill the machine, at least 2 (1-warp blocks hit the 32 blocks/SM limit)."""
    ks = math.ceil(target_warps(arch) / max(1, units * blocks_per_unit))
    return max(min(2, steps), min(16, steps, ks))


# Registers a thread of the fp16-weight (drafter) small GEMM holds, about: 4 steps of 16 x 64 fp16 weights in flight
# (16 registers each) and the tensor-core operands; ptxas reports 122-124 on sm_90a.
HALF_REGS = 128


def half_split_k(units: int, steps: int, arch: ArchSpec) -> int:
    """Warps per block of the fp16-weight small GEMM: the most (a power of two, at most 16) with which every block is
    resident at once, 65536 registers an SM at HALF_REGS a thread. target_warps' 24 warps an SM do not fit at these
    registers, so split_k's 16 warps a block over 176 units ran in two waves, the second on a third of the SMs (ncu,
    H200: the drafter's n2816 GEMMs at 31-33 % of DRAM peak, SMs busy 62 % of the kernel)."""
    resident = arch.sm_count * (65536 // (32 * HALF_REGS))  # warps
    ks = 1 << max(0, (resident // max(1, units)).bit_length() - 1)
    return max(min(2, steps), min(16, steps, ks))


def prefetch(steps_per_warp: int, arch: ArchSpec) -> int:
    """Software prefetch depth in 512-B steps (arch default; never past the warp's steps)."""
    return max(1, min(arch.prefetch_depth, steps_per_warp))


def check_shape(what: str, n: int, k: int) -> None:
    require(
        fits_tile(n, k),
        f"{what}: weight [{n} x {k}] does not fit the {W_LAYOUT} layout (N % {TILE_N} == 0 and "
        f"K % {TILE_K} == 0 needed)",
    )


def weight_bytes(n: int, k: int) -> int:
    """NVFP4 bytes of an [n, k] weight: packed codes + e4m3 scales + per-tile f32 global scales."""
    codes, scales, tiles = nvfp4_sizes(n, k)
    return codes + scales + 4 * tiles


def _tag(n: int, k: int, epi: str) -> str:
    return f"n{n}_k{k}" + EPI_TAG[epi]


def small_split(units: int, steps: int, kind: str, arch: ArchSpec) -> tuple[int, int]:
    """(KS warps splitting K, PF weight steps a warp streams ahead) of the small GEMM over `units` 16-row units and
    `steps` K steps; every row count's form alike (the one-row GEMV's planned prologue may deepen PF:
    codegen/gemv_prologue.py)."""
    ks = split_k(units, steps, arch) if kind != "half" else half_split_k(units, steps, arch)
    pf = prefetch(math.ceil(steps / ks), arch) if kind != "half" else min(4, math.ceil(steps / ks))
    if kind != "half" and arch.prefetch_depth >= 4:
        # H200 sweep (KS 2-16 x PF 2-8, 2026-12-01): 2 steps in flight
        # with the K split rounded up to a power of two beat the 4-deep default at M = 1 and 16, e.g. 16 rows
        # n2816 k8192 15.9 -> 10.4 us, k4096 9.0 -> 6.4; M = 1 n8192 k2816 7.2 -> 6.5 (n9216 at 16 rows: 10.4 -> 11.7)
        ks, pf = min(16, steps, 1 << (ks - 1).bit_length()), min(2, steps)
    if units >= 8 * arch.sm_count and steps >= 16:
        # very wide (lm_head): 4 warps x PF 2 measured best for one row on the H200 (3.43 TB/s vs 3.21 for 2 x PF 4);
        # the 16- and 32-row forms split K alike, so that a row's logits do not depend on the step's row count
        ks, pf = 4, 2
    return ks, pf


@cache
def gemm_small(
    n: int,
    k: int,
    mmax: int,
    epi: str,
    arch: ArchSpec,
    kind: str | None = None,
    prefix: str = "nvfp4",
    family: str = "matmul",
) -> KernelSpec:
    """The M <= mmax weight-streaming kernel for an [n, k] weight (kind: fp4 order or "half")."""
    kind = kind or fp4_order(arch)
    check_shape(f"{prefix} gemm", n, k)
    require(1 <= mmax <= SMALL_MAX_ROWS, f"gemm_small: mmax {mmax} must lie in 1..{SMALL_MAX_ROWS}")
    units, steps = n // TILE_N, k // TILE_K
    ks, pf = small_split(units, steps, kind, arch)
    un = units_a_block(units, mmax, kind, arch)
    out = GEMM_OUT_DTYPE if epi == "store" else ACT_DTYPE
    what = "gemv" if mmax == 1 else f"gemm{mmax}"
    return KernelSpec(
        f"{prefix}_{what}__{_tag(n, k, epi)}",
        "nvfp4_gemm.cu.j2",
        make_params(
            kind=kind,
            kind_enum=kind_enum(kind),
            n=n,
            k=k,
            ks=ks,
            mmax=mmax,
            pf=pf,
            epi=epi,
            epi_enum=EPI_ENUM[epi],
            out_dtype=out,
            act_dtype=ACT_DTYPE,
            w_layout=W_LAYOUT,
            fp4_order=fp4_order(arch),
            swap=mmax <= 8,
            un=un,
            **tile_params(),
        ),
        grid=(units // un, 1, 1),
        block=(32 * ks, 1, 1),
        args=gemm_args(kind),
        family=family,
    )


def units_a_block(units: int, mmax: int, kind: str, arch: ArchSpec) -> int:
    """16-row units a block of the small GEMM (gemm_nvfp4.cuh gemm_small's UN). From 16 rows on, each activation step
    a warp loads from L1 serves UN units: 4 at the lm_head's width; 2 where the blocks still cover every SM, or at 32
    rows (8 bytes of activation reads per weight byte) half of them; else 1. H200, 2026-12-02, a 32-row step: q|k|v
    489 -> 350 us, lm_head 324 -> 229 (261 at UN 2), the n2816 projections 383 / 333 / 115 -> 293 / 285 / 83 us at
    88 blocks of 2 units."""
    if mmax < 16 or kind == "half":
        return 1
    if units % 4 == 0 and units // 4 >= 8 * arch.sm_count:
        return 4
    if units % 2 == 0 and units // 2 >= (arch.sm_count // 2 if mmax > 16 else arch.sm_count):
        return 2
    return 1


@cache
def gemv_attn_tail(n: int, k: int, eps: float, arch: ArchSpec, fmt: str = "nvfp4") -> KernelSpec:
    """The M = 1 o_proj GEMV (the plain one's knobs) whose last block then runs Gemma's attention tail on the row,
    replaying the arithmetic of the attn_tail kernel's block size (norm.cuh: attn_tail_row), so that one decode
    launch a layer replaces two with the same bits. counters: one u32, zero at entry, left zeroed."""
    plain, tail = target_gemm(n, k, 1, "store", arch, fmt), attn_tail_kernel(n, eps, arch)
    params = dict(
        plain.param_dict,
        epi="attn_tail",
        epi_enum=EPI_ENUM["attn_tail"],
        eps=float(eps),
        tail_threads=tail.threads,
        tail_dtype=tail.param("OUT"),
    )
    return replace(
        plain,
        name=f"{WEIGHT_PREFIX[fmt]}_gemv__{_tag(n, k, 'attn_tail')}",
        params=make_params(**params),
        args=plain.args + TAIL_ARGS,
    )


def large_smem(bm: int = LARGE_BM, stages: int = LARGE_STAGES) -> int:
    return stages * bm * LARGE_PITCH * 2


def wgmma_smem(stages: int = WGMMA_STAGES) -> int:
    """gemm_wgmma.cuh's WgmmaLoop::SMEM: both 128-byte-row tiles a stage, plus 1 KB to align them."""
    return stages * (WGMMA_BM + WGMMA_BN) * 128 + 1024


@cache
def gemm_large(
    n: int,
    k: int,
    epi: str,
    arch: ArchSpec,
    kind: str | None = None,
    prefix: str = "nvfp4",
    family: str = "matmul",
    mmax: int = MAX_STEP_TOKENS,
) -> KernelSpec:
    """The prefill kernel (any m <= mmax; launch grid.y = ceil(m / bm), extra blocks exit). On an arch with wgmma,
    N a multiple of its 128-row tile takes the warpgroup form (NVFP4 weights, and the vision tower's fp16 ones)."""
    kind = kind or fp4_order(arch)
    check_shape(f"{prefix} gemm", n, k)
    units = n // TILE_N
    out = GEMM_OUT_DTYPE if epi == "store" else ACT_DTYPE
    template, args = "nvfp4_gemm_large.cu.j2", gemm_args(kind)
    common = dict(
        kind=kind,
        kind_enum=kind_enum(kind),
        n=n,
        k=k,
        epi=epi,
        epi_enum=EPI_ENUM[epi],
        out_dtype=out,
        act_dtype=ACT_DTYPE,
        w_layout=W_LAYOUT,
        fp4_order=fp4_order(arch),
        **tile_params(),
    )
    # fp16 weights take the warpgroup form in the vision tower only, where the GPU tests cover it (every tower GEMM
    # and the whole program against float64, tests/test_kernels_gpu_vision*.py); the drafter's and bf16
    # checkpoints' fp16 prefill GEMMs stay on mma.sync until theirs run on the GPU.
    if arch.has_wgmma and n % WGMMA_BN == 0 and (kind != "half" or family == "vision"):
        return KernelSpec(
            f"{prefix}_gemmL__{_tag(n, k, epi)}",
            template,
            make_params(
                **common,
                wgmma=True,
                bm=WGMMA_BM,
                bn=WGMMA_BN,
                stages=WGMMA_STAGES,
                pf=WGMMA_PF,
                ROW_GRID=(1, 1, WGMMA_BM),
            ),
            grid=(n // WGMMA_BN, math.ceil(mmax / WGMMA_BM), 1),
            block=(32 * WGMMA_WARPS, 1, 1),
            smem_bytes=wgmma_smem(),
            args=args,
            family=family,
        )
    nwarp = next(w for w in (4, 2, 1) if units % w == 0)
    return KernelSpec(
        f"{prefix}_gemmL__{_tag(n, k, epi)}",
        template,
        make_params(**common, bm=LARGE_BM, nwarp=nwarp, ROW_GRID=(1, 1, LARGE_BM), stages=LARGE_STAGES),
        grid=(units // nwarp, math.ceil(mmax / LARGE_BM), 1),
        block=(32 * nwarp, 1, 1),
        smem_bytes=large_smem(),
        args=args,
        family=family,
    )


def target_shapes(spec: ModelSpec) -> list[tuple[str, int, int, str]]:
    """(role, N, K, epilogue) of every distinct target NVFP4 matrix (plus fused q|k|v and gate|up)."""
    t = spec.target
    h = t.hidden_size
    shapes: list[tuple[str, int, int, str]] = []
    for kind in (SLIDING, FULL):
        layers = [l for l in range(t.num_hidden_layers) if t.layer_types[l] == kind]
        if not layers:
            continue
        l = layers[0]
        d, hq, hkv = t.layer_head_dim(l), t.num_attention_heads, t.layer_kv_heads(l)
        nq, nkv = hq * d, hkv * d
        shapes += [
            ("q", nq, h, "store"),
            ("kv", nkv, h, "store"),
            ("o", h, nq, "store"),
            ("qkv", nq + nkv * (2 if t.layer_has_v_proj(l) else 1), h, "store"),
        ]
    shapes += [
        ("gate_up", 2 * t.intermediate_size, h, "gelu_mul"),
        ("down", h, t.intermediate_size, "store"),
        ("lm_head", t.vocab_size, h, "store"),
    ]
    return shapes


def shape_format(spec: ModelSpec, role: str) -> str:
    """The checkpoint format of a target_shapes role (the lm_head is the tied embedding quantized at repack)."""
    f = spec.linear_formats
    return {
        "q": f.attention,
        "kv": f.attention,
        "o": f.attention,
        "qkv": f.attention,
        "gate_up": f.dense_mlp,
        "down": f.dense_mlp,
    }.get(role, "nvfp4")


@cache
def target_gemm(n: int, k: int, mmax: int, epi: str, arch: ArchSpec, fmt: str = "nvfp4") -> KernelSpec:
    """The weight-streaming kernel (M <= mmax: 1, 16 or SMALL_MAX_ROWS) of a target matrix [n, k] stored as `fmt`.

    Batch invariance: the M = 1, 16 and 32 forms of a matrix split K alike, so that with the swapped GEMV's single
    accumulator chain (nvfp4.cuh mma_step_swap) each output sums in one order whatever the step's row count, and a
    sequence's tokens do not depend on the batch it decodes in."""
    kind, prefix = weight_kind(fmt, arch), WEIGHT_PREFIX[fmt]
    forms = {m: gemm_small(n, k, m, epi, arch, kind, prefix) for m in (1, 16, SMALL_MAX_ROWS)}
    splits = {kern.param("ks") for kern in forms.values()}
    require(len(splits) == 1, f"matmul n={n} k={k}: the small forms split K differently ({splits})")
    if mmax == 1:  # the weight prologue the plan launches (the fused q|k|v and o_proj GEMVs inherit it)
        return planned_gemv(forms[1], arch)
    return forms[mmax] if mmax in forms else gemm_small(n, k, mmax, epi, arch, kind, prefix)


@cache
def target_gemm_large(n: int, k: int, epi: str, arch: ArchSpec, fmt: str = "nvfp4") -> KernelSpec:
    """The prefill kernel of a target matrix [n, k] stored as `fmt`."""
    return gemm_large(n, k, epi, arch, weight_kind(fmt, arch), WEIGHT_PREFIX[fmt])


def weight_bufs(kind: str, n: int, k: int, experts: int = 1) -> tuple[Buf, ...]:
    """Bench buffers of `experts` stacked [n, k] weights of weight kind `kind` (NVFP4: codes, e4m3 scales without
    NaN codes, tile factors; fp16: the weights)."""
    e = experts
    if kind == "half":
        return (Buf("w", "f16", e * n * k, -0.05, 0.05),)
    codes, scales, tiles = nvfp4_sizes(n, k)
    return (Buf("w", "u8", e * codes), Buf("s", "u8", e * scales, 0, 0x70), Buf("gscale", "f32", e * tiles, 1e-3, 2e-3))


def layout_bytes(kind: str, n: int, k: int) -> int:
    """Bytes of an [n, k] weight of weight kind `kind` in its layout."""
    return n * k * 2 if kind == "half" else weight_bytes(n, k)


def gemm_bench_case(kern: KernelSpec, m: int, note: str = "") -> BenchCase:
    n, k, epi = kern.param("n"), kern.param("k"), kern.param("epi")
    out_n = n if epi == "store" else n // 2
    out_b = 4 if kern.param("out_dtype") == "f32" else 2
    kind = kern.param("kind")
    args = (
        *weight_bufs(kind, n, k),
        Buf("x", "f16", m * k),
        Buf("y", kern.param("out_dtype"), m * out_n),
        Scalar("m", "i32", m),
    )
    wbytes = layout_bytes(kind, n, k)
    grid = None
    if kern.template.endswith("_large.cu.j2"):
        grid = (kern.grid[0], math.ceil(m / kern.param("bm")), 1)
    return BenchCase(
        kern,
        args,
        bytes_moved=wbytes + m * k * 2 + m * out_n * out_b,
        grid=grid,
        note=note or f"M={m}",
        weight_streaming=m <= SMALL_MAX_ROWS,
    )


def gemv_attn_tail_bench_case(kern: KernelSpec) -> BenchCase:
    """One decode step's o_proj + attention tail: the weight, o and the residual row, the two f16 rows out."""
    n, k = kern.param("n"), kern.param("k")
    kind = kern.param("kind")
    args = (
        *weight_bufs(kind, n, k),
        Buf("x", "f16", k),
        Buf("y", "f32", n),
        Scalar("m", "i32", 1),
        Buf("resid", "f32", n),
        Buf("w_post", "bf16", n, 0.5, 1.5),
        Buf("w_pre1", "bf16", n, 0.5, 1.5),
        Buf("w_pre2", "bf16", n, 0.5, 1.5),
        Buf("a1", "f16", n),
        Buf("a2", "f16", n),
        Buf("counters", "u32", 1, 0, 0),
    )
    # DRAM: weight, x, o stored, residual read and written, three bf16 norm weights, a1 and a2 (o is read back
    # from L2)
    return BenchCase(
        kern,
        args,
        bytes_moved=layout_bytes(kind, n, k) + 2 * k + n * (4 + 2 * 4 + 3 * 2 + 2 * 2),
        note="M=1 + attn_tail",
        weight_streaming=True,
    )


def bench_matmul(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    """The target linears' kernels as the step programs launch them: q and k|v run in the fused q|k|v (whose one-row
    GEMV has rope_kv folded in: rope_kv.py), the one-row o_proj with the attention tail; one prefill GEMM, the first
    layer kind's q|k|v."""
    cases, seen, prefill = [], set(), True
    for role, n, k, epi in target_shapes(spec):
        if role in ("q", "kv"):
            continue
        fmt = shape_format(spec, role)
        forms: list[tuple[KernelSpec, int]] = []
        if role == "o":
            forms.append((gemv_attn_tail(n, k, spec.target.rms_norm_eps, arch, fmt), 0))
        elif role != "qkv":
            forms.append((target_gemm(n, k, 1, epi, arch, fmt), 1))
        forms += [(target_gemm(n, k, m, epi, arch, fmt), m) for m in (16, SMALL_MAX_ROWS)]
        if role == "qkv" and prefill:
            forms.append((target_gemm_large(n, k, epi, arch, fmt), MAX_STEP_TOKENS))
            prefill = False
        for kern, m in forms:
            if kern.name in seen:
                continue
            seen.add(kern.name)
            cases.append(
                gemv_attn_tail_bench_case(kern)
                if m == 0
                else gemm_bench_case(kern, m, note=f"prefill M={m}" if m == MAX_STEP_TOKENS else "")
            )
    return cases
