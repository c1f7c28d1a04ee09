"""Codegen stage: bench_cases.json, the built kernels' benchmark cases that `thorgen bench --kernels` reads.

Each family module may expose `bench_<family>(spec, arch) -> list[BenchCase]`; `thorgen build` writes the cases of
the kernels it built beside manifest.json, so the runtime benchmarks a build folder without importing codegen.
Schema (runtime/bench/cases.py reads it with `json` alone):
  {"schema": 1, "model": str, "spec_hash": str, "arch": str,
   "cases": [{"kernel": name in the manifest, "bytes_moved": int, "grid": [x,y,z] or null (the manifest's grid),
              "note": str, "weight_streaming": bool,
              "args": [{"buf": name, "dtype", "count", "low", "high", "values": [...]}
                       | {"scalar": name, "ctype", "value"}, ... in the kernel's argument order]}]}
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from ..model_spec.bench_args import BENCH_CASES_NAME, BENCH_CASES_SCHEMA
from ..model_spec.types import ModelSpec
from .arch import ArchSpec
from .families import FAMILIES, family_function
from .kernel_spec import BenchCase, KernelSpec
from .prologue_variants import variant_cases


def built_bench_cases(spec: ModelSpec, arch: ArchSpec, kernels: Iterable[KernelSpec]) -> list[BenchCase]:
    """Every family's bench cases whose kernel is one of `kernels`, as given; a case for any other kernel (a tuning
    variant the plan does not pick) is dropped: the build has no cubin for it. A bench-only prologue form
    (codegen/prologue_variants.py) takes its planned kernel's case."""
    built = {k.name: k for k in kernels}
    every = []
    for family in FAMILIES:
        bench = family_function(family, "bench")
        if bench is not None:
            every.extend(bench(spec, arch))
    cases = [c for c in every if built.get(c.kernel.name) == c.kernel]
    return cases + variant_cases(cases, built.values())


def bench_cases_json(spec: ModelSpec, arch: ArchSpec, kernels: Iterable[KernelSpec]) -> dict:
    return {
        "schema": BENCH_CASES_SCHEMA,
        "model": spec.name,
        "spec_hash": spec.spec_hash,
        "arch": arch.name,
        "cases": [c.to_json() for c in built_bench_cases(spec, arch, kernels)],
    }


def write_bench_cases(out_dir: Path, spec: ModelSpec, arch: ArchSpec, kernels: Iterable[KernelSpec]) -> Path:
    """out_dir/bench_cases.json (one case a line: their `values` run to thousands of numbers), written through a
    temporary file and a rename."""
    data = bench_cases_json(spec, arch, kernels)
    cases = ",\n".join(json.dumps(c, separators=(",", ":"), allow_nan=False) for c in data.pop("cases"))
    head = json.dumps(data, allow_nan=False)[:-1]  # the object without its closing brace
    path = Path(out_dir) / BENCH_CASES_NAME
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f'{head}, "cases": [\n{cases}\n]}}\n')
    tmp.replace(path)
    return path
