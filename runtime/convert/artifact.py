"""Runtime stage: the repacked-weights artifact (weights.bin + weights.json): format, validation, and one GPU upload.

Format (written by runtime/convert/repack.py): `weights.bin` holds every tensor at a 256-byte aligned offset;
`weights.json` = {"format": "thorgen-weights", "schema", "layout_version", "spec_hash", "model", "arch" (null when
the layout does not depend on it), "lm_head": "nvfp4"|"bf16", "source_format" (the checkpoint's: compressed-tensors |
modelopt | bf16), "linear_formats" ({attention, dense_mlp, experts}: nvfp4 | bf16, as stored in this artifact),
"checksum": "blake2b-128", "total_bytes", "tensors": {name: {"offset", "nbytes", "dtype", "shape", "layout",
"checksum", optional "multiplier" (a one-part NVFP4 matrix's global multiplier), and for matrices in a kernel layout
"logical_shape" [N, K], "fusion" (single|concat|interleave8), "parts" [[source, rows]], "order" (the fp4 byte
order)}}}.
Target tensor names drop the `model.language_model.` prefix; drafter tensors get a `draft.` prefix; stacked
experts are `layers.L.experts.{gate,up,down}_proj.*` with a leading expert axis.
Opening checks the header against what the runtime expects (spec hash, layout version, arch) and the file size;
`verify()` re-hashes tensors (parallel threads: hashlib releases the GIL on large buffers).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import queue
import shutil
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ...model_spec.paths import cache_dir
from ..backend import BackendError

FORMAT = "thorgen-weights"
SCHEMA = 1  # the weights.json structure itself
WEIGHTS_BIN = "weights.bin"
WEIGHTS_JSON = "weights.json"
CHECKSUM = "blake2b-128"
DRAFT_PREFIX = "draft."
ALIGN = 256  # bytes: every tensor and region starts 256-byte aligned (16-byte vector loads, TMA-friendly)
# Names used in manifests, plans and artifacts -> NumPy dtypes (bf16 and fp8 travel as raw 16/8-bit patterns).
_NP_DTYPES = {
    "u8": "uint8",
    "i32": "int32",
    "u32": "uint32",
    "f32": "float32",
    "bf16": "uint16",
    "f16": "float16",
    "e4m3": "uint8",
    "i64": "int64",
    "u16": "uint16",
}


def np_dtype(name: str) -> np.dtype:
    return np.dtype(_NP_DTYPES.get(name, name))


_META_KEYS = ("logical_shape", "fusion", "parts", "order")


class ArtifactError(BackendError):
    """A weights artifact that does not fit this runtime/model/GPU, or is damaged: names what differs."""


def new_hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    layout: str
    checksum: str
    multiplier: float | None = None
    meta: tuple[tuple[str, Any], ...] = ()  # layout extras: logical_shape, fusion, parts, order

    def to_json(self) -> dict:
        out = {
            "offset": self.offset,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "layout": self.layout,
            "checksum": self.checksum,
        }
        if self.multiplier is not None:
            out["multiplier"] = self.multiplier
        out.update(dict(self.meta))
        return out


def default_artifact_dirs(model_dir: str | os.PathLike, spec_hash: str) -> list[Path]:
    """Where `repack-weights` writes by default, in lookup order: <model>/thorgen-<hash12>, then (for a read-only
    model folder) <cache>/weights/<model-name>-<hash12> (model_spec/paths.py cache_dir: ~/.cache/thorgen unless
    $THORGEN_CACHE_DIR or $XDG_CACHE_HOME says otherwise)."""
    model_dir = Path(model_dir).resolve()
    return [model_dir / f"thorgen-{spec_hash[:12]}", cache_dir() / "weights" / f"{model_dir.name}-{spec_hash[:12]}"]


def find_artifact(model_dir: str | os.PathLike, spec_hash: str) -> Path:
    """The default artifact folder of a model; ArtifactError telling how to create it when there is none."""
    dirs = default_artifact_dirs(model_dir, spec_hash)
    for d in dirs:
        if (d / WEIGHTS_JSON).is_file():
            return d
    raise ArtifactError(
        f"no repacked weights for {model_dir} (looked in {', '.join(map(str, dirs))}); "
        f"run `thorgen repack-weights --model {model_dir}` first"
    )


class WeightsArtifact:
    """An opened artifact folder: the parsed manifest and memory-mapped access to weights.bin."""

    def __init__(self, folder: Path, header: dict, tensors: dict[str, TensorEntry]) -> None:
        self.folder, self.header, self.tensors = folder, header, tensors
        self._mm: np.memmap | None = None

    @property
    def bin_path(self) -> Path:
        return self.folder / WEIGHTS_BIN

    @property
    def total_bytes(self) -> int:
        return int(self.header["total_bytes"])

    @property
    def lm_head(self) -> str:
        return str(self.header.get("lm_head", "nvfp4"))

    @classmethod
    def open(
        cls,
        folder: str | os.PathLike,
        spec_hash: str | None = None,
        layout_version: int | None = None,
        arch: str | None = None,
    ) -> "WeightsArtifact":
        """Parse and check an artifact. Every expectation given (spec hash, layout version, device arch) that the
        artifact does not meet is listed in one ArtifactError; a weights.bin shorter than the manifest says is
        reported with the first tensor it cuts."""
        folder = Path(folder)
        jpath = folder / WEIGHTS_JSON
        if not jpath.is_file():
            raise ArtifactError(f"{jpath} not found: not a repacked-weights folder (run `thorgen repack-weights`)")
        try:
            header = json.loads(jpath.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ArtifactError(f"{jpath}: unreadable ({exc}); repack the weights again") from exc
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ArtifactError(f"{jpath}: not a {FORMAT} manifest")
        diffs = []
        if header.get("schema") != SCHEMA:
            diffs.append(f"manifest schema: artifact {header.get('schema')!r}, runtime reads {SCHEMA}")
        if spec_hash is not None and header.get("spec_hash") != spec_hash:
            diffs.append(
                f"spec hash: artifact {str(header.get('spec_hash'))[:12]} ({header.get('model')}), "
                f"model {spec_hash[:12]}"
            )
        if layout_version is not None and header.get("layout_version") != layout_version:
            diffs.append(f"layout version: artifact {header.get('layout_version')!r}, runtime {layout_version}")
        art_arch = header.get("arch")
        if arch is not None and art_arch is not None and art_arch != arch:
            diffs.append(f"arch: artifact {art_arch}, GPU {arch}")
        if diffs:
            raise ArtifactError(
                f"{folder} was repacked for something else: "
                + "; ".join(diffs)
                + ". Run `thorgen repack-weights` again for this model/runtime/GPU"
            )
        try:
            tensors = {
                n: TensorEntry(
                    n,
                    int(t["offset"]),
                    int(t["nbytes"]),
                    str(t["dtype"]),
                    tuple(int(d) for d in t["shape"]),
                    str(t["layout"]),
                    str(t["checksum"]),
                    None if t.get("multiplier") is None else float(t["multiplier"]),
                    tuple((k, v) for k, v in t.items() if k in _META_KEYS),
                )
                for n, t in header["tensors"].items()
            }
            total = int(header["total_bytes"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ArtifactError(f"{jpath}: malformed tensor table ({exc!r}); repack the weights again") from exc
        for t in tensors.values():
            want = int(np.prod(t.shape, dtype=np.int64)) * np_dtype(t.dtype).itemsize
            if t.offset % ALIGN or t.nbytes != want or t.offset + t.nbytes > total:
                raise ArtifactError(
                    f"{jpath}: tensor {t.name!r} entry is inconsistent (offset {t.offset}, "
                    f"{t.nbytes} bytes, {t.dtype}{list(t.shape)}); repack the weights again"
                )
        bpath = folder / WEIGHTS_BIN
        size = bpath.stat().st_size if bpath.is_file() else -1
        if size != total:
            cut = sorted((t for t in tensors.values() if t.offset + t.nbytes > max(size, 0)), key=lambda t: t.offset)
            what = f"; first tensor cut: {cut[0].name!r} at offset {cut[0].offset}" if cut else ""
            state = "missing" if size < 0 else f"{size} bytes, the manifest says {total}"
            raise ArtifactError(f"{bpath} is {state} (truncated or damaged){what}; repack the weights again")
        return cls(folder, header, tensors)

    # ---- host access --------------------------------------------------------------------------------------------
    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise ArtifactError(f"{self.folder}: no tensor {name!r} in the repacked weights") from None

    def array(self, name: str) -> np.ndarray:
        """Read-only memory-mapped view of one tensor, shaped and typed as in the manifest."""
        t = self.entry(name)
        if self._mm is None:
            self._mm = np.memmap(self.bin_path, dtype=np.uint8, mode="r")
        return self._mm[t.offset : t.offset + t.nbytes].view(np_dtype(t.dtype)).reshape(t.shape)

    def verify(
        self,
        names: Iterable[str] | None = None,
        workers: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        """Re-hash tensors from the file (all by default); ArtifactError naming every tensor whose checksum differs."""
        todo = [self.entry(n) for n in (names if names is not None else self.tensors)]
        path = self.bin_path

        def digest(t: TensorEntry) -> tuple[str, str]:
            h = new_hasher()
            with open(path, "rb", buffering=0) as f:
                f.seek(t.offset)
                left = t.nbytes
                while left:
                    block = f.read(min(left, 16 << 20))
                    if not block:
                        break
                    h.update(block)
                    left -= len(block)
            if progress is not None:
                progress(t.nbytes)
            return t.name, h.hexdigest()

        with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
            got = dict(pool.map(digest, todo))
        bad = [t.name for t in todo if got[t.name] != t.checksum]
        if bad:
            raise ArtifactError(
                f"{path}: checksum mismatch in {len(bad)} tensor(s): {', '.join(bad[:8])}"
                + (" ..." if len(bad) > 8 else "")
                + "; the file is damaged, repack the weights"
            )

    def close(self) -> None:
        self._mm = None


# ---- writing (used by runtime/convert/repack.py) ---------------------------------------------------------------------


@dataclass(frozen=True)
class OutTensor:
    """A tensor planned for weights.bin; `meta` lands in its manifest entry (logical shape, fused parts, ...)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str = "raw"
    meta: tuple[tuple[str, Any], ...] = ()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np_dtype(self.dtype).itemsize


