"""Codegen stage: the registry of kernel families; each module has functions that return the `KernelSpec` of a
kernel for given constants, which the lowering (codegen/lower.py) calls for every kernel it launches, and
optionally `bench_<family>(spec, arch)`.

Shared dataflow conventions (one place, so that producer and consumer kernels agree):
  residual stream x            : f32 [T, H]
  GEMM activations (inputs)    : ACT_DTYPE [T, K], written by the norm kernels
  GEMM outputs                 : GEMM_OUT_DTYPE [T, N], read by the norm / rope kernels
  attention Q (after norm+RoPE): Q_DTYPE [T, Hq, D]
  KV cache (per layer)         : K and V caches, each [slots][Hkv][D] of KV_DTYPE ("bf16" or "fp8e4m3", no scale);
                                 sliding layers: ring of RING_SLOTS(window) = window + MAX_STEP_TOKENS slots,
                                 slot = pos % slots; the target's full layers: paged, one pool of pages of KV_PAGE
                                 positions for all sequences, slot = pages[lane][pos / KV_PAGE] * KV_PAGE +
                                 pos % KV_PAGE (the page table: i32 [lanes][page_pitch], runtime-owned); the
                                 drafter's full layers: linear, slot = pos (capacity set by the runtime).
  positions                    : i32 [T] on the device (graph-friendly), absolute token positions.
  lm_head logits               : f32 [T, V] (before softcap); the lm_head epilogue kernels softcap them.
Row kernels (param ROW_AXIS = 0 or 1) take the runtime row count `T` and loop rows grid-stride along grid axis
ROW_AXIS, so any extent 1..grid[ROW_AXIS] on that axis is correct; launch it as min(T, grid[ROW_AXIS]).
Block-per-rows kernels (param ROW_GRID = (axis, mul, div[, cap])) launch ceil(T * mul / div) blocks on that axis, at
most cap: the prefill GEMMs (BM rows a block), moe_gateup and moe_down_pairs (a block row per expert the step may
select: min(E, T * top-k)), attention (query blocks) and
its combine (a block per query and head); an attention launch with one query per block (a batched decode step)
uses ROWWISE_GRID the same way, and ROWWISE_SPLITS[T - 1] key splits on axis 2. A kernel over several images (param
IMAGE_AXIS: the vision attention) takes its launch argument `B` blocks on that axis. The manifest carries these rules,
so the runtime sizes every launch without knowing what the kernel is.
PDL: every kernel calls pdl_launch_dependents() and waits in pdl_wait() before it reads earlier kernels' outputs or
writes anything (common.cuh), so the runtime may launch each kernel that follows a kernel with programmatic stream
serialization (manifest convention "pdl"); the weight-streaming kernels load their first weight steps before the wait.
Kernels with cross-block reductions (lm_argmax, lm_sample_finish, lm_process, lm_pick argmax / finish, the split
decode attention, router_fused, the o_proj GEMV with the attention tail folded in, the q|k|v GEMV with rope_kv
folded in) take `counters` buffers that the runtime zeroes once at allocation; the kernels leave them zeroed.
"""

from __future__ import annotations

import importlib
from typing import Callable

# (the families import these from here)
from ...model_spec.conventions import KV_PAGE, MAX_STEP_TOKENS, page_pitch, ring_slots  # noqa: F401

ACT_DTYPE = "f16"  # activations into every NVFP4 / bf16 GEMM (the seed's W4A16 used fp16: 1e-3 error budget)
GEMM_OUT_DTYPE = "f32"  # GEMM outputs feed fp32 norms / residual adds
Q_DTYPE = "bf16"  # attention queries, the same type as the bf16 KV cache (tensor-core friendly)
KV_DTYPES = ("bf16", "fp8e4m3")
PDL = True  # every template is PDL-safe (see above; tests/test_codegen_pdl.py checks the sources)


# Order = plan order (roughly the order of a forward step); within a family the plan keeps the order of first use.
FAMILIES: tuple[str, ...] = (
    "embedding",
    "norms",
    "rope_kv",
    "router",
    "lm_head",
    "lm_logits",
    "drafter_glue",
    "matmul",
    "moe",
    "moe_grouped",
    "attention",
    "drafter_gemm",
    "vision",
)


def family_function(name: str, prefix: str) -> Callable | None:
    """`<prefix>_<name>` of family module `name` (e.g. its bench cases), or None when it has none."""
    return getattr(importlib.import_module(f"{__name__}.{name}"), f"{prefix}_{name}", None)
