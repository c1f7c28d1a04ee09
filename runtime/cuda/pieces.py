"""Runtime stage: `PrefillPieces`, one prefill chunk run a few layers at a time between decode steps.

A chunk holding an image span cannot be split by position (the span attends within itself), and at the real model's
size a 1120-budget image's chunk takes tens of milliseconds: run whole, it holds back every sequence decoding beside
it by that much (so can any long text chunk: EngineOptions.prefill_pieces cuts those too). Cut at layer boundaries
instead, each piece is one call of the runner's prefill, and the decode steps between pieces run as usual. They
share the activation arena with the chunk, so what crosses a cut is saved after a piece and restored before the
next: the regions the rest of the chunk reads before writing them (`live_in`, from the manifest's argument accesses,
as runtime/cuda/dataflow.py checks a step), less those the engine stages again for every call (token ids,
positions, lanes, sampling parameters, the page table, logits masks). The K/V written by a piece's layers is the
sequence's own and stays where it is.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .dataflow import Regions, accesses
from .kernels import Ptr
from .memory import Arena, alloc
from .programs import Copy2D
from .staging import Slot

# A piece's rows x layers. On an H100 the 1,614-row chunk of a 1120-budget image took ~60 ms for 30 layers, ~2 ms a
# layer: 6,144 row-layers is ~4 of its layers, ~8 ms, about one batched decode step of 8 sequences. Measured as
# pieces of 512-row text chunks (H100, b8e026d): a step with a piece and 8 decodes ~20 ms, not yet placed.
PIECE_ROW_LAYERS = 6144
# calls for other chunks a chunk in flight may go without running a piece before it is forgotten (it starts again
# from its first layer if it comes back)
MAX_WAITS = 64
PLANS_KEPT = 16  # chunk shapes whose cuts are kept (working them out walks the chunk's ~400 launches per cut)
# pieces' launch lists kept bound, apart from LaunchLists' own (a shape's pieces would push out whole chunks' lists)
BOUND_KEPT = 32
# staged again by every call of the runner's prefill (or engine state another sequence may change between pieces)
RESTAGED = frozenset(
    {"ids", "positions", "lanes", "params", "kv_pages", "logit_rows", "logit_counts", "logit_biases", "logit_masks"}
)


def layer_of(label: str) -> int | None:
    """The target layer a launch belongs to ("layers.7.qkv" -> 7), None outside the layers."""
    parts = label.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() else None


def piece_ranges(ops: list, rows: int, budget: int | None = None) -> list[tuple[int, int]]:
    """[start, end) launch ranges of the pieces: whole layers (never inside a side-stream group), about `budget`
    (default PIECE_ROW_LAYERS) rows x layers each; the first piece holds what runs before layer 0, the last what
    runs after the last layer."""
    per_piece = max(1, (budget or PIECE_ROW_LAYERS) // max(rows, 1))
    cuts, layers, open_side, prev = [], 0, False, None
    for i, op in enumerate(ops):
        layer = layer_of(op.label)
        if layer is not None and layer != prev and prev is not None and not open_side:
            layers += 1
            if layers % per_piece == 0:
                cuts.append(i)
        if layer is not None:
            prev = layer
        if getattr(op, "branch", 0) == 1:
            open_side = True
        elif getattr(op, "join", False):
            open_side = False
    bounds = [0, *cuts, len(ops)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def live_in(ops: list, regions: Regions) -> list[str]:
    """Arena regions `ops` read before writing them, in first-read order."""
    written: set[str] = set()
    live: list[str] = []
    for op in ops:
        reads, writes = accesses(op, regions)
        live += [r for r in reads if r not in written and r not in live]
        written |= set(writes)
    return live


def kept_across(ops: list, cut: int, regions: Regions) -> list[str]:
    """The regions to keep across a cut before launch `cut`: what the launches after it read before writing, and
    what the launches before it wrote that those after it write too. The manifest cannot tell a written argument
    that is also read (the tails add into the residual stream in place) from a pure output, so any such region
    is kept; the engine stages the RESTAGED ones again at every call."""
    before: set[str] = set()
    for op in ops[:cut]:
        before |= set(accesses(op, regions)[1])
    after: list[str] = []
    for op in ops[cut:]:
        reads, writes = accesses(op, regions)
        after += [r for r in (*reads, *writes) if r not in after]
    live = live_in(ops[cut:], regions)
    return [r for r in after if (r in live or r in before) and r not in RESTAGED]


T = TypeVar("T")


def _cached(cache: OrderedDict[tuple, T], key: tuple, make: Callable[[], T], kept: int) -> T:
    """cache[key], made by `make()` when missing; beyond `kept` entries the least recently used goes."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = make()
        if len(cache) > kept:
            cache.popitem(last=False)
    cache.move_to_end(key)
    return value


@dataclass(frozen=True)
class _Plan:
    """Where a chunk of one shape is cut and what crosses each cut (the same for every chunk of that shape)."""

    ops: list
    ranges: list[tuple[int, int]]
    kept: list[list[str]]  # per cut: the regions kept in the store across it


