"""Model spec stage: a checkpoint written as safetensors shards plus the HF index, streamed tensor by tensor or,
for parallel writers, preallocated from the header plan with each tensor pwritten at its offset."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .safetensors_io import INDEX_NAME, SINGLE_NAME, StreamingWriter, TensorLike, build_header, tensor_nbytes


NVFP4_PART_SUFFIXES = (
    "weight_packed",
    "weight_scale",
    "weight_global_scale",
    "input_global_scale",
    "weight",
    "weight_scale_2",
    "input_scale",
)


def unit_key(name: str) -> str:
    """Tensors sharing this key are kept in one shard: the parts of one NVFP4 Linear (compressed-tensors
    P.weight_packed, ... or ModelOpt P.weight, P.weight_scale, P.weight_scale_2, P.input_scale)."""
    prefix, _, last = name.rpartition(".")
    return prefix if last in NVFP4_PART_SUFFIXES else name


def plan_shards(tensors: list[TensorLike], max_shard_bytes: int) -> list[list[TensorLike]]:
    """Split tensors (in order) into shards of at most max_shard_bytes; a Linear's NVFP4 parts never straddle
    two shards, and a unit bigger than the limit gets a shard of its own."""
    units: list[list[TensorLike]] = []
    for t in tensors:
        if units and unit_key(units[-1][-1].name) == unit_key(t.name):
            units[-1].append(t)
        else:
            units.append([t])
    shards: list[list[TensorLike]] = [[]]
    size = 0
    for unit in units:
        n = sum(tensor_nbytes(t.dtype, t.shape) for t in unit)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].extend(unit)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    """File names of an n-shard checkpoint (HF convention; a single shard is plain model.safetensors)."""
    return [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_index(out_dir: Path, files: list[str], shards: list[list[TensorLike]]) -> None:
    """The HF `model.safetensors.index.json` of a multi-shard checkpoint (nothing for a single file)."""
    if len(files) > 1:
        total = sum(tensor_nbytes(t.dtype, t.shape) for s in shards for t in s)
        index = {"metadata": {"total_size": total}, "weight_map": {t.name: f for f, s in zip(files, shards) for t in s}}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


@dataclass(frozen=True)
class PlannedTensor:
    """Where one tensor's bytes go: an absolute byte offset in a preallocated shard file."""

    path: Path
    offset: int
    info: TensorLike


def preallocate_shards(
    out_dir: str | os.PathLike, tensors: list[TensorLike], max_shard_bytes: int, metadata: dict | None = None
) -> list[list[PlannedTensor]]:
    """Random-access alternative to ShardedWriter (parallel writers): writes every shard's header and sizes the
    file (sparse), writes the index, and returns each shard's tensors with absolute offsets. The bytes equal
    ShardedWriter's once every tensor has been written at its offset (e.g. os.pwrite from worker processes)."""
    out_dir = Path(out_dir)
    shards = plan_shards(list(tensors), max_shard_bytes)
    files = shard_names(len(shards))
    meta = metadata if metadata is not None else {"format": "pt"}
    planned = []
    for fname, shard in zip(files, shards):
        header, entries = build_header(shard, meta)
        path = out_dir / fname
        with open(path, "wb") as f:
            f.write(header)
            f.truncate(len(header) + (entries[-1].end if entries else 0))
        planned.append([PlannedTensor(path, len(header) + e.begin, t) for e, t in zip(entries, shard)])
    write_index(out_dir, files, shards)
    return planned


def pwrite_all(fd: int, data: np.ndarray | bytes, offset: int) -> int:
    """os.pwrite the whole buffer (C order) at offset, looping over short writes; returns the bytes written."""
    if isinstance(data, np.ndarray):
        buf = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
    else:
        buf = memoryview(data).cast("B")
    view, pos = buf, offset
    while view.nbytes:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    return buf.nbytes


class ShardedWriter:
    """Writes `model.safetensors` (one shard) or `model-0000i-of-0000n.safetensors` + the HF index, streaming."""

    def __init__(
        self, out_dir: str | os.PathLike, tensors: list[TensorLike], max_shard_bytes: int, metadata: dict | None = None
    ) -> None:
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(list(tensors), max_shard_bytes)
        n = len(self.shards)
        self.files = shard_names(n)
        self.metadata = metadata if metadata is not None else {"format": "pt"}
        self._k = -1
        self._writer: StreamingWriter | None = None
        self._next()

    def _next(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._k += 1
        self._writer = None
        if self._k < len(self.shards):
            self._writer = StreamingWriter(self.out_dir / self.files[self._k], self.shards[self._k], self.metadata)

    def append(self, name: str, data: np.ndarray | bytes) -> None:
        if self._writer is None:
            raise ValueError(f"{self.out_dir}: all shards already written, got more for {name!r}")
        self._writer.append(name, data)
        if self._writer.complete:
            self._next()

    write = append

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()  # raises: a tensor is missing
            self._next()
            if self._k < len(self.shards):
                raise ValueError(f"{self.out_dir}: shards {self.files[self._k :]} were never written")
        write_index(self.out_dir, self.files, self.shards)

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        elif self._writer is not None:
            self._writer._f.close()
