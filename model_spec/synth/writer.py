"""Model spec stage (synthetic checkpoints): write a preset as a RedHatAI-layout target + z-lab DFlash drafter.

Output folder: config.json, generation_config.json, model.safetensors (or shards + model.safetensors.index.json),
tokenizer.json, tokenizer_config.json, chat_template.jinja, synth_info.json, and dflash/{config.json,
model.safetensors}. Written into a sibling temp folder and renamed into place, so a crash never leaves a
half-written checkpoint under the requested name. Tensors stream one at a time (peak memory ~ one tensor).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..config import drafter_config, target_config
from ..presets import get_preset
from ..safetensors_io import ShardedWriter, tensor_nbytes
from ..tensors import TensorInfo, drafter_tensors, target_tensors
from ..types import ModelSpec
from .tokenizer import build_tokenizer, tokenizer_config
from .weights import QUANTIZE_LIMIT, LinearParts, tensor_chunks

GENERATION_CONFIG = {"bos_token_id": 2, "do_sample": True, "eos_token_id": [1, 106, 50], "pad_token_id": 0,
                     "temperature": 1.0, "top_k": 64, "top_p": 0.95}
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
FULL_SHARD_BYTES = 4 << 30

ProgressFn = Callable[[str, int, int], None]  # (stage, bytes done, bytes total)


class StderrProgress:
    """Plain-text progress on stderr, at most one line per second (no tqdm dependency)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 1.0 and done < total:
            return
        self.last = now
        pct = 100.0 * done / max(total, 1)
        unit, div = ("GB", 1e9) if total >= 1e9 else ("MB", 1e6)
        sys.stderr.write(f"[synth] {stage}: {done / div:7.2f} / {total / div:.2f} {unit} ({pct:5.1f}%)  "
                         f"{now - self.t0:6.1f} s\n")
        sys.stderr.flush()


def _write_tensors(folder: Path, infos: list[TensorInfo], seed: int, hidden: int, method: str,
                   shard_bytes: int, stage: str, progress: ProgressFn | None) -> None:
    total = sum(t.nbytes for t in infos)
    done = 0
    linears = LinearParts(seed, method)
    with ShardedWriter(folder, infos, shard_bytes) as writer:
        for info in infos:
            for chunk in tensor_chunks(info, seed, hidden, linears):
                writer.append(info.name, chunk)
                done += chunk.nbytes
                if progress is not None:
                    progress(stage, done, total)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_synthetic_checkpoint(preset_name: str | ModelSpec, out_dir: str | os.PathLike, seed: int = 0,
                               progress: bool | ProgressFn = True, *, method: str = "auto",
                               shard_bytes: int | None = None, force: bool = False,
                               chat_template_path: str | os.PathLike | None = None) -> Path:
    """Write a random-weight checkpoint of a preset (or any ModelSpec) to out_dir; returns out_dir.

    method: "quantize" (float weights through quantize_nvfp4), "direct" (codes sampled directly) or "auto"
    (quantize below QUANTIZE_LIMIT NVFP4 elements, i.e. for tiny; direct for the full preset).
    shard_bytes: target shard size; default 4 GiB for big models, and half the model for small ones so the
    index path is exercised. A non-empty out_dir is refused unless force.
    """
    spec = get_preset(preset_name) if isinstance(preset_name, str) else preset_name
    out_dir = Path(out_dir)
    template_path = Path(chat_template_path) if chat_template_path is not None else CHAT_TEMPLATE
    if not template_path.is_file():
        raise FileNotFoundError(f"chat template {template_path} not found")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty (use force to replace it)")
    report: ProgressFn | None = StderrProgress() if progress is True else (progress or None)

    t_infos = target_tensors(spec.target)
    d_infos = drafter_tensors(spec.drafter) if spec.drafter is not None else []
    n_fp4 = sum(t.shape[0] * t.shape[1] * 2 for t in t_infos if t.role == "weight_packed")
    if method == "auto":
        method = "quantize" if n_fp4 < QUANTIZE_LIMIT else "direct"
    total = sum(t.nbytes for t in t_infos)
    if shard_bytes is None:
        shard_bytes = FULL_SHARD_BYTES if total > 2 * FULL_SHARD_BYTES else (total * 3) // 5

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out_dir.name}.tmp-", dir=out_dir.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; a checkpoint is meant to be shared
    try:
        template = template_path.read_text()
        _write_json(tmp / "config.json", target_config(spec.target))
        _write_json(tmp / "generation_config.json", GENERATION_CONFIG)
        tok = build_tokenizer(spec.target.vocab_size)
        (tmp / "tokenizer.json").write_text(tok.to_str(pretty=False))
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(template, spec.target.max_position_embeddings))
        (tmp / "chat_template.jinja").write_text(template)
        _write_json(tmp / "synth_info.json", {"preset": spec.name, "seed": seed, "nvfp4_method": method,
                                              "spec_hash": spec.spec_hash, "generator": "thorgen synth-checkpoint"})
        _write_tensors(tmp, t_infos, seed, spec.target.hidden_size, method, shard_bytes, "target", report)
        if spec.drafter is not None:
            (tmp / "dflash").mkdir()
            _write_json(tmp / "dflash" / "config.json", drafter_config(spec.drafter))
            d_total = sum(tensor_nbytes(t.dtype, t.shape) for t in d_infos)
            _write_tensors(tmp / "dflash", d_infos, seed, spec.drafter.hidden_size, method, d_total + 1,
                           "drafter", report)
        _replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Rename tmp to out_dir; an existing out_dir (empty, or replaced under force) moves aside first."""
    old = None
    if out_dir.exists():
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        else:
            old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()
