"""Runtime stage (reference backend): the DFlash block drafter forward in NumPy (MODEL_FACTS §3.2).

Per sequence a `DraftContext` holds the target taps of committed positions and, per draft layer, the
context K/V computed from them (ctx = hidden_norm(fc(concat(taps))); K = RoPE(k_norm(k_proj ctx)), V = v_proj ctx,
at absolute positions). `DFlashDrafter.propose` runs one block [last_token, mask x (B-1)] at positions
start..start+B-1 against that context and returns the B-1 argmax drafts. Block K/V are never stored: the
context covers exactly the committed positions 0..start-1, and rollback crops taps and K/V together.

Masks ("Hybrid DFlash"): sliding layers are causal within the block with their window over context + block
(key j visible to block query p iff j <= p and p - j < window); the full layer sees all context and the whole
block (bidirectional). Attention scale 1/sqrt(head_dim); Qwen3 layers (pre-norm, SiLU-gated MLP).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ...model_spec.types import DFlashSpec
from .kv_cache import KVCache
from .model import TargetModel
from .ops import F32, F64, apply_rope, attend, mm, rms_norm, rope_cos_sin, silu, softcap, window_visible
from .weights import DrafterWeights, WeightSource


class DraftContext:
    """Committed-position state of one sequence for the drafter: taps [n, n_taps*H] and the context K/V."""

    def __init__(self, kv: KVCache | None, tap_width: int) -> None:
        self.taps = np.zeros((0, tap_width), dtype=F32)
        self.kv = kv  # None for drafters that do not attend to the context (scripted test drafters)

    @property
    def length(self) -> int:
        return self.taps.shape[0]

    def append(self, taps: np.ndarray) -> None:
        self.taps = np.concatenate([self.taps, taps.astype(F32)], axis=0)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a draft context of length {self.length} to {n}")
        self.taps = self.taps[:n]
        if self.kv is not None and self.kv.length > n:
            self.kv.truncate(n)

    def copy(self) -> "DraftContext":
        out = DraftContext(None if self.kv is None else self.kv.copy(), self.taps.shape[1])
        out.taps = self.taps.copy()
        return out


class Drafter(Protocol):
    """What the speculative loop needs from a drafter (the DFlash reference, or a scripted test drafter)."""

    block_size: int
    tap_layers: tuple[int, ...]

    def new_context(self) -> DraftContext: ...

    def propose(self, ctx: DraftContext, last_token: int, start: int) -> list[int]:
        """block_size - 1 draft tokens for positions start+1 .. start+block_size-1 (ctx covers 0..start-1)."""
        ...


class DFlashDrafter:
    """The DFlash drafter; shares the target's embedding table and tied lm_head."""

    def __init__(self, source: WeightSource, target: TargetModel) -> None:
        spec = source.spec.drafter
        if spec is None:
            raise ValueError("the checkpoint has no drafter (no dflash/ folder and no --draft)")
        self.spec: DFlashSpec = spec
        self.target = target
        self.w = DrafterWeights(source)
        self.block_size = spec.block_size
        self.tap_layers = tuple(spec.target_layer_ids)
        self.embed_scale = F32(spec.embed_scale)
        half = spec.head_dim // 2
        self._inv_freq = 1.0 / spec.rope_theta ** (np.arange(half, dtype=F64) * 2.0 / spec.head_dim)

    def new_context(self) -> DraftContext:
        s = self.spec
        kv = KVCache([(s.num_key_value_heads, s.head_dim)] * s.num_hidden_layers)
        return DraftContext(kv, len(self.tap_layers) * s.hidden_size)

    def _norm(self, name: str, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.w.get(name), self.spec.rms_norm_eps)

    def _kv(self, layer: int, h: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s, p = self.spec, f"layers.{layer}.self_attn."
        t = h.shape[0]
        k = mm(h, self.w.get(p + "k_proj.weight")).reshape(t, s.num_key_value_heads, s.head_dim)
        v = mm(h, self.w.get(p + "v_proj.weight")).reshape(t, s.num_key_value_heads, s.head_dim)
        cos, sin = rope_cos_sin(pos, self._inv_freq)
        return apply_rope(self._norm(p + "k_norm.weight", k), cos, sin), v

    def fuse(self, taps: np.ndarray) -> np.ndarray:
        """ctx = hidden_norm(fc(concat(taps))) for taps [T, n_taps*H]."""
        return self._norm("hidden_norm.weight", mm(taps, self.w.get("fc.weight")))

    def sync_context(self, ctx: DraftContext) -> None:
        """Compute the context K/V of taps not yet projected (positions kv.length .. ctx.length-1)."""
        kv = ctx.kv
        assert kv is not None
        n0, n1 = kv.length, ctx.length
        if n1 == n0:
            return
        fused = self.fuse(ctx.taps[n0:n1])
        pos = np.arange(n0, n1)
        for l in range(self.spec.num_hidden_layers):
            k, v = self._kv(l, fused, pos)
            kv.write(l, n0, k, v)
        kv.set_length(n1)

    def block_hidden(self, ctx: DraftContext, block_ids: list[int], start: int) -> np.ndarray:
        """Final-normed hidden states [B, H] of a block whose first slot sits at absolute position `start`."""
        s = self.spec
        if ctx.length != start:
            raise ValueError(f"draft context covers {ctx.length} positions, block starts at {start}")
        self.sync_context(ctx)
        kv = ctx.kv
        ids = np.asarray(block_ids, dtype=np.int64)
        b = ids.size
        h = self.target.embedding_table()[ids] * self.embed_scale
        qpos = np.arange(start, start + b)
        kpos = np.arange(start + b)
        cos, sin = rope_cos_sin(qpos, self._inv_freq)
        for l in range(s.num_hidden_layers):
            p = f"layers.{l}."
            hn = self._norm(p + "input_layernorm.weight", h)
            q = mm(hn, self.w.get(p + "self_attn.q_proj.weight")).reshape(b, s.num_attention_heads, s.head_dim)
            q = apply_rope(self._norm(p + "self_attn.q_norm.weight", q), cos, sin)
            kb, vb = self._kv(l, hn, qpos)
            k = np.concatenate([kv.keys(l, start), kb], axis=0)
            v = np.concatenate([kv.values(l, start), vb], axis=0)
            vis = window_visible(qpos, kpos, causal=s.is_causal(l), window=s.layer_window(l))
            o = attend(q, k, v, vis, scale=s.head_dim**-0.5)
            h = h + mm(o, self.w.get(p + "self_attn.o_proj.weight"))
            hn = self._norm(p + "post_attention_layernorm.weight", h)
            mlp = silu(mm(hn, self.w.get(p + "mlp.gate_proj.weight"))) * mm(hn, self.w.get(p + "mlp.up_proj.weight"))
            h = h + mm(mlp, self.w.get(p + "mlp.down_proj.weight"))
        return self._norm("norm.weight", h)

    def block_logits(self, ctx: DraftContext, block_ids: list[int], start: int) -> np.ndarray:
        """Softcapped draft logits [B, V] of every block slot (slot 0 included, unused by the loop)."""
        h = self.block_hidden(ctx, block_ids, start)
        return softcap(mm(h, self.target.embedding_table()), self.spec.final_logit_softcapping)

    def propose(self, ctx: DraftContext, last_token: int, start: int) -> list[int]:
        block = [int(last_token)] + [self.spec.mask_token_id] * (self.block_size - 1)
        logits = self.block_logits(ctx, block, start)[1:]
        return [int(i) for i in np.argmax(logits, axis=-1)]  # argmax: ties go to the lowest id
