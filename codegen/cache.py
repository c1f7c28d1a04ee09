"""Codegen stage: the content-addressed cubin cache (outside the repo), safe under concurrent builders."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path

from ..model_spec.paths import cache_dir

SCHEMA_VERSION = 1


def headers_digest(include_dir: Path) -> str:
    """sha256 over every file under templates/include (relative path + bytes), so any header edit invalidates."""
    h = hashlib.sha256()
    for path in sorted(p for p in include_dir.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(include_dir)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _headers_digest_cached(include_dir: str, stamp: tuple) -> str:
    return headers_digest(Path(include_dir))


def headers_digest_fast(include_dir: Path) -> str:
    """headers_digest memoised on (path, mtimes, sizes): one digest per build, not one per kernel."""
    stamp = tuple(
        sorted((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in include_dir.rglob("*") if p.is_file())
    )
    return _headers_digest_cached(str(include_dir), stamp)


def cache_key(source: str, headers: str, nvcc_version: str, flags: list[str], arch: str) -> str:
    # Flags carry the include path, which differs between checkouts: key on the flags without -I (the header
    # *contents* are keyed through `headers`).
    portable_flags = [f for f in flags if not f.startswith("-I")]
    body = json.dumps(
        {
            "schema": SCHEMA_VERSION,
            "source": source,
            "headers": headers,
            "nvcc": nvcc_version,
            "flags": portable_flags,
            "arch": arch,
        },
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()


class CubinCache:
    def __init__(self, root: Path | None = None):
        self.root = root or cache_dir()

    def _path(self, key: str) -> Path:
        return self.root / f"v{SCHEMA_VERSION}" / key[:2] / key

    def get(self, key: str) -> tuple[bytes, dict] | None:
        """(cubin bytes, metadata) or None. Metadata is written last, so its presence means a complete entry."""
        base = self._path(key)
        try:
            meta = json.loads((base.with_suffix(".json")).read_text())
            return (base.with_suffix(".cubin")).read_bytes(), meta
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def put(self, key: str, cubin: bytes, meta: dict) -> None:
        """Write-then-rename both files: racing builders each write a private temp file and the last rename wins
        with identical content, so readers never see a partial entry."""
        base = self._path(key)
        base.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(base.with_suffix(".cubin"), cubin)
        _atomic_write(base.with_suffix(".json"), json.dumps(meta, sort_keys=True).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
