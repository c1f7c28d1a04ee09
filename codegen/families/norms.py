"""Codegen stage: the RMSNorm family — plain norms, residual-add + norm, and Gemma's fused attention / FFN tails."""

from __future__ import annotations

from functools import cache

from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import ACT_DTYPE, GEMM_OUT_DTYPE
from ._util import ftag, row_grid, row_threads

_EPS_DEFAULT = 1e-6


def _name(kind: str, H: int, eps: float, *dtypes: str) -> str:
    eps_tag = "" if eps == _EPS_DEFAULT else f"_eps{ftag(eps)}"
    return f"{kind}__h{H}_{'_'.join(dtypes)}{eps_tag}"


@cache
def rmsnorm_kernel(H: int, eps: float, arch: ArchSpec, inp: str = GEMM_OUT_DTYPE, out: str = ACT_DTYPE) -> KernelSpec:
    return KernelSpec(
        _name("rmsnorm", H, eps, inp, out),
        "rmsnorm.cu.j2",
        make_params(H=H, EPS=float(eps), IN=inp, OUT=out, ROW_AXIS=0),
        row_grid(),
        (row_threads(H, arch, "rmsnorm"), 1, 1),
        args=("x", "w", "y", "T"),
        family="norms",
    )


@cache
def add_rmsnorm_kernel(
    H: int, eps: float, arch: ArchSpec, inp: str = GEMM_OUT_DTYPE, out: str = ACT_DTYPE
) -> KernelSpec:
    return KernelSpec(
        _name("add_rmsnorm", H, eps, inp, out),
        "add_rmsnorm.cu.j2",
        make_params(H=H, EPS=float(eps), IN=inp, OUT=out, ROW_AXIS=0),
        row_grid(),
        (row_threads(H, arch, "add_rmsnorm"), 1, 1),
        args=("x", "y", "w", "a", "T"),
        family="norms",
    )


@cache
def attn_tail_kernel(H: int, eps: float, arch: ArchSpec) -> KernelSpec:
    return KernelSpec(
        _name("attn_tail", H, eps, GEMM_OUT_DTYPE, ACT_DTYPE),
        "attn_tail.cu.j2",
        make_params(H=H, EPS=float(eps), IN=GEMM_OUT_DTYPE, OUT=ACT_DTYPE, ROW_AXIS=0),
        row_grid(),
        (row_threads(H, arch, "attn_tail"), 1, 1),
        args=("o", "x", "w_post", "w_pre1", "w_pre2", "a1", "a2", "T"),
        family="norms",
    )


# ffn_tail holds five row vectors in registers (and its slot form PAIRS of the MoE's rows more): at 128 threads
# (sm_110a's row block) a 2816-wide row took 252 registers, and 255 with 808 bytes of spills for 8 slot rows;
# 256 threads hold 11 columns a thread, as on sm_90a (114 and 196 registers, no spills).
FFN_TAIL_MIN_THREADS = 256

FFN_TAIL_ARGS = (
    "mlp",
    "moe",
    "ids",
    "x",
    "w1",
    "w2",
    "w",
    "layer_scalar",
    "w_next",
    "a",
    "tap",
    "tap_stride",
    "tap_col",
    "T",
)


@cache
def ffn_tail_kernel(H: int, eps: float, arch: ArchSpec, pairs: int = 0, experts: int = 0) -> KernelSpec:
    """pairs = top-k > 0: the form that sums the MoE's slot rows itself (steps of more than one row, whose MoE
    writes a row per slot), saving the combine launch a layer."""
    # The DFlash taps feed the drafter's fc GEMM, so they are stored as GEMM activations.
    name = _name("ffn_tail", H, eps, GEMM_OUT_DTYPE, ACT_DTYPE) + (f"_p{pairs}" if pairs else "")
    return KernelSpec(
        name,
        "ffn_tail.cu.j2",
        make_params(
            H=H,
            EPS=float(eps),
            IN=GEMM_OUT_DTYPE,
            OUT=ACT_DTYPE,
            TAP=ACT_DTYPE,
            PAIRS=pairs,
            EXPERTS=experts,
            ROW_AXIS=0,
        ),
        row_grid(),
        (row_threads(H, arch, "ffn_tail", FFN_TAIL_MIN_THREADS), 1, 1),
        args=FFN_TAIL_ARGS,
        family="norms",
    )


def bench_norms(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    H, T = spec.target.hidden_size, 16
    act = 2
    eps = spec.target.rms_norm_eps
    ks = {"attn_tail": attn_tail_kernel(H, eps, arch), "ffn_tail": ffn_tail_kernel(H, eps, arch)}  # one-row forms
    row, w = T * H, H
    out = []
    k = ks["attn_tail"]
    out.append(
        BenchCase(
            k,
            (
                Buf("o", "f32", row),
                Buf("x", "f32", row),
                Buf("w_post", "bf16", w),
                Buf("w_pre1", "bf16", w),
                Buf("w_pre2", "bf16", w),
                Buf("a1", "f16", row),
                Buf("a2", "f16", row),
                Scalar("T", "i32", T),
            ),
            bytes_moved=row * (4 + 8 + 2 * act) + 3 * w * 2,
            grid=(T, 1, 1),
            note="T=16",
        )
    )
    k = ks["ffn_tail"]
    out.append(
        BenchCase(
            k,
            (
                Buf("mlp", "f32", row),
                Buf("moe", "f32", row),
                Buf("ids", "i32", 0),
                Buf("x", "f32", row),
                Buf("w1", "bf16", w),
                Buf("w2", "bf16", w),
                Buf("w", "bf16", w),
                Buf("layer_scalar", "bf16", 1),
                Buf("w_next", "bf16", w),
                Buf("a", "f16", row),
                Buf("tap", "f16", row),
                Scalar("tap_stride", "i32", H),
                Scalar("tap_col", "i32", 0),
                Scalar("T", "i32", T),
            ),
            bytes_moved=row * (4 + 4 + 8 + act + act) + 4 * w * 2,
            grid=(T, 1, 1),
            note="T=16, tap on",
        )
    )
    return out
