"""Runtime stage (reference backend): the target forward at the CUDA engine's precision ("w4a16" numerics).

`TargetModel` (numerics "float32") is the model's own math, proven against HF transformers. `W4A16Target` is the
same model rounded exactly where the CUDA engine's kernels store a value (the contracts of
templates/include/thorgen/*.cuh, as tests/engine_emulator.py runs them), so the engine can be compared with it
like with like, token for token:
  - every GEMM input is fp16: the norm outputs (input / pre-FFN norms, final norm), gelu(gate) * up of the dense
    MLP and of every expert, the attention output;
  - GEMM outputs, the residual stream and the router's logits and top-k weights are float32;
  - NVFP4 weights are applied as the kernels apply them: e2m1 * e4m3 times the part's float32 global multiplier
    (Checkpoint.nvfp4_parts: compressed-tensors' float32(1)/g, ModelOpt's weight_scale_2), where the checkpoint
    path of compressed-tensors divides by g; bf16 linears (a ModelOpt or bf16 checkpoint) are their fp16 values,
    as the fp16-weight kernels read them (converted once at repack: runtime/convert/linears.py);
  - queries are bf16 and the K/V cache holds bf16 or fp8 e4m3 values (`kv_dtype` "bf16" | "fp8");
  - attention is attn_fwd's tiled online softmax (engine_attention.py's `attention_rows` / `attention_partials` +
    `attention_combine`, shared with the emulator): fp32 scores and exp2, probabilities rounded to bf16 (fp16 with
    fp8 caches) before P.V while the row sum keeps them unrounded, the decode kernel's split-K workspace merged as
    attn_combine does, with the built kernels' tile/block/split constants (`attention_shapes`, read from their
    manifest.json);
  - the tied lm_head is the bf16 embedding quantised to NVFP4 with `quantize_nvfp4` exactly as repack does
    (`lm_head="nvfp4"`, the engine's path), or the bf16 embedding itself (`lm_head="bf16"`);
  - the embedding is scaled by float32(sqrt(H)) and the sampler sees softcapped float32 logits, as before;
  - image rows (float32, unscaled) replace their placeholders' embeddings, and a chunk holding image spans runs
    the sliding layers' attention as the engine's image programs do: the chunk kernel at any row count, each query
    of a span seeing keys up to the span's last position (`key_bounds`); full layers stay causal.
Between two rounding points everything is float64 (the kernels accumulate in float32: ~1e-7 relative, far below
one fp16 rounding). Where a rounded value is both stored and reused inside the same kernel (attn_tail, ffn_tail)
the unrounded float64 value feeds the fused norm, as in the kernel references. A float32 value is rounded to
fp16/bf16/fp8 from float32 (the kernels convert float32 registers), never directly from float64.
"""

from __future__ import annotations

import math

import numpy as np

from ...model_spec.conventions import VERIFY_ROWS
from ...model_spec.nvfp4 import bf16_to_f32, dequantize_nvfp4, multiplier_of_divisor, quantize_nvfp4
from ..manifest import load_manifest
from .engine_attention import attention_combine, attention_partials, attention_rows, attention_shapes
from .kv_cache import KVCache
from .model import ForwardOutput, ImageRows, TargetModel
from .ops import F32, F64, rope_cos_sin, softcap
from .rounding import round_to
from .weights import DEFAULT_EXPERT_BUDGET, TargetWeights, WeightSource

KV_DTYPES = ("bf16", "fp8")
LM_HEADS = ("nvfp4", "bf16")
LM_CHUNK = 8192  # lm_head rows scaled to float64 at a time (bounds the temporary for a 262144-row vocabulary)


