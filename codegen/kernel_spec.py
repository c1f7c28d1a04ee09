"""Codegen stage: `KernelSpec`, the frozen description of one specialised kernel (template, constants, launch)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..model_spec.bench_args import Buf, Scalar

_MISSING = object()


class PlanError(ValueError):
    """The planner cannot size a kernel for this spec/arch (divisibility, shared memory, threads)."""


@dataclass(frozen=True)
class KernelSpec:
    """One kernel instance: rendered from `template` with `params`, launched with `grid` x `block`.

    `name` is unique within a plan and is also the extern "C" symbol and the cubin stem, e.g.
    `nvfp4_gemv__n4096_k2816`. `params` are the constexpr values the template sees (ints, floats, bools,
    strings); `args` names the kernel arguments in order (pointers and ints) for the launcher.
    """

    name: str
    template: str  # path relative to templates/kernels/, e.g. "nvfp4_gemv.cu.j2"
    params: tuple[tuple[str, object], ...]
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0  # dynamic shared memory
    args: tuple[str, ...] = ()
    family: str = ""

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"kernel name {self.name!r} must be a C identifier")
        keys = [k for k, _ in self.params]
        if len(set(keys)) != len(keys):
            raise ValueError(f"kernel {self.name}: duplicate params {sorted(k for k in keys if keys.count(k) > 1)}")
        for key, value in self.params:
            table = isinstance(value, tuple) and all(isinstance(v, int) for v in value)  # (a grid rule's table)
            if not (table or isinstance(value, (int, float, bool, str))):
                raise ValueError(
                    f"kernel {self.name}: param {key}={value!r} is not an int, float, bool, str or tuple of ints"
                )
        if len(self.grid) != 3 or len(self.block) != 3 or min(self.grid + self.block) < 1:
            raise ValueError(f"kernel {self.name}: grid {self.grid} / block {self.block} must be 3 positive ints")
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > 1024:
            raise ValueError(f"kernel {self.name}: {threads} threads per block exceeds 1024")

    def param(self, key: str, default: object = _MISSING) -> object:
        """The value of constexpr `key`; KeyError naming the kernel when absent and no default is given."""
        for k, v in self.params:
            if k == key:
                return v
        if default is _MISSING:
            raise KeyError(f"kernel {self.name} has no param {key!r} (has {[k for k, _ in self.params]})")
        return default

    @property
    def param_dict(self) -> dict[str, object]:
        return dict(self.params)

    @property
    def threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    def to_json(self) -> dict:
        """Plain-JSON form used by plan.json and the manifest."""
        return {
            "name": self.name,
            "template": self.template,
            "family": self.family,
            "params": {k: v for k, v in self.params},
            "grid": list(self.grid),
            "block": list(self.block),
            "smem_bytes": self.smem_bytes,
            "args": list(self.args),
        }

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


def make_params(**kwargs: object) -> tuple[tuple[str, object], ...]:
    """Params tuple in a stable (sorted) order, so that equal kernels compare and hash equal."""
    return tuple(sorted(kwargs.items()))


# ---- benchmark cases: a family module may expose `bench_<family>(spec, arch) -> list[BenchCase]` ----------------
@dataclass(frozen=True)
class BenchCase:
    """One timed launch: `args` in the kernel's argument order; `bytes_moved` = compulsory DRAM traffic."""

    kernel: KernelSpec
    args: tuple[Buf | Scalar, ...]
    bytes_moved: int
    grid: tuple[int, int, int] | None = None  # launch grid when it differs from kernel.grid (e.g. rows = T)
    note: str = ""
    weight_streaming: bool = False  # counted against the >= 70% of copy bandwidth target

    def __post_init__(self) -> None:
        names = tuple(a.name for a in self.args)
        if self.kernel.args and names != self.kernel.args:
            raise ValueError(f"bench case for {self.kernel.name}: args {names} != kernel args {self.kernel.args}")

    def to_json(self) -> dict:
        """Plain-JSON form used by bench_cases.json (the kernel by name: its entry is in the manifest)."""
        return {
            "kernel": self.kernel.name,
            "args": [a.to_json() for a in self.args],
            "bytes_moved": self.bytes_moved,
            "grid": None if self.grid is None else list(self.grid),
            "note": self.note,
            "weight_streaming": self.weight_streaming,
        }
