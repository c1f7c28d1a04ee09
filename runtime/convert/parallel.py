"""Runtime stage: offline weight repack in parallel — the plan's jobs in worker processes, same bytes as serial.

Every job of repack.plan_artifact produces whole tensors whose offsets in weights.bin are fixed by the plan, so
workers (forked after planning; they inherit the plan) pwrite their pieces in place and return per-tensor blake2b
digests; the parent's ArtifactWriter then only checks completeness and writes the manifest, exactly as after a
one-process run.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import os

import numpy as np

from .plan import Planner, Progress
from .artifact import ALIGN, WEIGHTS_BIN, ArtifactError, ArtifactWriter, new_hasher, release_pages


def default_jobs(total_bytes: int) -> int:
    """Worker processes when --jobs is not given: the usable cores (at most 16), 1 below 256 MB of output."""
    if total_bytes < (256 << 20):
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16))


# The plan handed to forked workers (set just before the fork; the children inherit it and its memory maps), and
# per worker the open weights.bin descriptor.
_PLAN: Planner | None = None
_OFFSETS: dict[str, int] = {}
_FD: dict[str, int] = {}


def _worker_job(task: tuple[str, int]) -> tuple[dict[str, tuple[int, str]], dict[str, float], dict[str, dict]]:
    """Run plan job `index` in a worker: pwrite its pieces at their offsets, hash each tensor it produces.
    Returns ({tensor: (bytes, blake2b hex)}, global multipliers it recorded, quantization errors it measured)."""
    bin_path, index = task
    pl, offsets = _PLAN, _OFFSETS
    if pl is None:
        raise ArtifactError("repack worker started without a plan")
    fd = _FD.get(bin_path)
    if fd is None:
        fd = _FD[bin_path] = os.open(bin_path, os.O_WRONLY)
    pl.scales.clear()
    pl.quant_errors.clear()
    done: dict[str, int] = {}
    hashers: dict[str, object] = {}
    for name, piece in pl.jobs[index][2]():
        buf = memoryview(np.ascontiguousarray(piece)).cast("B")
        pos = offsets[name] + done.get(name, 0)
        view = buf
        while view.nbytes:
            n = os.pwrite(fd, view, pos)
            view, pos = view[n:], pos + n
        hashers.setdefault(name, new_hasher()).update(buf)  # type: ignore[attr-defined]
        done[name] = done.get(name, 0) + buf.nbytes
        release_pages(piece)
    return (
        {n: (done[n], h.hexdigest()) for n, h in hashers.items()},  # type: ignore[attr-defined]
        dict(pl.scales),
        dict(pl.quant_errors),
    )


class _Digest:
    """A finished hash handed to ArtifactWriter.finish in place of its own hasher (the worker hashed the bytes)."""

    def __init__(self, hexdigest: str) -> None:
        self._hex = hexdigest

    def hexdigest(self) -> str:
        return self._hex


def plan_offsets(pl: Planner) -> dict[str, int]:
    """Each tensor's offset in weights.bin, as ArtifactWriter assigns them (ALIGN-aligned, in plan order)."""
    offsets, pos = {}, 0
    for t in pl.tensors:
        offsets[t.name] = pos
        pos = (pos + t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return offsets


def start_pool(pl: Planner, jobs: int) -> "multiprocessing.pool.Pool":
    """Fork the workers; call before any thread is started (the ArtifactWriter's), so the children inherit a
    single-threaded process. fork, not spawn: a spawned worker would re-open the checkpoint, whose validation
    transiently maps ~1 GB per process (x16 workers); forked ones share the parent's already-released mappings."""
    global _PLAN, _OFFSETS
    _PLAN, _OFFSETS = pl, plan_offsets(pl)
    try:
        return multiprocessing.get_context("fork").Pool(min(jobs, len(pl.jobs)))
    finally:
        _PLAN, _OFFSETS = None, {}  # the parent keeps no extra reference


def run_parallel(
    pool: "multiprocessing.pool.Pool", pl: Planner, writer: ArtifactWriter, progress: Progress | None
) -> None:
    """The plan's jobs in the forked workers (largest first) writing into weights.bin at the writer's offsets.
    The writer's thread stays idle; it only does the bookkeeping: completeness check, manifest, fsync."""
    if plan_offsets(pl) != {n: off for n, (_, off) in writer.entries.items()}:
        raise ArtifactError("repack: worker offsets disagree with ArtifactWriter's (weights.py layout changed?)")
    bin_path = str(writer.folder / WEIGHTS_BIN)
    order = sorted(range(len(pl.jobs)), key=lambda i: -pl.jobs[i][1])
    work, done = sum(b for _, b, _ in pl.jobs), 0
    results = pool.imap_unordered(_worker_job, [(bin_path, i) for i in order], chunksize=1)
    for i, (tensors, scales, errors) in zip(order, results):
        for name, (nbytes, hexdigest) in tensors.items():
            if isinstance(writer.hashers.get(name), _Digest):
                raise ArtifactError(f"tensor {name} produced by two jobs")
            writer.done[name] = nbytes
            writer.hashers[name] = _Digest(hexdigest)
        pl.scales.update(scales)
        pl.quant_errors.update(errors)
        done += pl.jobs[i][1]
        if progress is not None:
            progress(done, work, pl.jobs[i][0])