def release_pages(*arrays: np.ndarray, whole_mapping: bool = False) -> None:
    """Drop memory-mapped source pages from this process's resident set (they stay in the page cache).

    Reading a 16 GB checkpoint through np.memmap would otherwise leave every touched page mapped and counted in
    RSS until the map is closed; MADV_DONTNEED on the consumed range keeps RSS flat (`whole_mapping`: the whole
    file mapping the array lies in). Any array not backed by an mmap: no-op."""
    for a in arrays:
        obj = a
        while isinstance(obj, np.ndarray):
            obj = obj.base
        if not isinstance(obj, mmap.mmap) or a.nbytes == 0:
            continue
        base = _MM_BASE.get(id(obj))
        if base is None:
            base = _MM_BASE[id(obj)] = np.frombuffer(obj, np.uint8).ctypes.data
        page = mmap.PAGESIZE
        start = 0 if whole_mapping else (a.ctypes.data - base) // page * page
        end = len(obj) if whole_mapping else min(a.ctypes.data - base + a.nbytes, len(obj))
        try:
            obj.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError, AttributeError):
            pass  # an optimisation only


_MM_BASE: dict[int, int] = {}
_CHUNK = 64 << 20


def chunks(name: str, arr: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A C-contiguous array as flat uint8 pieces of at most 64 MiB (views, no copies)."""
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    for i in range(0, flat.size, _CHUNK):
        yield name, flat[i : i + _CHUNK]
    if flat.size == 0:
        yield name, flat


class ArtifactWriter(threading.Thread):
    """Writes planned tensors into `folder/weights.bin` with positional writes and per-tensor hashing, on its own
    thread (pwrite and blake2b release the GIL, so this overlaps the producer's NumPy work). Pieces of one tensor
    must arrive in order; different tensors may interleave. `finish()` checks completeness and writes the JSON."""

    def __init__(self, folder: Path, tensors: list[OutTensor]) -> None:
        super().__init__(daemon=True)
        self.folder = folder
        self.entries: dict[str, tuple[OutTensor, int]] = {}
        pos = 0
        for t in tensors:
            if t.name in self.entries:
                raise ArtifactError(f"tensor {t.name} planned twice")
            self.entries[t.name] = (t, pos)
            pos = (pos + t.nbytes + ALIGN - 1) // ALIGN * ALIGN
        self.total = pos
        self.fd = os.open(folder / WEIGHTS_BIN, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self.fd, self.total)
        self.q: queue.Queue = queue.Queue(maxsize=8)
        self.done = {n: 0 for n in self.entries}
        self.hashers = {n: new_hasher() for n in self.entries}
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain so the producer never blocks
            name, chunk = item
            try:
                t, offset = self.entries[name]
                buf = memoryview(np.ascontiguousarray(chunk)).cast("B")
                if self.done[name] + buf.nbytes > t.nbytes:
                    raise ArtifactError(f"{name}: {self.done[name] + buf.nbytes} bytes written, planned {t.nbytes}")
                pos, view = offset + self.done[name], buf
                while view.nbytes:
                    n = os.pwrite(self.fd, view, pos)
                    view, pos = view[n:], pos + n
                self.hashers[name].update(buf)
                self.done[name] += buf.nbytes
                release_pages(chunk)
            except BaseException as exc:  # handed to the producer on its next put() / finish()
                self.error = exc

    def put(self, name: str, chunk: np.ndarray) -> None:
        if self.error is not None:
            raise self.error
        if name not in self.entries:
            raise ArtifactError(f"data for unplanned tensor {name}")
        self.q.put((name, chunk))

    def close(self) -> None:
        if self.is_alive():
            self.q.put(None)
            self.join()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def finish(self, header: dict, scales: dict[str, float]) -> dict:
        """Flush, check every tensor is complete, write weights.json; returns the manifest written."""
        self.q.put(None)
        self.join()
        if self.error is not None:
            raise self.error
        short = [n for n, (t, _) in self.entries.items() if self.done[n] != t.nbytes]
        if short:
            raise ArtifactError(f"tensors not fully written: {', '.join(short[:5])}")
        os.fsync(self.fd)
        self.close()
        tensors = {}
        for n, (t, off) in self.entries.items():
            e = TensorEntry(
                n, off, t.nbytes, t.dtype, t.shape, t.layout, self.hashers[n].hexdigest(), scales.get(n)
            ).to_json()
            e.update(dict(t.meta))
            tensors[n] = e
        manifest = {
            "format": FORMAT,
            "schema": SCHEMA,
            "checksum": CHECKSUM,
            **header,
            "total_bytes": self.total,
            "tensors": tensors,
        }
        (self.folder / WEIGHTS_JSON).write_text(json.dumps(manifest, indent=1) + "\n")
        return manifest


def swap_into_place(tmp: Path, out: Path) -> None:
    """Rename tmp onto out; an existing artifact at out is moved aside first and deleted only after the swap."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if not (out / WEIGHTS_JSON).is_file() and any(out.iterdir()):
        raise ArtifactError(f"{out} exists and is not a repacked-weights folder; choose another --out")
    old = Path(tempfile.mkdtemp(prefix=out.name + ".old-", dir=out.parent))
    os.rmdir(old)
    os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