def rms(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) (* w) over the last axis, all float64 (the kernels' norm)."""
    x64 = np.asarray(x, F64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return y if w is None else y * np.asarray(w, F64)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, F64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """rotate_half RoPE of float64 x [T, heads, D] with float32 cos/sin tables [T, D]."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos.astype(F64)[:, None, :] + rot * sin.astype(F64)[:, None, :]


def nvfp4_engine_weight(packed: np.ndarray, scale: np.ndarray, multiplier: float) -> np.ndarray:
    """float64 [N, K] weight as the NVFP4 kernels apply it: e2m1 * e4m3 times the float32 global multiplier."""
    return dequantize_nvfp4(packed, scale, 1.0).astype(F64) * F64(F32(multiplier))


def key_bounds(start: int, blocks: np.ndarray) -> np.ndarray:
    """The image programs' kv_hi of a chunk at positions start..: each row's own position, or for a row of an
    image span (blocks[row] >= 0) the span's last position."""
    hi = start + np.arange(blocks.size)
    for b in np.unique(blocks[blocks >= 0]):
        rows = np.nonzero(blocks == b)[0]
        hi[rows] = start + rows.max()
    return hi


class EngineWeights(TargetWeights):
    """TargetWeights whose NVFP4 Linears are float64 in the kernels' form (`nvfp4_engine_weight`); bf16 linears
    are their fp16 values (the bf16 weight rounded to nearest even, as the repack stores it)."""

    def __init__(self, source: WeightSource, expert_budget_bytes: int = DEFAULT_EXPERT_BUDGET) -> None:
        if not callable(getattr(source, "nvfp4_parts", None)):
            raise ValueError(
                "numerics 'w4a16' needs the raw NVFP4 tensors: the weight source has no nvfp4_parts() "
                "(open the checkpoint with thorgen.model_spec.checkpoint.Checkpoint)"
            )
        super().__init__(source, expert_budget_bytes)

    def load_linear(self, prefix: str) -> np.ndarray:
        storage = getattr(self.source, "linear_storage", None)
        if storage is not None and storage(prefix) == "bf16":
            w = bf16_to_f32(self.source.linear_bf16(prefix))  # type: ignore[attr-defined]
            return w.astype(np.float16).astype(F64)
        return nvfp4_engine_weight(*self.source.nvfp4_parts(prefix))  # type: ignore[attr-defined]


class W4A16Target(TargetModel):
    """The reference target at the CUDA engine's precision; same interface as TargetModel."""

    def __init__(
        self,
        source: WeightSource,
        kv_dtype: str = "bf16",
        lm_head: str = "nvfp4",
        embed_scale: float | None = None,
        expert_budget_bytes: int = DEFAULT_EXPERT_BUDGET,
        kernels=None,
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {', '.join(KV_DTYPES)}")
        if lm_head not in LM_HEADS:
            raise ValueError(f"lm_head {lm_head!r}: choose one of {', '.join(LM_HEADS)}")
        super().__init__(source, embed_scale=embed_scale, expert_budget_bytes=expert_budget_bytes)
        self.w = EngineWeights(source, expert_budget_bytes)
        self.kv_dtype, self.lm_head_kind = kv_dtype, lm_head
        if kernels is None:
            raise ValueError(
                "needs the built kernels (a folder with manifest.json from `thorgen build`, or a loaded "
                "KernelManifest): attention is emulated with the engine's own tile and split sizes"
            )
        manifest = kernels if hasattr(kernels, "kernels") else load_manifest(kernels)
        self._attn_shapes = attention_shapes(source.spec, manifest, kv_dtype)
        self.max_step_tokens = manifest.max_step_tokens
        self._lm: tuple[np.ndarray, F64] | None = None

    # ---- lm_head ----------------------------------------------------------------------------------------------
    def lm_head_weight(self) -> tuple[np.ndarray, np.float64]:
        """(float32 [V, H] unscaled weight, float64 scale): weight * scale is what the engine multiplies with."""
        if self._lm is None:
            emb = self.embedding_table()  # bf16 values as float32: what repack quantises
            if self.lm_head_kind == "bf16":
                self._lm = (emb, F64(1.0))
            else:
                packed, scale, g = quantize_nvfp4(emb)
                # e2m1 * e4m3 is exact in float32; the multiplier is what repack stores for the lm_head
                self._lm = (dequantize_nvfp4(packed, scale, 1.0), F64(multiplier_of_divisor(g)))
        return self._lm

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Softcapped float32 logits [T, V] of the fp16 final-norm output h [T, H]."""
        w, inv = self.lm_head_weight()
        h64 = np.asarray(h, F64)
        out = np.empty((h64.shape[0], w.shape[0]), F32)
        for s in range(0, w.shape[0], LM_CHUNK):
            out[:, s : s + LM_CHUNK] = h64 @ (w[s : s + LM_CHUNK].astype(F64) * inv).T
        return softcap(out, self.spec.final_logit_softcapping)

    # ---- one decoder layer --------------------------------------------------------------------------------------
    def _gemm(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return round_to(x @ self.w.linear(prefix).T, "f32")

    def _attention_block(
        self, l: int, x: np.ndarray, a: np.ndarray, cache: KVCache, start: int, kv_hi: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """qkv GEMM, rope_kv, attention, o_proj, attn_tail -> (residual x f32, a1 f16, a2 f16)."""
        s, t = self.spec, x.shape[0]
        eps, d, nq, nkv = s.rms_norm_eps, s.layer_head_dim(l), s.num_attention_heads, s.layer_kv_heads(l)
        p = f"layers.{l}.self_attn."
        cos, sin = rope_cos_sin(np.arange(start, start + t), self._inv_freq[l])
        q_raw = self._gemm(a, p + "q_proj").reshape(t, nq, d)
        k_raw = self._gemm(a, p + "k_proj").reshape(t, nkv, d)
        v_raw = self._gemm(a, p + "v_proj").reshape(t, nkv, d) if s.layer_has_v_proj(l) else k_raw
        q = round_to(rope(rms(q_raw, self.w.plain(p + "q_norm.weight"), eps), cos, sin), "bf16")
        k = rope(rms(k_raw, self.w.plain(p + "k_norm.weight"), eps), cos, sin)
        v = rms(v_raw, None, eps)
        cache.write(l, start, round_to(k, self.kv_dtype).astype(F32), round_to(v, self.kv_dtype).astype(F32))
        end = start + t
        o = self._engine_attention(l, q, cache.keys(l, end), cache.values(l, end), start, kv_hi)
        o = self._gemm(round_to(o, "f16").reshape(t, nq * d), p + "o_proj")
        xn = x + rms(o, self.w.plain(f"layers.{l}.post_attention_layernorm.weight"), eps)
        n = rms(xn, None, eps)
        a1 = round_to(n * self.w.plain(f"layers.{l}.pre_feedforward_layernorm.weight"), "f16")
        a2 = round_to(n * self.w.plain(f"layers.{l}.pre_feedforward_layernorm_2.weight"), "f16")
        return round_to(xn, "f32"), a1, a2

    def _engine_attention(
        self, l: int, q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, kv_hi: np.ndarray | None = None
    ) -> np.ndarray:
        """The engine's attention launches for the rows q [T, Hq, D] at positions start..: prefill chunks of
        max_step_tokens rows, each the prefill kernel (> VERIFY_ROWS rows) or the decode/verify kernel
        (<= VERIFY_ROWS, split-K + combine where it has NSPLIT > 1). `kv_hi` (a chunk holding images): a sliding
        layer runs the prefill kernel with those per-query key bounds (one chunk: the caller's)."""
        dec, pre = self._attn_shapes[self.spec.layer_types[l]]
        window, out = self.spec.layer_window(l), np.empty(q.shape, F64)
        if kv_hi is not None and window:
            if q.shape[0] > self.max_step_tokens:
                raise ValueError(
                    f"a chunk holding images has {q.shape[0]} rows; the engine runs at most {self.max_step_tokens}"
                )
            return attention_rows(q, keys, values, start, window, pre, self.kv_dtype, kv_hi)
        for a in range(0, q.shape[0], self.max_step_tokens):
            b = min(q.shape[0], a + self.max_step_tokens)
            shape = dec if b - a <= VERIFY_ROWS else pre
            if shape.nsplit == 1:
                out[a:b] = attention_rows(q[a:b], keys, values, start + a, window, shape, self.kv_dtype)
            else:
                out[a:b] = attention_combine(
                    *attention_partials(q[a:b], keys, values, start + a, window, shape, self.kv_dtype)
                )
        return out

    def route(self, l: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """router_logits + router_topk on the float32-valued residual x -> (float32 weights [T, K], ids [T, K])."""
        s, p = self.spec, f"layers.{l}.router."
        hn = rms(x, None, s.rms_norm_eps) * self.w.plain(p + "scale") * s.hidden_size**-0.5
        logits = round_to(hn @ self.w.plain(p + "proj.weight").astype(F64).T, "f32")
        prob = np.exp(logits - logits.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        idx = np.argsort(-prob, axis=-1, kind="stable")[:, : s.top_k_experts]  # ties -> lower expert id
        w = np.take_along_axis(prob, idx, -1)
        w = w / w.sum(-1, keepdims=True) * self.w.plain(p + "per_expert_scale")[idx]
        return w.astype(F32), idx

    def _gated(self, x: np.ndarray, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        return round_to(gelu_tanh(x @ gate.T) * (x @ up.T), "f16")

    def _moe(self, l: int, a2: np.ndarray, weights: np.ndarray, idx: np.ndarray) -> np.ndarray:
        t, k = idx.shape
        contrib = np.zeros((t, k, a2.shape[1]), F64)
        for e in np.unique(idx):
            rows, ranks = np.nonzero(idx == e)
            gate, up, down = self.w.expert(l, int(e))
            act = self._gated(a2[rows], gate, up)
            contrib[rows, ranks] = weights[rows, ranks].astype(F64)[:, None] * (act @ down.T)
        y = np.zeros((t, a2.shape[1]), F64)
        for r in range(k):  # summed in top-k rank order, as the kernels' combine (and moe_down) do
            y += contrib[:, r]
        return round_to(y, "f32")

    def _ffn_block(
        self, l: int, x: np.ndarray, a1: np.ndarray, a2: np.ndarray, w_next: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """router, dense MLP, MoE, ffn_tail -> (residual x f32 after layer_scalar, next norm's output f16)."""
        eps, p = self.spec.rms_norm_eps, f"layers.{l}."
        weights, idx = self.route(l, x)
        act = self._gated(a1, self.w.linear(p + "mlp.gate_proj"), self.w.linear(p + "mlp.up_proj"))
        mlp = self._gemm(act, p + "mlp.down_proj")
        moe = self._moe(l, a2, weights, idx)
        pl = lambda n: self.w.plain(f"{p}{n}.weight")  # noqa: E731
        h = rms(
            rms(mlp, pl("post_feedforward_layernorm_1"), eps) + rms(moe, pl("post_feedforward_layernorm_2"), eps),
            pl("post_feedforward_layernorm"),
            eps,
        )
        xn = (x + h) * F64(self.w.plain(f"{p}layer_scalar")[0])
        return round_to(xn, "f32"), round_to(rms(xn, w_next, eps), "f16")

    # ---- whole model ------------------------------------------------------------------------------------------
    def forward(
        self,
        ids: list[int] | np.ndarray,
        cache: KVCache,
        taps: tuple[int, ...] = (),
        last_only: bool = False,
        images: ImageRows = (),
    ) -> ForwardOutput:
        """Run tokens `ids` at positions cache.length.. ; appends their K/V; returns logits (+ taps). `images`:
        (row, float32 rows [N, H]) replacing those rows' embeddings, each span one block (key_bounds)."""
        ids = self.check_ids(ids)
        s, start = self.spec, cache.length
        x, blocks = self.with_images(ids, images)  # float32 product, as the embed kernel; image rows as copied
        x = x.astype(F64)
        kv_hi = None if blocks is None else key_bounds(start, blocks)
        a = round_to(rms(x, self.w.plain("layers.0.input_layernorm.weight"), s.rms_norm_eps), "f16")
        out_taps: dict[int, np.ndarray] = {}
        for l in range(s.num_hidden_layers):
            nxt = f"layers.{l + 1}.input_layernorm.weight" if l + 1 < s.num_hidden_layers else "norm.weight"
            x, a1, a2 = self._attention_block(l, x, a, cache, start, kv_hi)
            x, a = self._ffn_block(l, x, a1, a2, self.w.plain(nxt))
            if l in taps:
                out_taps[l] = x.astype(F32)
        cache.set_length(start + ids.size)
        return ForwardOutput(self.lm_head(a[-1:] if last_only else a), out_taps)
