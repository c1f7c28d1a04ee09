"""Codegen stage: small functions the families share (block sizes, name tags, row-kernel grids)."""

from __future__ import annotations

from ..arch import ArchSpec
from ..kernel_spec import PlanError
from . import MAX_STEP_TOKENS


def row_threads(width: int, arch: ArchSpec, what: str, at_least: int = 0) -> int:
    """Largest multiple of 32 <= the arch's block size (or `at_least`, when larger) that divides `width` (one row
    per block, registers hold width/threads elements each)."""
    for t in range(max(arch.threads_per_block, at_least), 31, -32):
        if width % t == 0:
            return t
    raise PlanError(f"{what}: width {width} has no block size (multiple of 32) dividing it")


def row_grid() -> tuple[int, int, int]:
    """Row kernels loop rows grid-stride; the runtime launches grid.x = min(T, MAX_STEP_TOKENS)."""
    return (MAX_STEP_TOKENS, 1, 1)


def ftag(value: float) -> str:
    """A float as an identifier-safe tag: 1e-06 -> 1em06, 53.0 -> 53p0."""
    return repr(float(value)).replace("-", "m").replace("+", "").replace(".", "p")


def require(cond: bool, message: str) -> None:
    if not cond:
        raise PlanError(message)
