"""Model spec stage: a minimal safetensors reader (memory-mapped) and streaming one-file writer.

Format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets: [begin, end]},
"__metadata__": {...}}, then the tensor bytes (offsets relative to the end of the header, contiguous).
Reading never loads tensor data: one read-only np.memmap per file, per-tensor arrays are views into it.
Writing streams: the header is computed up front from (name, dtype, shape) and tensor bytes are appended one
tensor (or one chunk of a tensor) at a time, so a 16 GB checkpoint never sits in memory. A checkpoint of
several shards (and its index) is written by safetensors_shards.py.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

# safetensors dtype -> (numpy dtype of the raw array we hand out, bytes per element)
DTYPES: dict[str, tuple[np.dtype, int]] = {
    "BF16": (np.dtype(np.uint16), 2),
    "F16": (np.dtype(np.float16), 2),
    "F32": (np.dtype(np.float32), 4),
    "F64": (np.dtype(np.float64), 8),
    "F8_E4M3": (np.dtype(np.uint8), 1),
    "F8_E5M2": (np.dtype(np.uint8), 1),
    "U8": (np.dtype(np.uint8), 1),
    "I8": (np.dtype(np.int8), 1),
    "I16": (np.dtype(np.int16), 2),
    "U16": (np.dtype(np.uint16), 2),
    "I32": (np.dtype(np.int32), 4),
    "U32": (np.dtype(np.uint32), 4),
    "I64": (np.dtype(np.int64), 8),
    "U64": (np.dtype(np.uint64), 8),
    "BOOL": (np.dtype(np.bool_), 1),
}
MAX_HEADER_BYTES = 100 << 20  # the official reader's limit
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint file that thorgen cannot use: the message names the file and the tensor."""


class TensorLike(Protocol):
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offset relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    n = DTYPES[dtype][1]
    for d in shape:
        n *= int(d)
    return n


class SafetensorsFile:
    """One .safetensors file: validated header, lazily memory-mapped tensor views."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.entries, self.metadata, self.data_start = read_header(self.path)
        self._mm: np.memmap | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def array(self, name: str) -> np.ndarray:
        """Read-only view of one tensor (BF16 -> uint16, F8 -> uint8 bit patterns); reads nothing up front."""
        e = self.entries.get(name)
        if e is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        np_dtype = DTYPES[e.dtype][0]
        if e.nbytes == 0:
            return np.zeros(e.shape, dtype=np_dtype)
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self.data_start + e.begin : self.data_start + e.end]
        return raw.view(np_dtype).reshape(e.shape)


def read_header(path: Path) -> tuple[dict[str, Entry], dict, int]:
    """Parse and validate a safetensors header against the file size; returns (entries, metadata, data_start)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: file is {size} bytes, too short to be safetensors (truncated?)")
            (hlen,) = struct.unpack("<Q", head)
            if hlen > MAX_HEADER_BYTES or 8 + hlen > size:
                raise CheckpointError(
                    f"{path}: header length {hlen} does not fit the {size}-byte file "
                    "(truncated or not a safetensors file)"
                )
            raw = f.read(hlen)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + hlen, size - 8 - hlen
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r}: malformed header entry {info!r}") from exc
        if dtype not in DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r}: unsupported dtype {dtype!r}")
        if end - begin != tensor_nbytes(dtype, shape) or begin < 0:
            raise CheckpointError(
                f"{path}: tensor {name!r}: offsets [{begin}, {end}] do not match "
                f"{dtype}{list(shape)} ({tensor_nbytes(dtype, shape)} bytes)"
            )
        if end > data_size:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs data bytes up to {end} but the file holds only "
                f"{data_size} after its header (file truncated?)"
            )
        entries[name] = Entry(name, dtype, shape, begin, end)
    return entries, metadata, data_start


# ---- writing ------------------------------------------------------------------------------------------------------


