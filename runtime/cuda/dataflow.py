"""Runtime stage: dataflow checks of a step's launch list before it is bound (tests run them on every step shape).

Each launch argument's access comes from the manifest (codegen reads it off the kernel's C signature: a pointer to
const is read, any other pointer is written, possibly also read). Over the activation arena, in launch order:
- a buffer read (a const pointer, or a strided copy's source) must have been written by an earlier launch, or be
  one of the step's inputs (what the engine stages before it launches: token ids, positions, lanes, ...);
- the side stream: a launch on branch 1 runs beside the branch-0 launches after it until one that joins. A
  branch-0 launch before the join may not read what the side stream writes, nor write what it reads or writes;
  the side stream may not read what branch 0 wrote after the fork.
Buffers outside the arena (weights, the KV caches) are state across steps, and not checked. Read-modify-write
buffers (counters, workspaces) count as written, so their reads are not checked either.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable

from .programs import Copy2D, Op
from .kernels import Ptr


class DataflowError(ValueError):
    """A launch list that reads a buffer before anything writes it, or races with its own side stream."""


class Regions:
    """Device address -> the activation region it lies in."""

    def __init__(self, base: int, regions: Iterable[Any]) -> None:  # regions: memory.Region values
        spans = sorted((base + r.offset, base + r.offset + r.nbytes, r.name) for r in regions if r.nbytes)
        self._starts = [s for s, _, _ in spans]
        self._spans = spans

    def name(self, address: int) -> str | None:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0 and address < self._spans[i][1]:
            return self._spans[i][2]
        return None


class PlannedPointers:
    """Forward's Pointers over an activation plan, with no device memory: the arena at `base`, every weight and
    KV cache address far above it (outside the arena, so never checked). Lets the checks run on any model's step
    shapes, the full-size one included, on a CPU."""

    OUTSIDE = 1 << 44

    def __init__(self, plan: Any, base: int = 1 << 32) -> None:  # plan: memory.ArenaPlan
        self.plan, self.base = plan, base
        self.regions = Regions(base, plan.regions.values())

    def A(self, name: str, row: int = 0) -> Ptr:
        r = self.plan.regions[name]
        return Ptr(self.base + r.offset + row * (r.nbytes // r.shape[0]))

    def W(self, name: str, byte_offset: int = 0) -> Ptr:
        return Ptr(self.OUTSIDE + byte_offset)

    def KV(self, layer: int, which: str) -> Ptr:
        return self.W("kv")

    def DKV(self, layer: int, which: str) -> Ptr:
        return self.W("dkv")

    def lane_bytes(self, layer: int) -> int:
        return 1 << 20

    def dlane_bytes(self, layer: int) -> int:
        return 1 << 20


def accesses(op: Any, regions: Regions) -> tuple[list[str], list[str]]:
    """(activation regions the launch reads, those it writes)."""
    if isinstance(op, Copy2D):
        pairs = [(op.src.address, "r"), (op.dst.address, "w")]
    else:
        if not op.entry.access:
            raise DataflowError(
                f"{op.label}: kernel {op.entry.name} has no argument access in the manifest; "
                "rebuild with `thorgen build`"
            )
        pairs = [(getattr(v, "address", None), op.entry.access.get(a, "v")) for a, v in op.args.items()]
    reads, writes = [], []
    for address, mode in pairs:
        name = regions.name(address) if address else None
        if name is not None and mode in ("r", "w"):
            (reads if mode == "r" else writes).append(name)
    return reads, writes


def check_step(ops: list, regions: Regions, inputs: Iterable[str], what: str = "step") -> None:
    """DataflowError naming the first launch of `ops` that breaks a rule of the module docstring."""
    main = set(inputs)  # what branch-0 launches may read
    side_seen: set[str] | None = None  # what the open side-stream group may read (None: no group open)
    side_reads: set[str] = set()
    side_writes: set[str] = set()
    after_fork: set[str] = set()  # what branch 0 wrote since the fork
    for i, op in enumerate(ops):
        reads, writes = accesses(op, regions)
        where = f"{what}: launch {i} ({op.label})"
        branch = getattr(op, "branch", 0)
        if isinstance(op, Op) and op.join and side_seen is not None:
            main |= side_writes
            side_seen, side_reads, side_writes, after_fork = None, set(), set(), set()
        if branch == 1:
            if side_seen is None:  # the fork: the side stream sees what branch 0 wrote so far
                side_seen = set(main)
            for r in reads:
                if r in after_fork:
                    raise DataflowError(f"{where} on the side stream reads {r!r}, which branch 0 writes after the fork")
                if r not in side_seen and r not in side_writes:
                    raise DataflowError(f"{where} reads {r!r} before any launch writes it")
            side_reads |= set(reads)
            side_writes |= set(writes)
            continue
        for r in reads:
            if r in side_writes:
                raise DataflowError(f"{where} reads {r!r} while the side stream may still be writing it (no join)")
            if r not in main:
                raise DataflowError(f"{where} reads {r!r} before any launch writes it")
        for w in writes:
            if w in side_reads or w in side_writes:
                raise DataflowError(f"{where} writes {w!r} while the side stream may still use it (no join)")
        main |= set(writes)
        if side_seen is not None:
            after_fork |= set(writes)
    if side_seen is not None:
        raise DataflowError(f"{what}: the side stream's launches are never joined (it writes {sorted(side_writes)})")
