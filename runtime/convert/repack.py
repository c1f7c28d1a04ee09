"""`repack()`: a checkpoint (memory-mapped) -> the kernels' layouts in weights.bin/.json, streamed and atomic.

The plan (convert/plan.py) lists the tensors and jobs; here they run, in this process or in parallel workers
(convert/parallel.py, byte-identical output), into `<out>.tmp-XXXX`, which is then renamed onto `<out>`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path


from ...model_spec.checkpoint import Checkpoint, CheckpointError
from ...model_spec.types import ALL_NVFP4, ModelSpec
from . import parallel as par
from .artifact import ArtifactError, ArtifactWriter, default_artifact_dirs, release_pages, swap_into_place
from .layouts import layout_version
from .plan import DEFAULT_ARCH, Progress, plan_artifact


def repack(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike | None = None,
    lm_head: str = "nvfp4",
    arch: str | None = None,
    draft_dir: str | os.PathLike | None = None,
    progress: Progress | None = None,
    chunk_cols: int = 256,
    jobs: int | None = None,
    quantize: str = "none",
) -> Path:
    """Repack a checkpoint into `out_dir` (default: see weights.default_artifact_dirs) and return that folder.

    jobs: worker processes (None: default_jobs(output size)); the artifact's bytes are the same for any value.
    quantize: "nvfp4" quantizes every bf16 linear to NVFP4 (the artifact's spec is then all-NVFP4, and
    QUANT_REPORT in the artifact folder holds each linear's error); "none" serves the checkpoint as shipped."""
    arch = arch or DEFAULT_ARCH
    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise ArtifactError(f"--jobs must be a positive integer, got {jobs!r}")
    ckpt = Checkpoint.open(model_dir, draft_dir)
    _release_mappings(ckpt)
    pl = plan_artifact(ckpt, lm_head, arch, chunk_cols, quantize)
    spec = artifact_spec(ckpt.spec, quantize)
    out = Path(out_dir) if out_dir is not None else _default_out(model_dir, spec.spec_hash)
    out.parent.mkdir(parents=True, exist_ok=True)
    need = sum(t.nbytes for t in pl.tensors)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise ArtifactError(
            f"not enough disk space in {out.parent}: needed {need / 2**30:.2f} GiB, free {free / 2**30:.2f} GiB"
        )
    jobs = jobs if jobs is not None else par.default_jobs(need)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    writer = pool = None
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the artifact is an ordinary shared folder
        pool = par.start_pool(pl, jobs) if jobs > 1 else None  # before the writer's thread exists
        writer = ArtifactWriter(tmp, pl.tensors)
        if pool is not None:
            par.run_parallel(pool, pl, writer, progress)
        else:
            work, done = sum(b for _, b, _ in pl.jobs), 0
            for label, nbytes, job in pl.jobs:
                for name, piece in job():
                    writer.put(name, piece)
                done += nbytes
                if progress is not None:
                    progress(done, work, label)
        writer.finish(
            {
                "layout_version": layout_version(),
                "spec_hash": spec.spec_hash,
                "model": spec.name,
                "arch": arch,
                "fp4_order": pl.order,
                "lm_head": lm_head,
                "source": str(Path(model_dir).resolve()),
                "source_format": ckpt.source_format,
                "linear_formats": dataclasses.asdict(spec.linear_formats),
            },
            pl.scales,
        )
        if quantize != "none":
            (tmp / QUANT_REPORT).write_text(json.dumps(quant_report(pl.quant_errors), indent=1) + "\n")
        swap_into_place(tmp, out)
    except BaseException:
        if writer is not None:
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return out


QUANT_REPORT = "quantization_report.json"


def preflight(model_dir: str | os.PathLike, draft_dir: str | os.PathLike | None = None) -> None:
    """Open and validate a checkpoint (configs, format, every tensor) without writing; ArtifactError names what is
    wrong, so a command that does more before repacking (prepare builds kernels first) fails fast."""
    try:
        Checkpoint.open(model_dir, draft_dir)
    except CheckpointError as exc:
        raise ArtifactError(str(exc)) from exc


def artifact_spec(spec: ModelSpec, quantize: str) -> ModelSpec:
    """The spec the artifact serves: the checkpoint's, or all-NVFP4 once --quantize nvfp4 rewrote its bf16 linears."""
    return dataclasses.replace(spec, linear_formats=ALL_NVFP4) if quantize == "nvfp4" else spec


def quant_report(errors: dict[str, dict]) -> dict:
    """The saved report: every quantized linear's {max_rel, rms_rel}, and the worst of each over all of them."""
    linears = dict(sorted(errors.items()))
    worst = {k: max((e[k] for e in linears.values()), default=0.0) for k in ("max_rel", "rms_rel")}
    return {
        "quantizer": "thorgen compressed-tensors NVFP4 (global 2688/amax, e4m3 block scales per 16)",
        "worst": worst,
        "linears": linears,
    }


def _release_mappings(ckpt: Checkpoint) -> None:
    """Opening validates ~12k global scales; each read maps a fault-around window of pages (~0.7 GB of RSS for the
    full model). Drop every mapping's resident pages once (they stay in the page cache)."""
    seen: set[object] = set()
    for info in ckpt.target_inventory:
        if ckpt.has_tensor(info.name) and ckpt.tensor_file(info.name) not in seen:
            seen.add(ckpt.tensor_file(info.name))
            release_pages(ckpt.tensor(info.name), whole_mapping=True)
    if ckpt.drafter_inventory:
        release_pages(ckpt.draft_tensor(ckpt.drafter_inventory[0].name), whole_mapping=True)


def _default_out(model_dir: str | os.PathLike, spec_hash: str) -> Path:
    first, fallback = default_artifact_dirs(model_dir, spec_hash)
    return first if os.access(Path(model_dir), os.W_OK) else fallback
