"""Model spec stage: synthetic (random-weight) checkpoints of the presets, in the real on-disk layouts."""

from __future__ import annotations

from .writer import GENERATION_CONFIG, synthetic_config, write_synthetic_checkpoint

__all__ = ["GENERATION_CONFIG", "synthetic_config", "write_synthetic_checkpoint"]
