"""Runtime stage (reference backend): lazy float32 views of checkpoint weights with a bounded cache.

The reference engine takes any object with `.spec`, `.weight_f32(name)`, `.linear_f32(prefix)` and
`.draft_weight_f32(name)` (a `thorgen.model_spec.checkpoint.Checkpoint`, or an in-memory fake in tests).
Non-expert weights are cached once dequantized. Expert weights go through an LRU with a byte budget: for the
tiny preset every expert fits, for the full-size model (128 experts x 30 layers, ~100 GB as float32) only the
recently used experts are held, so the reference stays runnable (slowly) on a large-memory host.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

import numpy as np

from ...model_spec.tensors import TARGET_PREFIX


class WeightSource(Protocol):
    spec: Any

    def weight_f32(self, name: str) -> np.ndarray: ...

    def linear_f32(self, prefix: str) -> np.ndarray: ...

    def draft_weight_f32(self, name: str) -> np.ndarray: ...


DEFAULT_EXPERT_BUDGET = 2 << 30  # bytes of dequantized expert weights kept between uses


class TargetWeights:
    """Target tensors by short name (relative to `model.language_model.`), dequantized on first use."""

    def __init__(self, source: WeightSource, expert_budget_bytes: int = DEFAULT_EXPERT_BUDGET) -> None:
        self.source = source
        self._cache: dict[str, np.ndarray] = {}
        self._experts: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()
        self._expert_bytes = 0
        self.expert_budget_bytes = expert_budget_bytes

    def plain(self, short: str) -> np.ndarray:
        """A BF16/F32 tensor (norms, embedding, router, layer_scalar) as float32."""
        w = self._cache.get(short)
        if w is None:
            w = np.ascontiguousarray(self.source.weight_f32(TARGET_PREFIX + short), dtype=np.float32)
            self._cache[short] = w
        return w

    def linear(self, short_prefix: str) -> np.ndarray:
        """A Linear weight [out, in] as float32 (NVFP4 dequantized, or bf16 widened: `linear_f32` of the source)."""
        key = "linear:" + short_prefix
        w = self._cache.get(key)
        if w is None:
            w = self.load_linear(TARGET_PREFIX + short_prefix)
            self._cache[key] = w
        return w

    def load_linear(self, prefix: str) -> np.ndarray:
        """One Linear by full prefix as float32 (a subclass may dequantize differently)."""
        return np.ascontiguousarray(self.source.linear_f32(prefix), dtype=np.float32)

    def expert(self, layer: int, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [Ie, H], up [Ie, H], down [H, Ie]) of one expert, through the byte-budget LRU."""
        key = (layer, e)
        hit = self._experts.get(key)
        if hit is not None:
            self._experts.move_to_end(key)
            return hit
        p = f"{TARGET_PREFIX}layers.{layer}.experts.{e}."
        ws = tuple(self.load_linear(p + n) for n in ("gate_proj", "up_proj", "down_proj"))
        self._experts[key] = ws  # type: ignore[assignment]
        self._expert_bytes += sum(w.nbytes for w in ws)
        while self._expert_bytes > self.expert_budget_bytes and len(self._experts) > 1:
            _, old = self._experts.popitem(last=False)
            self._expert_bytes -= sum(w.nbytes for w in old)
        return ws  # type: ignore[return-value]


class DrafterWeights:
    """Drafter tensors (bf16, no prefix) as float32, cached."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source
        self._cache: dict[str, np.ndarray] = {}

    def get(self, name: str) -> np.ndarray:
        w = self._cache.get(name)
        if w is None:
            w = np.ascontiguousarray(self.source.draft_weight_f32(name), dtype=np.float32)
            self._cache[name] = w
        return w
