"""Codegen stage: the planner — ModelSpec + ArchSpec -> the ordered, deduplicated list of KernelSpecs to build.

Design (short):
- Every kernel is specialised: shapes, head dims, rope frequency tables, eps, softcap, tile sizes, warps and
  prefetch depths are template constants, so one `KernelSpec` = one extern "C" entry = one cubin. Names encode
  the distinguishing constants (e.g. `rmsnorm__h2816_f32_f16`), so layers sharing a shape share a kernel.
- Families (codegen/families/*.py) each return their kernels for the spec and arch; FAMILIES fixes the order
  (roughly a forward step: embedding, norms, rope+KV write, router, lm_head epilogue, drafter glue, then the
  matmul helper's GEMMs, MoE, attention and drafter GEMMs).
- Templates in templates/kernels/*.cu.j2 are thin (constants + the extern "C" wrapper); the loops and math live
  in hand-written headers templates/include/thorgen/*.cuh whose static_asserts re-check what the planner asserts.
- The dataflow conventions between families (dtypes, KV cache layout, ring size, row-kernel launch rule) are in
  codegen/families/__init__.py and copied into the manifest for the runtime.
- Arch tuning: ArchSpec carries warps per block and prefetch depth (H200: many bytes in flight per SM; Thor:
  fewer warps) plus has_fp4_cvt (hardware E2M1 decode on sm_100a+).
"""

from __future__ import annotations

import json

from ..model_spec.types import ModelSpec
from .arch import ArchSpec
from .families import FAMILIES, family_function, missing_families
from .kernel_spec import KernelSpec

PLAN_SCHEMA = 1


class PlanError(ValueError):
    """The planner cannot size a kernel for this spec/arch (divisibility, shared memory, threads)."""


def check_kernel(k: KernelSpec, arch: ArchSpec) -> None:
    if k.smem_bytes > arch.smem_per_block_max:
        raise PlanError(f"{k.name}: {k.smem_bytes} B dynamic shared memory exceeds {arch.name}'s "
                        f"{arch.smem_per_block_max} B per block")
    if k.threads > arch.max_threads_per_block:
        raise PlanError(f"{k.name}: {k.threads} threads per block exceeds {arch.max_threads_per_block}")
    if k.grid[1] > 65535 or k.grid[2] > 65535 or k.grid[0] > 2**31 - 1:
        raise PlanError(f"{k.name}: grid {k.grid} exceeds CUDA limits")


def plan(spec: ModelSpec, arch: ArchSpec, families: tuple[str, ...] = FAMILIES,
         require_all: bool = False) -> list[KernelSpec]:
    """All kernels for `spec` on `arch`, in family order, deduplicated by name (equal names must be equal specs)."""
    if require_all and (missing := [f for f in missing_families() if f in families]):
        raise PlanError(f"kernel families not available yet: {', '.join(missing)}")
    out: dict[str, KernelSpec] = {}
    for family in families:
        fn = family_function(family, "plan")
        if fn is None:
            continue
        for k in fn(spec, arch):
            check_kernel(k, arch)
            prev = out.get(k.name)
            if prev is not None and prev != k:
                raise PlanError(f"two different kernels share the name {k.name} (family {family})")
            out.setdefault(k.name, k)
    return list(out.values())


def plan_json(spec: ModelSpec, arch: ArchSpec, kernels: list[KernelSpec]) -> str:
    """Deterministic JSON of a plan (committed as build/<preset>/<arch>/plan.json)."""
    body = {"schema": PLAN_SCHEMA, "model": spec.name, "spec_hash": spec.spec_hash, "arch": arch.name,
            "kernels": [k.to_json() for k in kernels]}
    return json.dumps(body, indent=1, sort_keys=True) + "\n"
