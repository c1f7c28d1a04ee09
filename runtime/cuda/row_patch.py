"""Runtime stage: `RowPatch`, which sets a bound eager launch list for another row count in place.

Within one row range of a step program (codegen/programs.py: the same kernels for every row count from lo to hi),
a launch's arguments and its rows are affine in the chunk's row count (["rows", a, b], activation rows at a fixed
pitch), and its grid follows its rows (`_grid`). So a list bound once for that range serves every row count in it:
the arguments that follow the row count are written into the packed parameters and those grids recomputed, the
same values a fresh `LaunchLists.bind` of the program at that row count would give, at a fraction of its cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..manifest import KernelEntry
from .kernels import Launch, PackedArgs, Ptr
from .programs import Copy2D, _grid


@dataclass
class RowPatch:
    """The row-dependent parts of a bound launch list, and the row count they are set for."""

    rows: int
    args: list[tuple[PackedArgs, int, int, int]] = field(default_factory=list)  # (params, index, slope, intercept)
    grids: list[tuple[Launch, KernelEntry, bool, int, int]] = field(default_factory=list)  # (.., rowwise, slope, +)

    def apply(self, rows: int, splits: bool) -> None:
        """Set the list for `rows` (`splits`: EngineOptions.rowwise_splits, as `LaunchLists.bind` reads it)."""
        if rows == self.rows:
            return
        for params, i, slope, intercept in self.args:
            params.set(i, slope * rows + intercept)
        for launch, entry, rowwise, slope, intercept in self.grids:
            launch.regrid(_grid(entry, slope * rows + intercept, rowwise, splits))
        self.rows = rows


def _as_int(v: Any) -> int | None:
    if isinstance(v, Ptr):
        return v.address
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _affine(values: list[int | None], points: list[int]) -> tuple[int, int] | None:
    """(slope, intercept) of integers that follow the row counts `points` exactly, else None."""
    if any(v is None for v in values):
        return None
    v0, v1 = values[0], values[1]
    assert v0 is not None and v1 is not None
    slope, rem = divmod(v1 - v0, points[1] - points[0])
    intercept = v0 - slope * points[0]
    if rem or any(v != slope * p + intercept for v, p in zip(values, points)):
        return None
    return slope, intercept


def row_patch(
    launches: list[tuple[str, Any]], ops: list, ops_at: Callable[[int], list], rows: int, span: tuple[int, int]
) -> RowPatch | None:
    """The RowPatch of `launches` (bound from `ops`, which is `ops_at(rows)`) over the row range `span` (lo, hi),
    found by comparing the program at up to two more row counts of the range; None where a launch differs
    otherwise than affinely in the row count (then the list serves `rows` only)."""
    lo, hi = span
    points = [rows, *dict.fromkeys(r for r in (lo, hi, (lo + hi) // 2) if r != rows)][:3]
    patch = RowPatch(rows)
    if len(points) == 1:
        return patch
    programs = [ops_at(r) for r in points[1:]]
    if any(len(p) != len(ops) for p in programs):
        return None
    for (_, fn), *same_op in zip(launches, ops, *programs, strict=True):
        first = same_op[0]
        if isinstance(first, Copy2D):
            if any(op != first for op in same_op):
                return None
            continue
        what = (first.label, first.entry.name, first.branch, first.join, first.rowwise, first.pdl)
        if any((op.label, op.entry.name, op.branch, op.join, op.rowwise, op.pdl) != what for op in same_op):
            return None
        launch = getattr(fn, "launch", fn)
        for i, name in enumerate(first.entry.args):
            if all(op.args[name] == first.args[name] for op in same_op):
                continue
            fit = _affine([_as_int(op.args[name]) for op in same_op], points)
            if fit is None:
                return None
            if fit[0]:
                patch.args.append((launch.args, i, *fit))
        fit = _affine([op.rows for op in same_op], points)
        if fit is None:
            return None
        if fit[0]:
            patch.grids.append((launch, first.entry, first.rowwise, *fit))
    return patch


__all__ = ["RowPatch", "row_patch"]
