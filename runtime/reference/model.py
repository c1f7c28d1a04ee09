"""Runtime stage (reference backend): the Gemma-4 text decoder forward in NumPy (MODEL_FACTS §1), with KV cache.

One `forward` call serves prefill (any T), one-token decode and multi-token verify: it appends the K/V of
positions cache.length .. cache.length+T-1 and returns logits plus the residual-stream outputs of the
requested decoder layers (after layer_scalar), which are the DFlash taps.

Images: `images=[(row, emb [N, H])]` replaces the embeddings of rows row..row+N-1 of this call by the image's
soft-token rows (unscaled: the sqrt(H) normaliser belongs to the token table), and makes each such span one
bidirectional block on the sliding layers: (causal OR same image) AND window. Full layers stay causal. A span
must lie inside one call (its tokens attend to each other both ways).

Embedding normaliser: the table rows are multiplied by float32(sqrt(hidden_size)). HF's float32 forward does
the same (its buffer is cast to the weight dtype, float32 in tests); a bf16 HF/vLLM run rounds it to bf16
(53.0 for H=2816) instead. Pass `embed_scale=` to pick another value. For the tiny preset (H=256) both are 16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ...model_spec.types import Gemma4TextSpec
from .kv_cache import KVCache
from .ops import F32, F64, apply_rope, attend, gelu_tanh, mm, rms_norm, rope_cos_sin, softcap, window_visible
from .weights import DEFAULT_EXPERT_BUDGET, TargetWeights, WeightSource

ImageRows = Sequence[tuple[int, np.ndarray]]  # (first row in this call, the image's embeddings [N, H])


@dataclass
class ForwardOutput:
    logits: np.ndarray  # [T or 1, V] float32, softcapped
    taps: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [T, H] residual after layer_scalar


class TargetModel:
    """Reference Gemma-4 target. `source` is a Checkpoint (or any WeightSource) whose `.spec` is a ModelSpec."""

    def __init__(
        self, source: WeightSource, embed_scale: float | None = None, expert_budget_bytes: int = DEFAULT_EXPERT_BUDGET
    ) -> None:
        self.spec: Gemma4TextSpec = source.spec.target
        self.w = TargetWeights(source, expert_budget_bytes)
        self.embed_scale = F32(self.spec.embed_scale if embed_scale is None else embed_scale)
        s = self.spec
        self._inv_freq = [
            np.asarray(s.layer_rope(l).inv_freq(s.layer_head_dim(l)), dtype=F64) for l in range(s.num_hidden_layers)
        ]

    # ---- pieces ---------------------------------------------------------------------------------------------
    def new_cache(self) -> KVCache:
        s = self.spec
        return KVCache([(s.layer_kv_heads(l), s.layer_head_dim(l)) for l in range(s.num_hidden_layers)])

    def embedding_table(self) -> np.ndarray:
        """The raw (unscaled) embedding table [V, H]; also the tied lm_head."""
        return self.w.plain("embed_tokens.weight")

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.embedding_table()[ids] * self.embed_scale

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Softcapped logits of already-normed hidden states [T, H] -> [T, V]."""
        return softcap(mm(h, self.embedding_table()), self.spec.final_logit_softcapping)

    def _norm(self, layer: int, name: str, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.w.plain(f"layers.{layer}.{name}.weight"), self.spec.rms_norm_eps)

    def _attention(
        self, layer: int, x: np.ndarray, cache: KVCache, start: int, blocks: np.ndarray | None = None
    ) -> np.ndarray:
        s, t = self.spec, x.shape[0]
        d, nq, nkv = s.layer_head_dim(layer), s.num_attention_heads, s.layer_kv_heads(layer)
        p = f"layers.{layer}.self_attn."
        eps = s.rms_norm_eps
        pos = np.arange(start, start + t)
        cos, sin = rope_cos_sin(pos, self._inv_freq[layer])
        q = mm(x, self.w.linear(p + "q_proj")).reshape(t, nq, d)
        q = apply_rope(rms_norm(q, self.w.plain(p + "q_norm.weight"), eps), cos, sin)
        kp = mm(x, self.w.linear(p + "k_proj")).reshape(t, nkv, d)
        k = apply_rope(rms_norm(kp, self.w.plain(p + "k_norm.weight"), eps), cos, sin)
        # attention_k_eq_v (full layers): V is the same raw k projection, normed without weight, not rotated.
        vp = mm(x, self.w.linear(p + "v_proj")).reshape(t, nkv, d) if s.layer_has_v_proj(layer) else kp
        v = rms_norm(vp, None, eps)
        cache.write(layer, start, k, v)
        end = start + t
        window = s.layer_window(layer)
        if blocks is not None and window is not None:  # the image overlay: sliding layers only
            keys = np.concatenate([np.full(start, -1, dtype=np.int64), blocks])
            vis = window_visible(pos, np.arange(end), True, window, blocks, keys)
        else:
            vis = window_visible(pos, np.arange(end), causal=True, window=window)
        o = attend(q, cache.keys(layer, end), cache.values(layer, end), vis, scale=1.0)
        return mm(o, self.w.linear(p + "o_proj"))

    def route(self, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Router on the raw residual x [T, H] -> (weights [T, K] float32, expert ids [T, K])."""
        s = self.spec
        p = f"layers.{layer}.router."
        hn = rms_norm(x, None, s.rms_norm_eps) * self.w.plain(p + "scale") * F32(s.hidden_size**-0.5)
        logits = mm(hn, self.w.plain(p + "proj.weight")).astype(F64)
        logits -= logits.max(axis=-1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=-1, keepdims=True)  # softmax over all experts first
        # top-k by probability; a stable sort breaks exact ties toward the lower expert id.
        idx = np.argsort(-probs, axis=-1, kind="stable")[:, : s.top_k_experts]
        w = np.take_along_axis(probs, idx, axis=-1)
        w /= w.sum(axis=-1, keepdims=True)
        w = w * self.w.plain(p + "per_expert_scale")[idx].astype(F64)
        return w.astype(F32), idx

    def _experts(self, layer: int, x2: np.ndarray, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
        t, k = idx.shape
        contrib = np.zeros((t, k, x2.shape[1]), dtype=F32)
        for e in np.unique(idx):
            rows, ranks = np.nonzero(idx == e)
            gate, up, down = self.w.expert(layer, int(e))
            xe = x2[rows]
            he = gelu_tanh(mm(xe, gate)) * mm(xe, up)
            contrib[rows, ranks] = mm(he, down) * weights[rows, ranks][:, None]
        # Summed per token in top-k rank order, in float64: independent of the other tokens in the batch.
        return contrib.astype(F64).sum(axis=1).astype(F32)

    def _feed_forward(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}.mlp."
        h = self._norm(layer, "pre_feedforward_layernorm", x)
        h1 = mm(
            gelu_tanh(mm(h, self.w.linear(p + "gate_proj"))) * mm(h, self.w.linear(p + "up_proj")),
            self.w.linear(p + "down_proj"),
        )
        h1 = self._norm(layer, "post_feedforward_layernorm_1", h1)
        weights, idx = self.route(layer, x)  # the router reads the un-normed residual
        h2 = self._experts(layer, self._norm(layer, "pre_feedforward_layernorm_2", x), weights, idx)
        h2 = self._norm(layer, "post_feedforward_layernorm_2", h2)
        return self._norm(layer, "post_feedforward_layernorm", h1 + h2)

    def layer(
        self, layer: int, x: np.ndarray, cache: KVCache, start: int, blocks: np.ndarray | None = None
    ) -> np.ndarray:
        h = self._attention(layer, self._norm(layer, "input_layernorm", x), cache, start, blocks)
        x = x + self._norm(layer, "post_attention_layernorm", h)
        x = x + self._feed_forward(layer, x)
        return (x * self.w.plain(f"layers.{layer}.layer_scalar")).astype(F32)

    # ---- whole model ----------------------------------------------------------------------------------------
    def check_ids(self, ids: list[int] | np.ndarray) -> np.ndarray:
        """The token ids as a flat int64 array; ValueError when empty or outside the vocabulary."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
            raise ValueError(f"token id out of range 0..{self.spec.vocab_size - 1}")
        return ids

    def with_images(self, ids: np.ndarray, images: ImageRows) -> tuple[np.ndarray, np.ndarray | None]:
        """(embeddings [T, H], block id per row or None): image rows replaced, each image its own block."""
        x = self.embed(ids)
        if not images:
            return x, None
        blocks = np.full(ids.size, -1, dtype=np.int64)
        for b, (row, emb) in enumerate(images):
            n = emb.shape[0]
            if row < 0 or row + n > ids.size or (blocks[row : row + n] >= 0).any():
                raise ValueError(f"image rows {row}..{row + n} overlap another image or leave the {ids.size} rows")
            x[row : row + n] = emb
            blocks[row : row + n] = b
        return x, blocks

    def forward(
        self,
        ids: list[int] | np.ndarray,
        cache: KVCache,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        images: ImageRows = (),
    ) -> ForwardOutput:
        """Run tokens `ids` at positions cache.length.. ; appends their K/V; returns logits (+ taps)."""
        ids = self.check_ids(ids)
        start = cache.length
        x, blocks = self.with_images(ids, images)
        out_taps: dict[int, np.ndarray] = {}
        for l in range(self.spec.num_hidden_layers):
            x = self.layer(l, x, cache, start, blocks)
            if l in taps:
                out_taps[l] = x
        cache.set_length(start + ids.size)
        h = rms_norm(x[-1:] if last_only else x, self.w.plain("norm.weight"), self.spec.rms_norm_eps)
        return ForwardOutput(self.lm_head(h), out_taps)
