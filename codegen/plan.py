"""Codegen stage: the planner — ModelSpec + ArchSpec -> the ordered list of KernelSpecs to build: exactly the kernels
the step programs launch.

Design (short):
- Every kernel is specialised: shapes, head dims, rope frequency tables, eps, softcap, tile sizes, warps and
  prefetch depths are template constants, so one `KernelSpec` = one extern "C" entry = one cubin. Names encode
  the distinguishing constants (e.g. `rmsnorm__h2816_f32_f16`), so layers sharing a shape share a kernel.
- The lowering (codegen/lower.py, lower_draft.py) asks the kernel families (codegen/families/*.py) for the kernel of
  each launch, for the constants that launch needs; the plan is the set of kernels some step program launches
  (codegen/programs.py launched_kernels), in FAMILIES order, within a family in order of first use.
- Templates in templates/kernels/*.cu.j2 are thin (constants + the extern "C" wrapper); the loops and math live
  in hand-written headers templates/include/thorgen/*.cuh whose static_asserts re-check what the planner asserts.
- The dataflow conventions between families (dtypes, KV cache layout, ring size, row-kernel launch rule) are in
  codegen/families/__init__.py and copied into the manifest for the runtime.
- Arch tuning: ArchSpec carries warps per block and prefetch depth (H200: many bytes in flight per SM; Thor:
  fewer warps) plus has_fp4_cvt (hardware E2M1 decode on sm_100a+).
"""

from __future__ import annotations

import json
from functools import lru_cache

from ..model_spec.types import ModelSpec
from .arch import ArchSpec
from .families import FAMILIES, KV_DTYPES, MAX_STEP_TOKENS
from .kernel_spec import KernelSpec, PlanError
from .programs import launched_kernels

PLAN_SCHEMA = 1

__all__ = ["PLAN_SCHEMA", "PlanError", "check_kernel", "plan", "plan_json"]


def check_kernel(k: KernelSpec, arch: ArchSpec) -> None:
    if k.smem_bytes > arch.smem_per_block_max:
        raise PlanError(
            f"{k.name}: {k.smem_bytes} B dynamic shared memory exceeds {arch.name}'s "
            f"{arch.smem_per_block_max} B per block"
        )
    if k.threads > arch.max_threads_per_block:
        raise PlanError(f"{k.name}: {k.threads} threads per block exceeds {arch.max_threads_per_block}")
    if k.grid[1] > 65535 or k.grid[2] > 65535 or k.grid[0] > 2**31 - 1:
        raise PlanError(f"{k.name}: grid {k.grid} exceeds CUDA limits")


@lru_cache(maxsize=16)
def _plan(spec: ModelSpec, arch: ArchSpec) -> tuple[KernelSpec, ...]:
    kernels = launched_kernels(spec, arch, KV_DTYPES, MAX_STEP_TOKENS)
    for k in kernels:
        if k.family not in FAMILIES:
            raise PlanError(f"{k.name}: family {k.family!r} is not one of {FAMILIES}")
        check_kernel(k, arch)
    first_use = {k.name: i for i, k in enumerate(kernels)}
    return tuple(sorted(kernels, key=lambda k: (FAMILIES.index(k.family), first_use[k.name])))


def plan(spec: ModelSpec, arch: ArchSpec, families: tuple[str, ...] = FAMILIES) -> list[KernelSpec]:
    """The kernels the step programs of `spec` on `arch` launch (of `families`), in family order, within a family in
    order of first use; distinct names (a launch's kernel is its family's for the launch's constants)."""
    return [k for k in _plan(spec, arch) if k.family in families]


def plan_json(spec: ModelSpec, arch: ArchSpec, kernels: list[KernelSpec]) -> str:
    """Deterministic JSON of a plan (committed as build/<preset>/<arch>/plan.json)."""
    body = {
        "schema": PLAN_SCHEMA,
        "model": spec.name,
        "spec_hash": spec.spec_hash,
        "arch": arch.name,
        "kernels": [k.to_json() for k in kernels],
    }
    return json.dumps(body, indent=1, sort_keys=True) + "\n"
