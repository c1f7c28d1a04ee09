"""Serve stage: the built-in demo model: a tiny synthetic checkpoint with random weights (never mistaken for Gemma)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

DEMO_MODEL_ID = "thorgen-tiny-demo-random-weights-not-gemma"


def demo_dir() -> Path:
    base = os.environ.get("THORGEN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "thorgen"
    )
    return Path(base) / "demo-tiny"


def ensure_demo_checkpoint(seed: int = 0) -> Path:
    """Synthesize the tiny checkpoint once; later calls reuse it. Written to a temp folder and renamed into
    place, so two servers starting at once never see a half-written checkpoint."""
    target = demo_dir()
    if (target / "config.json").exists():
        return target
    from ..model_spec.synth import write_synthetic_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-tiny-", dir=target.parent))
    try:
        write_synthetic_checkpoint("tiny", tmp, seed=seed)
        try:
            tmp.rename(target)
        except OSError:  # someone else finished first
            if not (target / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
