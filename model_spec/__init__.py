"""Model spec stage: the Python DSL describing Gemma-4 and its DFlash drafter (specs, tensors, NVFP4, checkpoints)."""

from .config import spec_from_configs
from .presets import PRESETS, get_preset
from .types import FULL, SLIDING, DFlashSpec, Gemma4TextSpec, ModelSpec, RopeSpec, SpecError

__all__ = [
    "FULL",
    "SLIDING",
    "PRESETS",
    "DFlashSpec",
    "Gemma4TextSpec",
    "ModelSpec",
    "RopeSpec",
    "SpecError",
    "get_preset",
    "spec_from_configs",
]
