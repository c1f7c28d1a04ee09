"""Runtime stage: `LaunchLists`, step programs bound into launch lists: eager ones kept by shape (or by program row
range, set for each row count in place), graphs captured once.

A launch list is [(label, callable(stream))]: prepacked kernel launches (PDL where the kernels' convention and the
program allow it) and strided copies. Branch-1 launches run on a side stream, forked from the main stream at the
first and joined back at the next launch marked `join`; `EngineOptions.fork` off keeps everything on one stream.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from ..backend import BackendError
from .device import Device, Stream, check, driver
from .graphs import CudaGraph
from .kernels import KernelSet
from ..options import EngineOptions
from .programs import Copy2D, _grid
from .row_patch import RowPatch, row_patch

BOUND_KEEP = 64  # eager launch lists kept (a few MB of packed parameters)


def _images(op: Any) -> int | None:
    """The images a launch over several (its kernel's IMAGE_AXIS: the vision attention) covers: its argument B."""
    return int(op.args["B"]) if "IMAGE_AXIS" in op.entry.params else None


def copy2d(op: Copy2D) -> Any:
    """A callable(stream) issuing the strided device-to-device copy `op` (usable inside a graph capture)."""
    cu = driver()
    p = cu.CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = op.src.address, op.src_pitch, op.dst.address, op.dst_pitch
    p.WidthInBytes, p.Height = op.width, op.height

    def run(stream: Any) -> None:
        check(cu.cuMemcpy2DAsync(p, stream.handle), op.label)

    run.kernel = None  # type: ignore[attr-defined]  # profile rows name copies by label
    return run


class LaunchLists:
    """Binds ops for the engine's streams; keeps the captured graphs and the most recent eager lists."""

    def __init__(
        self, device: Device, kernels: KernelSet, stream: Stream, side: Stream, options: EngineOptions, pdl_safe: bool
    ) -> None:
        self.device, self.kernels, self.stream, self.side = device, kernels, stream, side
        # (options may be replaced, e.g. by a probe comparing variants; graphs captured before keep theirs)
        self.options, self.pdl_safe = options, pdl_safe
        # Fork/join events. Eager forwards (prefill chunks, bound again for every ragged chunk) share one pair: a
        # stream wait binds to the event's latest record at the time of the call, so re-recording is safe.
        # Captured graphs (a few, built once) get events of their own, kept until close.
        self._fork_ev, self._join_ev = device.event(timing=False), device.event(timing=False)
        self._graph_events: list[Any] = []
        self.graphs: dict[str, CudaGraph] = {}
        # Eager launch lists of prefill chunks and scoring passes by shape (text chunks by program row range, see
        # eager_rows), most recent last: binding one costs milliseconds of Python (~400 launches) while the GPU
        # waits, and chunks of ever new sizes (a prompt's last, a drafter catch-up's) would each bind one.
        self._bound: OrderedDict[tuple, list[tuple[str, Any]]] = OrderedDict()
        # the lists kept per program row range (eager_rows), with what sets them for a row count
        self._patches: dict[tuple, RowPatch] = {}
        self._per_rows: set[tuple] = set()  # (keys whose programs a RowPatch cannot follow)
        self.binds = 0  # eager lists bound (each a whole program through `bind`)

    @property
    def pdl(self) -> bool:
        """Whether launches may overlap their predecessor's tail (the kernels allow it and the options ask)."""
        return self.pdl_safe and self.options.pdl

    def bind(self, ops: list, captured: bool = False, alone: bool = False) -> list[tuple[str, Any]]:
        """Ops -> (label, callable(stream)) pairs. `alone`: one stream and no PDL, so that events (profiling) see
        each kernel by itself."""
        out: list[tuple[str, Any]] = []
        fork, pdl = self.options.fork and not alone, self.pdl and not alone
        # PDL only between two kernels of one stream, and only where the program allows it (op.pdl): a copy, the
        # host's staging or a cross-stream join is a full dependency.
        after = {0: False, 1: False}
        side_open = False
        for op in ops:
            if isinstance(op, Copy2D):
                out.append((op.label, copy2d(op)))
                after[0] = False
                continue
            branch = getattr(op, "branch", 0) if fork else 0
            opens = branch == 1 and not side_open
            join = side_open and getattr(op, "join", False)
            if opens:
                side_open, after[1] = True, False
            if join:
                side_open, after[0] = False, False
            missing = [n for n in op.entry.args if n not in op.args]
            if missing:
                raise BackendError(
                    f"cuda backend: {op.label}: kernel {op.entry.name} takes {missing}, which the "
                    "engine does not provide (kernel signature changed?)"
                )
            k = self.kernels.kernel(op.entry.name)
            launch = k.bind(
                [op.args[n] for n in op.entry.args],
                grid=_grid(op.entry, op.rows, op.rowwise, self.options.rowwise_splits, _images(op)),
                pdl=pdl and op.pdl and after[branch],
            )
            after[branch] = True
            out.append((op.label, self._on_branch(launch, branch, opens, join, captured)))
        if side_open:
            raise BackendError("cuda backend: a side-stream branch is never joined (forward schedule bug)")
        return out

    def _on_branch(self, launch: Any, branch: int, fork: bool, join: bool, captured: bool) -> Any:
        """The launch, run on the side stream (branch 1; `fork`: first wait for the main stream's work so far) or
        on the main stream (`join`: first wait for everything the side stream has queued)."""
        if not (branch or join):
            return launch
        if captured:
            ev = self.device.event(timing=False)
            self._graph_events.append(ev)
        else:
            ev = self._fork_ev if branch else self._join_ev
        side = self.side

        def run(stream: Any) -> None:
            if branch:
                if fork:
                    ev.record(stream)
                    side.wait(ev)
                launch(side)
            else:
                ev.record(side)
                stream.wait(ev)
                launch(stream)

        run.launch = launch  # type: ignore[attr-defined]  # (RowPatch sets its arguments and grid)
        run.kernel = launch.kernel  # type: ignore[attr-defined]  (profiling labels)
        run.pdl = launch.pdl  # type: ignore[attr-defined]
        return run

    def captured(self, key: str, ops: Callable[[], list], what: str) -> CudaGraph:
        """The graph `key`, captured from `ops()` the first time it is asked for."""
        g = self.graphs.get(key)
        if g is None:
            launches = self.bind(ops(), captured=True)
            g = CudaGraph.capture(self.stream, lambda: [l(self.stream) for _, l in launches], f"{what} ({key})")
            self.graphs[key] = g
        return g

    def drop_graphs(self) -> None:
        """Destroy every captured graph (they are captured again on next use, under the current options)."""
        for g in self.graphs.values():
            g.destroy()
        self.graphs.clear()

    def eager(self, key: tuple, ops: Callable[[], list]) -> list[tuple[str, Any]]:
        """The eager launch list `key`, bound from `ops()` unless one of the most recent lists has that key."""
        launches = self._bound.get(key)
        if launches is None:
            launches = self._keep(key, self.bind(ops()))
        self._bound.move_to_end(key)
        return launches

    def eager_rows(
        self, key: tuple, rows: int, span: tuple[int, int], ops_at: Callable[[int], list]
    ) -> list[tuple[str, Any]]:
        """The eager launch list of `ops_at(rows)`, a program whose row range `span` (lo, hi: the same kernels for
        every row count in it) holds `rows`: one list per `key` and range, bound once and set for each row count
        in place (RowPatch), so chunks of ever new sizes (a drafter catch-up's, a prompt's last) bind nothing."""
        key = (*key, span)
        if key in self._per_rows:
            return self.eager((*key, rows), lambda: ops_at(rows))
        launches, patch = self._bound.get(key), self._patches.get(key)
        if launches is None or patch is None:
            ops = ops_at(rows)
            launches = self.bind(ops)
            patch = row_patch(launches, ops, ops_at, rows, span)
            if patch is None:  # (a launch not affine in the row count: lists per row count, as `eager` keeps)
                self._per_rows.add(key)
                return self._keep((*key, rows), launches)
            self._keep(key, launches)
            self._patches[key] = patch
        patch.apply(rows, self.options.rowwise_splits)
        self._bound.move_to_end(key)
        return launches

    def _keep(self, key: tuple, launches: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Keep a freshly bound list under `key`, dropping the least recently used beyond BOUND_KEEP."""
        self.binds += 1
        self._bound[key] = launches
        if len(self._bound) > BOUND_KEEP:
            old, _ = self._bound.popitem(last=False)
            self._patches.pop(old, None)
        return launches

    def run(self, launches: list[tuple[str, Any]]) -> None:
        for _, launch in launches:
            launch(self.stream)

    def destroy(self) -> None:
        self.drop_graphs()
        self._bound.clear()
        self._patches.clear()
        for ev in [self._fork_ev, self._join_ev, *self._graph_events]:
            ev.destroy()
        self._graph_events = []


__all__ = ["LaunchLists", "copy2d"]
