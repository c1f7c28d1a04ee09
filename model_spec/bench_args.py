"""The kernel benchmark's argument records, written by codegen into bench_cases.json and read back by the runtime.

A case's arguments are buffers (a dtype, an element count and how to fill them) or by-value scalars (a C type and a
value). Both stages use these two records and their JSON forms, as they share the step programs' `Op`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BENCH_CASES_NAME = "bench_cases.json"
BENCH_CASES_SCHEMA = 1
BUF_DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "u8": 1, "i32": 4, "u32": 4, "u64": 8, "i64": 8}  # bytes an element
SCALAR_CTYPES = ("i32", "u32", "i64", "u64", "f32", "f64")


@dataclass(frozen=True)
class Buf:
    """A device buffer argument: `count` elements of `dtype` (a BUF_DTYPES key), filled with uniform random values in
    [low, high) (integers for integer dtypes; raw random bytes for "u8"); count 0 passes a null pointer; low == high
    fills the constant (e.g. zeroed counters); non-empty `values` are used as given (tiled to count)."""

    name: str
    dtype: str
    count: int
    low: float = -1.0
    high: float = 1.0
    values: tuple = ()

    def to_json(self) -> dict:
        return {
            "buf": self.name,
            "dtype": self.dtype,
            "count": self.count,
            "low": self.low,
            "high": self.high,
            "values": list(self.values),
        }


@dataclass(frozen=True)
class Scalar:
    """A by-value argument: `ctype` one of SCALAR_CTYPES."""

    name: str
    ctype: str
    value: int | float

    def to_json(self) -> dict:
        return {"scalar": self.name, "ctype": self.ctype, "value": self.value}


def arg_from_json(raw: dict[str, Any]) -> Buf | Scalar:
    """The record a `to_json` form describes; ValueError for an unknown dtype or C type, KeyError for a missing
    field."""
    if "buf" in raw:
        if raw["dtype"] not in BUF_DTYPES:
            raise ValueError(f"buffer {raw['buf']}: unknown dtype {raw['dtype']!r}")
        return Buf(str(raw["buf"]), raw["dtype"], int(raw["count"]), raw["low"], raw["high"], tuple(raw["values"]))
    if raw["ctype"] not in SCALAR_CTYPES:
        raise ValueError(f"scalar {raw['scalar']}: unknown ctype {raw['ctype']!r}")
    return Scalar(str(raw["scalar"]), raw["ctype"], raw["value"])
