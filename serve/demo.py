"""Serve stage: the built-in demo model: a tiny synthetic checkpoint with random weights (never mistaken for Gemma)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_ID = "thorgen-tiny-demo-random-weights-not-gemma"
# the demo's context: its checkpoint's max_position_embeddings, room for the README's examples (2,048 answer
# tokens, thinking included) beside a realistic tool set (four pydantic tools are ~1,500 prompt tokens)
DEMO_CTX = 8192


def demo_dir() -> Path:
    base = os.environ.get("THORGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "thorgen"
    )
    return Path(base) / "demo-tiny"


def _is_current(folder: Path) -> bool:
    """Whether a cached demo checkpoint is the one this version synthesizes (an older release's has another
    config.json, e.g. a vision position table too short for the larger image budgets)."""
    from ..model_spec.synth import synthetic_config

    try:
        return bool(json.loads((folder / "config.json").read_text()) == synthetic_config("tiny"))
    except (OSError, ValueError):
        return False


def ensure_demo_checkpoint(seed: int = 0) -> Path:
    """Synthesize the tiny checkpoint once; later calls reuse it (an outdated one is synthesized again). Written
    to a temp folder and renamed into place, so two servers starting at once never see a half-written
    checkpoint."""
    target = demo_dir()
    if _is_current(target):
        return target
    from ..model_spec.synth import write_synthetic_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-tiny-", dir=target.parent))
    try:
        write_synthetic_checkpoint("tiny", tmp, seed=seed)
        if target.exists() and not _is_current(target):  # an outdated one moves aside, then goes
            old = Path(tempfile.mkdtemp(prefix=".demo-tiny-old-", dir=target.parent))
            try:
                target.rename(old / "checkpoint")
            except OSError:  # someone else replaced it first
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # someone else finished first
            if not _is_current(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
