"""Runtime stage: the step programs of the kernel manifest (codegen/programs.py) bound to the engine's buffers.

`Forward.ops(rows, ...)` returns the launches of one forward over `rows` tokens: the manifest's program for that
kind of forward (its flags: model_spec.step_program.program_key) and row range, its symbols resolved through a
`Pointers` object (the engine's buffers, or runtime/dataflow.PlannedPointers for the checks). No kernel is chosen
here: a program names its kernels, and their grids follow the planned rules in their params (`_grid`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ...model_spec.step_program import Op, program_key
from ...model_spec.types import ModelSpec
from ..backend import BackendError
from ..manifest import KernelEntry, KernelManifest
from .kernels import Ptr

NULL = Ptr(0)


class Pointers(Protocol):
    def W(self, name: str, byte_offset: int = 0) -> Ptr: ...  # a weight tensor
    def A(self, name: str, row: int = 0) -> Ptr: ...  # an activation buffer row
    def KV(self, layer: int, which: str) -> Ptr: ...  # a layer's K or V cache
    def DKV(self, layer: int, which: str) -> Ptr: ...  # a drafter layer's K or V cache
    def lane_bytes(self, layer: int) -> int: ...  # bytes between two sequences' lanes of a target layer's K (or V)
    def dlane_bytes(self, layer: int) -> int: ...  # the same for a drafter layer


class Placeholders:
    """Pointers for looking at a program's launches without a device: every address is null."""

    def W(self, name: str, byte_offset: int = 0) -> Ptr:
        return NULL

    def A(self, name: str, row: int = 0) -> Ptr:
        return NULL

    def KV(self, layer: int, which: str) -> Ptr:
        return NULL

    def DKV(self, layer: int, which: str) -> Ptr:
        return NULL

    def lane_bytes(self, layer: int) -> int:
        return 0

    def dlane_bytes(self, layer: int) -> int:
        return 0


@dataclass
class Copy2D:
    """A strided device copy (cuMemcpy2DAsync): `height` rows of `width` bytes between pitched buffers."""

    label: str
    src: Ptr
    src_pitch: int
    dst: Ptr
    dst_pitch: int
    width: int
    height: int