@dataclass
class _Chunk:
    key: tuple  # what the chunk is: its lane, positions and program flags (another key starts from layer 0)
    shape: tuple  # its launch list's shape (Engine._chunk_ops): chunks of one shape share their plan and bindings
    plan: _Plan
    done: int = 0  # pieces run
    waits: int = 0  # calls for other chunks since this one last ran a piece
    token: Slot | None = None  # once its last piece ran: where it copied the sampled token (Engine.prefill_piece)


class PrefillPieces:
    """The chunk in flight (one at a time) and the device store that keeps what crosses its cuts."""

    def __init__(self, device: Any, act: Arena) -> None:
        self.device, self.act = device, act
        self.regions = Regions(act.buffer.ptr, act.plan.regions.values())
        self.chunk: _Chunk | None = None
        self.sampled_event = device.event(timing=False)  # recorded once a chunk's last piece copied its token out
        self._store: Any = None
        self._plans: OrderedDict[tuple, _Plan] = OrderedDict()
        self._bound: OrderedDict[tuple, list] = OrderedDict()

    def busy(self, key: tuple) -> bool:
        """Whether another chunk is in flight: the chunk `key` then waits its turn (run whole, it would hold the
        decode steps back as long as running it in pieces avoids). A chunk in flight that has not moved while
        others asked MAX_WAITS times (its sequence is no longer scheduled) is forgotten instead."""
        if self.chunk is None or self.chunk.key == key:
            return False
        self.chunk.waits += 1
        if self.chunk.waits > MAX_WAITS:
            self.chunk = None
            return False
        return True

    def current(self, key: tuple) -> _Chunk | None:
        return self.chunk if self.chunk is not None and self.chunk.key == key else None

    def begin(self, key: tuple, shape: tuple, ops: Callable[[], list], rows: int) -> _Chunk:
        """Start the chunk `key` (launch list `ops()` of `shape`, `rows` rows) in pieces, the store sized for its
        largest cut. The cuts of a shape are worked out once (PLANS_KEPT shapes, least recently used first out)."""
        shape = (*shape, PIECE_ROW_LAYERS)  # (the budget the cuts were made for)

        def cut() -> _Plan:
            listed = ops()
            ranges = piece_ranges(listed, rows)
            return _Plan(listed, ranges, [kept_across(listed, b, self.regions) for _, b in ranges[:-1]])

        plan = _cached(self._plans, shape, cut, PLANS_KEPT)
        self._ensure(max([sum(self.act[n].nbytes for n in names) for names in plan.kept], default=0))
        self.chunk = _Chunk(key, shape, plan)
        return self.chunk

    def next_piece(self, chunk: _Chunk, bind: Callable[[list], list]) -> list:
        """The next piece's launch list, bound by `bind` the first time a chunk of its shape runs it: the store
        copied back into the regions it kept, the piece's own launches, then what the rest of the chunk reads
        copied into the store."""
        i, plan = chunk.done, chunk.plan
        chunk.done += 1
        chunk.waits = 0

        def ops() -> list:
            a, b = plan.ranges[i]
            listed = (self._copies(plan.kept[i - 1], restore=True) if i else []) + plan.ops[a:b]
            if i < len(plan.kept):
                listed += self._copies(plan.kept[i], restore=False)
            return listed

        return _cached(self._bound, (*chunk.shape, i, self._store.ptr), lambda: bind(ops()), BOUND_KEPT)

    def finished(self, chunk: _Chunk) -> bool:
        return chunk.done == len(chunk.plan.ranges)

    def drop(self, lane: int | None = None) -> None:
        """Forget the chunk in flight (of KV lane `lane`, or any): it ends, was preempted or failed."""
        if self.chunk is not None and (lane is None or self.chunk.key[0] == lane):
            self.chunk = None

    def sampled(self, lane: int) -> bool:
        """Whether the chunk in flight is of KV lane `lane` and ran its last piece (only its token is left)."""
        return self.chunk is not None and self.chunk.token is not None and self.chunk.key[0] == lane

    @property
    def lane(self) -> int | None:
        """The KV lane of the chunk in flight (None: none)."""
        return None if self.chunk is None else self.chunk.key[0]

    def _copies(self, names: list[str], restore: bool) -> list[Copy2D]:
        out, offset = [], 0
        for name in names:
            n = self.act[name].nbytes
            region, kept = Ptr(self.act[name].ptr), Ptr(self._store.ptr + offset)
            src, dst = (kept, region) if restore else (region, kept)
            out.append(Copy2D(f"{'restore' if restore else 'keep'} {name}", src, n, dst, n, n, 1))
            offset += n
        return out

    def _ensure(self, nbytes: int) -> None:
        if self._store is not None and self._store.nbytes >= nbytes:
            return
        if self._store is not None:
            self._store.free()
        self._store = alloc(self.device, max(nbytes, 1), "prefill pieces' store")

    def destroy(self) -> None:
        if self._store is not None:
            self._store.free()
            self._store = None
        self.sampled_event.destroy()
        self.chunk = None


__all__ = ["PIECE_ROW_LAYERS", "PrefillPieces", "kept_across", "layer_of", "live_in", "piece_ranges"]
