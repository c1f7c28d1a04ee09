"""Runtime stage (reference backend): the Gemma-4 vision tower in NumPy, one image's patches -> its soft-token rows.

Runs on the image's real patches only (no padding to the budget: padded patches are masked out of attention and
dropped after pooling, so they change nothing). fp32 storage with float64-accumulated reductions (ops.py); the
tail (3x3 average pool, x sqrt(hidden), standardize, weightless RMSNorm) runs in float64: the scaled pool reaches
~8e4 on the real weights (HF PR #46277), so it must not pass through fp16. Projection to the text hidden size.
"""

from __future__ import annotations

import numpy as np

from ...model_spec.tensors import VISION_PREFIX, VISION_PROJECTION
from ...model_spec.types import Gemma4VisionSpec
from ..backend import ImageInput
from .ops import F32, F64, attend, gelu_tanh, mm, rms_norm
from .weights import WeightSource


def rope_2d(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """x [L, heads, D] rotated by the patch grid: channels 0..D/2-1 by x, D/2..D-1 by y, each half NeoX-style
    (pairs (i, i + D/4)) with inverse frequencies theta^(-2j/(D/2)), j < D/4."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (np.arange(0, half, 2, dtype=F64) / half)
    out = np.empty_like(x)
    for axis in range(2):
        part = x[..., axis * half : (axis + 1) * half]
        ang = positions[:, axis].astype(F64)[:, None] * inv_freq[None, :]
        ang = np.concatenate([ang, ang], axis=-1)
        cos, sin = np.cos(ang).astype(F32)[:, None, :], np.sin(ang).astype(F32)[:, None, :]
        q = half // 2
        rot = np.concatenate([-part[..., q:], part[..., :q]], axis=-1)
        out[..., axis * half : (axis + 1) * half] = part * cos + rot * sin
    return out.astype(F32)


def pool_order(positions: np.ndarray, pool: int) -> np.ndarray:
    """Each patch's pooled row: row-major over the pooled grid (its width from the largest x)."""
    width = (int(positions[:, 0].max()) + 1) // pool
    return (positions[:, 1] // pool) * width + positions[:, 0] // pool


class VisionModel:
    """Reference vision tower + projection over a checkpoint (or any WeightSource with a vision spec)."""

    def __init__(self, source: WeightSource) -> None:
        spec = source.spec
        if spec.vision is None:
            raise ValueError(f"{spec.name}: the model has no vision tower (no vision_config)")
        self.spec: Gemma4VisionSpec = spec.vision
        self.source = source
        self._cache: dict[str, np.ndarray] = {}

    def w(self, short: str) -> np.ndarray:
        """A tower tensor (name relative to model.vision_tower.) as float32, cached."""
        got = self._cache.get(short)
        if got is None:
            name = short if short.startswith("model.") else VISION_PREFIX + short
            got = np.ascontiguousarray(self.source.weight_f32(name), dtype=F32)
            self._cache[short] = got
        return got

    def embed_patches(self, pixels: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(2 (p - 0.5)) @ input_proj.T + table[0][x] + table[1][y] -> [L, Hv]."""
        x = mm((2 * (pixels.astype(F32) - F32(0.5))).astype(F32), self.w("patch_embedder.input_proj.weight"))
        table = self.w("patch_embedder.position_embedding_table")
        return (x + (table[0][positions[:, 0]] + table[1][positions[:, 1]])).astype(F32)

    def layer(self, layer: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        s, p = self.spec, f"encoder.layers.{layer}."
        eps, n, d = s.rms_norm_eps, s.num_attention_heads, s.head_dim
        h = rms_norm(x, self.w(p + "input_layernorm.weight"), eps)
        q = mm(h, self.w(p + "self_attn.q_proj.linear.weight")).reshape(-1, n, d)
        k = mm(h, self.w(p + "self_attn.k_proj.linear.weight")).reshape(-1, n, d)
        v = mm(h, self.w(p + "self_attn.v_proj.linear.weight")).reshape(-1, n, d)
        q = rope_2d(rms_norm(q, self.w(p + "self_attn.q_norm.weight"), eps), positions, s.rope_theta)
        k = rope_2d(rms_norm(k, self.w(p + "self_attn.k_norm.weight"), eps), positions, s.rope_theta)
        v = rms_norm(v, None, eps)
        every = np.ones((x.shape[0], x.shape[0]), dtype=bool)  # one image: every patch sees every patch
        o = mm(attend(q, k, v, every, scale=1.0), self.w(p + "self_attn.o_proj.linear.weight"))
        x = (x + rms_norm(o, self.w(p + "post_attention_layernorm.weight"), eps)).astype(F32)
        h2 = rms_norm(x, self.w(p + "pre_feedforward_layernorm.weight"), eps)
        gate = gelu_tanh(mm(h2, self.w(p + "mlp.gate_proj.linear.weight")))
        m = gate * mm(h2, self.w(p + "mlp.up_proj.linear.weight"))
        m = mm(m.astype(F32), self.w(p + "mlp.down_proj.linear.weight"))
        return (x + rms_norm(m, self.w(p + "post_feedforward_layernorm.weight"), eps)).astype(F32)

    def pool_tail(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Average-pool pool x pool patches, x sqrt(Hv), standardize, weightless RMSNorm: float64 -> [N, Hv] f32."""
        s = self.spec
        rows = pool_order(positions, s.pooling_kernel_size)
        n = int(rows.max()) + 1
        pooled = np.zeros((n, x.shape[1]), dtype=F64)
        np.add.at(pooled, rows, x.astype(F64))
        pooled = pooled / (s.pooling_kernel_size**2) * np.sqrt(F64(s.hidden_size))
        pooled = (pooled - self.w("std_bias").astype(F64)) * self.w("std_scale").astype(F64)
        return (pooled / np.sqrt(np.mean(pooled * pooled, axis=-1, keepdims=True) + s.rms_norm_eps)).astype(F32)

    def features(self, image: ImageInput) -> np.ndarray:
        """The tower's pooled, standardized, normed rows [N, Hv] (before the projection)."""
        positions = np.asarray(image.positions, dtype=np.int64)
        x = self.embed_patches(image.pixel_values(), positions)
        for layer in range(self.spec.num_hidden_layers):
            x = self.layer(layer, x, positions)
        out = self.pool_tail(x, positions)
        if out.shape[0] != image.soft_tokens:
            raise ValueError(f"image pools to {out.shape[0]} rows, its record says {image.soft_tokens}")
        return out

    def encode(self, image: ImageInput) -> np.ndarray:
        """One image -> its soft-token embeddings in the text model's hidden size [N, H] float32."""
        return mm(self.features(image), self.w(VISION_PROJECTION + ".weight"))
