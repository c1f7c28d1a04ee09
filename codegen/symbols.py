"""The symbolic arguments of lowered launches: addresses (`Sym`) and KV lane strides (`LaneBytes`) that the runtime
binds to its buffers."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class Sym:
    """A symbolic device address: activation `name` row `row` (A), weight `name` (W), layer `name`'s K or V cache
    (KV / DKV), or null; plus `off` bytes."""

    kind: str
    name: Any = ""
    row: int = 0
    off: int = 0
    which: str = ""

    def __add__(self, nbytes: int) -> "Sym":
        return replace(self, off=self.off + nbytes)


@dataclass(frozen=True)
class LaneBytes:
    """Bytes between two sequences' KV lanes of a target (or drafter) layer (the runtime's KV plan knows them)."""

    layer: int
    model: str = "target"


NULL = Sym("NULL")


class Symbols:
    """The Pointers a forward is lowered against: every address a symbol."""

    def W(self, name: str, byte_offset: int = 0) -> Sym:
        return Sym("W", name, 0, byte_offset)

    def A(self, name: str, row: int = 0) -> Sym:
        return Sym("A", name, row)

    def KV(self, layer: int, which: str) -> Sym:
        return Sym("KV", layer, which=which)

    def DKV(self, layer: int, which: str) -> Sym:
        return Sym("DKV", layer, which=which)

    def lane_bytes(self, layer: int) -> LaneBytes:
        return LaneBytes(layer)

    def dlane_bytes(self, layer: int) -> LaneBytes:
        return LaneBytes(layer, "drafter")