def _grid(
    e: KernelEntry, rows: int, rowwise: bool = False, splits: bool = True, images: int | None = None
) -> tuple[int, int, int]:
    """Launch grid for `rows` rows, by the planner's rules in the manifest (codegen/families/__init__.py): the
    manifest's grid is sized for the kernel's maximum; ROW_AXIS kernels loop rows grid-stride (no more blocks than
    rows); ROW_GRID (axis, mul, div[, cap]) kernels need ceil(rows * mul / div) blocks on that axis, at most cap; a
    rowwise launch (one query a block) uses ROWWISE_GRID, and ROWWISE_SPLITS[rows - 1] key splits on axis 2 (with
    `splits`, EngineOptions.rowwise_splits; else every planned split, as before the planner's per-row-count table:
    the ablation in docs/BENCHMARKS.md); an IMAGE_AXIS kernel `images` blocks on that axis (None: the planned most,
    whose blocks past the launch's images exit)."""
    g, p = list(e.grid), e.params
    if "IMAGE_AXIS" in p and images is not None:
        g[int(p["IMAGE_AXIS"])] = images
    if "ROW_AXIS" in p:
        g[int(p["ROW_AXIS"])] = max(1, min(rows, g[int(p["ROW_AXIS"])]))
    rule = p.get("ROWWISE_GRID" if rowwise else "ROW_GRID")
    if rule:
        axis, mul, div, *cap = (int(v) for v in rule)
        g[axis] = min([-(-rows * mul // div), *cap])
    if rowwise and p.get("ROWWISE_SPLITS") and splits:
        g[2] = int(p["ROWWISE_SPLITS"][rows - 1])
    return g[0], g[1], g[2]


def _int(v: Any, rows: int) -> int:
    """An integer of a program: a constant or ["rows", a, b] = a * rows + b."""
    return int(v) if not isinstance(v, list) else int(v[1]) * rows + int(v[2])


class Forward:
    """The manifest's step programs for one KV dtype, bound on demand through `ptr` (set by the engine)."""

    def __init__(self, spec: ModelSpec, manifest: KernelManifest, kv_dtype: str, max_rows: int) -> None:
        self.spec, self.manifest, self.kv_dtype, self.max_rows = spec, manifest, kv_dtype, max_rows
        self.programs: dict = manifest.programs.get(kv_dtype, {})
        self.ptr: Pointers = Placeholders()

    def missing(self, group: str, *keys: str) -> list[str]:
        """What the manifest lacks for `group` ("core", "ext", "speculative"): its recorded reasons, or the
        programs among `keys` it does not hold, or a program naming a kernel it does not list."""
        out = list(self.manifest.programs_missing.get(group) or [])
        for key in keys:
            if key not in self.programs:
                out.append(f"the step program {key!r} for KV {self.kv_dtype}")
                continue
            for rng in self.programs[key]:
                out += [
                    f"kernel {op['kernel']} (step program {key!r})"
                    for op in rng["launches"]
                    if op["kernel"] not in self.manifest.kernels
                ]
        return list(dict.fromkeys(out))

    def probe(self) -> list[str]:
        keys = (
            [program_key(decode=True, greedy=g) for g in (True, False)]
            + [program_key(last=last) for last in (True, False)]
            + [program_key(batched=True, greedy=False)]
        )
        return self.missing("core", *keys)

    def probe_ext(self) -> list[str]:
        return self.missing("ext", program_key(decode=True, ext=True), program_key(batched=True, score=True))

    def ops(
        self,
        rows: int,
        decode: bool = False,
        last: bool = True,
        greedy: bool = True,
        taps: bool = False,
        all_logits: bool = False,
        batched: bool = False,
        ext: bool = False,
        score: bool = False,
        images: bool = False,
    ) -> list[Op]:
        """The launches of one forward over `rows` tokens (codegen/lower.py documents each kind's flags)."""
        return self.program(program_key(decode, last, greedy, taps, all_logits, batched, ext, score, images), rows)

    def program(self, key: str, rows: int) -> list[Op]:
        return [self._bind(op, rows, key) for op in self._range(key, rows)["launches"]]

    def span(self, keys: list[str], rows: int) -> tuple[int, int]:
        """(lo, hi): the row counts around `rows` for which each program of `keys` runs the same launches."""
        ranges = [self._range(key, rows) for key in keys]
        return max(r["lo"] for r in ranges), min(r["hi"] for r in ranges)

    def _range(self, key: str, rows: int) -> dict:
        """The manifest's row range of program `key` that holds `rows` ({"lo", "hi", "launches"})."""
        ranges = self.programs.get(key)
        if ranges is None:
            raise BackendError(
                f"cuda backend: the kernel manifest has no step program {key!r} for KV "
                f"{self.kv_dtype}; rebuild with `thorgen build`"
            )
        rng = next((r for r in ranges if r["lo"] <= rows <= r["hi"]), None)
        if rng is None:
            spans = ", ".join(f"{r['lo']}-{r['hi']}" for r in ranges)
            raise BackendError(f"cuda backend: step program {key!r} covers {spans} rows, not {rows}")
        return rng

    def _bind(self, op: dict, rows: int, key: str) -> Op:
        entry = self.manifest.kernels.get(op["kernel"])
        if entry is None:
            raise BackendError(
                f"cuda backend: step program {key!r} names kernel {op['kernel']}, which the manifest "
                "lacks; rebuild with `thorgen build`"
            )
        args = {n: self._value(v, rows) for n, v in op["args"].items()}
        return Op(
            op["label"],
            entry,
            args,
            _int(op["rows"], rows),
            int(op.get("branch", 0)),
            bool(op.get("join")),
            bool(op.get("rowwise")),
            bool(op.get("pdl", True)),
        )

    def _value(self, v: Any, rows: int) -> Any:
        if not isinstance(v, list) or v[0] == "rows":
            return _int(v, rows)
        kind, p = v[0], self.ptr
        if kind == "A":
            return Ptr(p.A(v[1], _int(v[2], rows)).address + _int(v[3], rows))
        if kind == "W":
            return p.W(v[1], _int(v[2], rows))
        if kind in ("KV", "DKV"):
            base = p.KV(int(v[1]), v[2]) if kind == "KV" else p.DKV(int(v[1]), v[2])
            return Ptr(base.address + _int(v[3], rows))
        if kind == "lane_bytes":
            return p.lane_bytes(int(v[1]))
        if kind == "dlane_bytes":
            return p.dlane_bytes(int(v[1]))
        if kind == "NULL":
            return NULL
        raise BackendError(f"cuda backend: a step program argument {v!r} this runtime cannot bind; rebuild")
