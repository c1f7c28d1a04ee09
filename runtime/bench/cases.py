"""The kernel benchmark's cases as `thorgen build` wrote them beside manifest.json, read as plain JSON.

bench_cases.json holds, for each built kernel a codegen family gives benchmark cases for, the arguments in order
(buffers: a dtype, an element count and how to fill them; scalars: a C type and a value), the launch grid and the
compulsory DRAM bytes. The schema is codegen/bench_cases.py's; the runtime never imports codegen, so the fields it
relies on are checked here, and every case is checked against its kernel's manifest entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...model_spec.bench_args import BENCH_CASES_NAME, BENCH_CASES_SCHEMA, Buf, Scalar, arg_from_json
from ...model_spec.nvfp4 import f32_to_bf16
from ..manifest import KernelManifest, ModuleError

_NP = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u32": np.uint32, "u64": np.uint64, "i64": np.int64}
_SCALAR = {"i32": np.int32, "u32": np.uint32, "i64": np.int64, "u64": np.uint64, "f32": np.float32, "f64": np.float64}


@dataclass(frozen=True)
class BenchCase:
    """One timed launch of `kernel` (a manifest name): `args` in its argument order, `grid` None for the manifest's
    grid, `bytes_moved` the compulsory DRAM traffic; weight-streaming kernels are held to the copy-bandwidth target."""

    kernel: str
    args: tuple[Buf | Scalar, ...]
    bytes_moved: int
    grid: tuple[int, int, int] | None
    note: str
    weight_streaming: bool


def _case(raw: dict) -> BenchCase:
    grid = raw.get("grid")
    return BenchCase(
        str(raw["kernel"]),
        tuple(arg_from_json(a) for a in raw["args"]),
        int(raw["bytes_moved"]),
        None if grid is None else (int(grid[0]), int(grid[1]), int(grid[2])),
        str(raw.get("note", "")),
        bool(raw.get("weight_streaming", False)),
    )


def load_bench_cases(manifest: KernelManifest) -> list[BenchCase]:
    """The cases of the build `manifest` came from; ModuleError when the file is missing, was written by another
    build (spec hash or arch differ), or names a kernel or arguments its manifest entry does not."""
    path = manifest.path.parent / BENCH_CASES_NAME
    rebuild = "; rebuild with `thorgen build`"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModuleError(f"{path} not found: the build has no benchmark cases{rebuild}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModuleError(f"{path}: unreadable ({exc}){rebuild}") from exc
    if not isinstance(data, dict) or data.get("schema") != BENCH_CASES_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ModuleError(f"{path}: schema {got!r}, this runtime reads schema {BENCH_CASES_SCHEMA}{rebuild}")
    if (data.get("spec_hash"), data.get("arch")) != (manifest.spec_hash, manifest.arch):
        raise ModuleError(
            f"{path} was written for {str(data.get('spec_hash'))[:12]} on {data.get('arch')}, the "
            f"manifest beside it for {manifest.spec_hash[:12]} on {manifest.arch}{rebuild}"
        )
    cases = []
    for i, raw in enumerate(data.get("cases") or []):
        try:
            case = _case(raw)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise ModuleError(f"{path}: case {i} is malformed ({exc!r}){rebuild}") from exc
        names = tuple(a.name for a in case.args)
        if names != manifest.kernel(case.kernel).args:
            raise ModuleError(
                f"{path}: the case of {case.kernel} passes {names}, its manifest entry takes "
                f"{manifest.kernel(case.kernel).args}{rebuild}"
            )
        cases.append(case)
    return cases


def fill(buf: Buf, rng: np.random.Generator) -> np.ndarray:
    """Host data for a bench buffer (see Buf's docstring)."""
    n = buf.count
    if buf.values:
        vals = np.resize(np.asarray(buf.values), n)
        if buf.dtype == "bf16":
            return f32_to_bf16(vals.astype(np.float32))
        return vals.astype(_NP.get(buf.dtype, np.uint8))
    if buf.low == buf.high:
        if buf.dtype == "bf16":
            return np.full(n, f32_to_bf16(np.array([buf.low], np.float32))[0], np.uint16)
        return np.full(n, buf.low, _NP.get(buf.dtype, np.uint8))
    if buf.dtype == "u8":
        return rng.integers(0, 256, n, dtype=np.uint8)
    if buf.dtype in ("i32", "u32", "u64", "i64"):
        return rng.integers(int(buf.low), int(buf.high), n).astype(_NP[buf.dtype])
    vals = rng.uniform(buf.low, buf.high, n).astype(np.float32)
    return f32_to_bf16(vals) if buf.dtype == "bf16" else vals.astype(_NP[buf.dtype])


def host_args(case: BenchCase, rng: np.random.Generator) -> list[Any]:
    """The case's arguments on the host, in order: an array per buffer (None for a zero-count one: a null pointer,
    an optional output left off) and a NumPy scalar of its C type per scalar."""
    return [
        (None if a.count == 0 else fill(a, rng)) if isinstance(a, Buf) else _SCALAR[a.ctype](a.value) for a in case.args
    ]