def build_header(tensors: Iterable[TensorLike], metadata: dict | None = None) -> tuple[bytes, list[Entry]]:
    """Header bytes (length prefix + JSON padded to 8 bytes) and the contiguous offset plan, in the given order."""
    entries, offset, body = [], 0, {}
    if metadata:
        body["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for t in tensors:
        n = tensor_nbytes(t.dtype, t.shape)
        entries.append(Entry(t.name, t.dtype, tuple(t.shape), offset, offset + n))
        body[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    if len({e.name for e in entries}) != len(entries):
        raise ValueError("build_header: duplicate tensor names")
    js = json.dumps(body, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)  # 8-byte aligned data section, as the official writer does
    return struct.pack("<Q", len(js)) + js, entries


class StreamingWriter:
    """Writes one safetensors file: the header first, then tensors strictly in header order, chunk by chunk."""

    def __init__(self, path: str | os.PathLike, tensors: Iterable[TensorLike], metadata: dict | None = None) -> None:
        self.path = Path(path)
        header, self.entries = build_header(tensors, metadata)
        self._f = open(self.path, "wb")
        self._f.write(header)
        self._i = 0  # index of the tensor being written
        self._done = 0  # bytes of it written so far

    def append(self, name: str, data: np.ndarray | bytes) -> None:
        """Append bytes of tensor `name` (the whole tensor or the next chunk of it, C order)."""
        if self._i >= len(self.entries):
            raise ValueError(f"{self.path}: all tensors already written, got more for {name!r}")
        e = self.entries[self._i]
        if name != e.name:
            raise ValueError(f"{self.path}: expected data for {e.name!r} (header order), got {name!r}")
        if isinstance(data, np.ndarray):
            buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        else:
            buf = memoryview(data).cast("B")
        if self._done + buf.nbytes > e.nbytes:
            raise ValueError(f"{self.path}: tensor {name!r} gets {self._done + buf.nbytes} bytes, expects {e.nbytes}")
        self._f.write(buf)
        self._done += buf.nbytes
        if self._done == e.nbytes:
            self._i, self._done = self._i + 1, 0

    write = append

    @property
    def complete(self) -> bool:
        return self._i == len(self.entries)

    def close(self) -> None:
        if self._f.closed:
            return
        self._f.close()
        if not self.complete:
            name = self.entries[self._i].name
            raise ValueError(f"{self.path}: closed before tensor {name!r} was fully written")

    def __enter__(self) -> "StreamingWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


@dataclass(frozen=True)
class _T:
    name: str
    dtype: str
    shape: tuple[int, ...]


def write_safetensors(
    path: str | os.PathLike, arrays: dict[str, tuple[str, np.ndarray]], metadata: dict | None = None
) -> None:
    """Small-file convenience: {name: (safetensors dtype, raw array)} -> one file."""
    infos = [_T(n, dt, tuple(a.shape)) for n, (dt, a) in arrays.items()]
    with StreamingWriter(path, infos, metadata if metadata is not None else {"format": "pt"}) as w:
        for n, (_, a) in arrays.items():
            w.append(n, a)


# ---- reading a checkpoint folder ----------------------------------------------------------------------------------


class SafetensorsDir:
    """All tensors of a model folder: `model.safetensors.index.json` + shards, or a single `model.safetensors`."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = Path(folder)
        self.files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}  # tensor name -> file
        index = self.folder / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except (OSError, ValueError, KeyError, TypeError, AssertionError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            for fname in sorted(set(weight_map.values())):
                if not (self.folder / fname).is_file():
                    some = next(n for n, f in weight_map.items() if f == fname)
                    raise CheckpointError(f"{index}: shard {fname} (holding e.g. tensor {some!r}) is missing")
                self.files[fname] = SafetensorsFile(self.folder / fname)
            for name, fname in weight_map.items():
                if name not in self.files[fname]:
                    raise CheckpointError(
                        f"{self.folder / fname}: tensor {name!r} listed in {INDEX_NAME} is not in this shard"
                    )
        elif (self.folder / SINGLE_NAME).is_file():
            self.files[SINGLE_NAME] = SafetensorsFile(self.folder / SINGLE_NAME)
        else:
            raise CheckpointError(f"{self.folder}: no {SINGLE_NAME} and no {INDEX_NAME}")
        for f in self.files.values():
            for name in f.entries:
                if name in self.where:
                    raise CheckpointError(f"tensor {name!r} is stored twice: in {self.where[name].path} and {f.path}")
                self.where[name] = f

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def entry(self, name: str) -> Entry:
        return self.where[name].entries[name]

    def file_of(self, name: str) -> Path:
        return self.where[name].path

    def array(self, name: str) -> np.ndarray:
        f = self.where.get(name)
        if f is None:
            raise CheckpointError(f"{self.folder}: no tensor {name!r}")
        return f.array(name)
