"""Runtime stage: DFlash speculative decoding on the CUDA engine — the drafter's launches and buffers (the engine
core's CudaRunner drives the draft/verify steps).

Per step (MODEL_FACTS §3.3), with `last` the newest token at position `start` (not yet in any cache):
  1. draft graph: block embedding of [last, mask x15] (x embed scale) at positions start..start+15, the drafter
     layers (Qwen3, hybrid mask: sliding layers causal within the block, the full layer bidirectional) over the
     persistent drafter KV cache (context K/V of every committed position) plus the block's own K/V, final norm,
     the shared NVFP4 lm_head + argmax of slots 1..15 straight into ids[1..15] (ids[0] = last, staged by the host);
  2. verify graph: the target forward over ids[0..15] at start..start+15 (the M=16 kernels) with every row's
     token into out_ids[0..15] (argmax, or the seeded sampler at absolute position start+1+i) and the DFlash taps
     of all 16 rows, then the context update of the same 16 positions: fc(taps) -> hidden_norm -> per drafter layer
     k/v projections -> k_norm + RoPE -> drafter cache.
  3. the host reads the 15 drafts and the 16 target tokens (the only device->host traffic), acc = longest prefix
     with d_i == target_i-1, commits target_0..target_acc.
Rollback needs no work: the target rows and the drafter context rows beyond the committed length hold K/V of
rejected tokens at positions start+acc+1..start+15, and the next step (block at start+acc+1..start+acc+16)
writes every one of them again (its block K/V, then its verify K/V and context rows) before any query reads them;
rings have window + 512 >= window + 16 slots, so a block never overwrites a key its own queries still need.
Both graphs have fixed shapes (16 rows): only positions (host -> device) and ids[0] change between steps.
"""

from __future__ import annotations

from ..model_spec.conventions import VERIFY_ROWS as BLOCK  # DFlashSpec.block_size must match
from ..model_spec.types import ModelSpec
from .backend import BackendError
from .forward import NULL, Forward, Missing, Op, need
from .kv_cache import ring_slots
from .memory import ArenaPlan
from .modules import KernelEntry



def split_weights(spec: ModelSpec) -> list[tuple[str, str, int, int, int]]:
    """(name, fused source, first row, rows, k) of the drafter q / k / v matrices cut out of the repacked q|k|v
    (the GEMM kernels read whole matrices; see Engine._split_drafter_weights)."""
    d = spec.drafter
    assert d is not None
    nq, nkv, out = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim, []
    for l in range(d.num_hidden_layers):
        src = f"draft.layers.{l}.self_attn.qkv_proj.weight"
        for part, r0, n in (("q", 0, nq), ("k", nq, nkv), ("v", nq + nkv, nkv)):
            out.append((f"dsplit.{l}.{part}", src, r0, n, d.hidden_size))
    return out


def plan_drafter_activations(p: ArenaPlan, spec: ModelSpec, rows: int) -> None:
    """Drafter buffers: context path sized for a prefill chunk (`rows`), block path for BLOCK rows."""
    d, H = spec.drafter, spec.target.hidden_size
    assert d is not None
    nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    for name, shape, dt in (
            ("taps", (rows, len(d.target_layer_ids) * H), "f16"), ("dctx", (rows, d.hidden_size), "f32"),
            ("dctx_a", (rows, d.hidden_size), "f16"), ("dk_raw", (rows, nkv), "f32"), ("dv_raw", (rows, nkv), "f32"),
            ("dx", (BLOCK, d.hidden_size), "f32"), ("da", (BLOCK, d.hidden_size), "f16"),
            ("dq_raw", (BLOCK, nq), "f32"), ("dq", (BLOCK, nq), "bf16"), ("dattn", (BLOCK, nq), "f16"),
            ("do", (BLOCK, d.hidden_size), "f32"), ("dmlp", (BLOCK, d.intermediate_size), "f16")):
        p.add_array(name, shape, dt)


class DraftForward:
    """The drafter's launches, found in the manifest like the target's (Forward.find) and bound to its pointers."""

    def __init__(self, fwd: Forward) -> None:
        self.fwd, self.spec = fwd, fwd.spec
        if self.spec.drafter is None:
            raise BackendError(f"model {self.spec.name} has no DFlash drafter")
        if self.spec.drafter.block_size != BLOCK:
            raise BackendError(f"drafter block_size {self.spec.drafter.block_size}: the engine's verify step is "
                               f"built for {BLOCK}")

    def _gemm(self, label: str, w: str, n: int, k: int, rows: int, x, y, epi: str = "store") -> Op:
        f = self.fwd
        if rows > BLOCK:
            e = f.find("bf16_gemm_large.cu.j2", f"drafter prefill GEMM n={n} k={k}", n=n, k=k, epi=epi)
        else:
            e = f.find("bf16_gemm.cu.j2", f"drafter GEMM n={n} k={k} m<=16", n=n, k=k, epi=epi, mmax=16)
        return Op(label, need(e), dict(w=f.ptr.W(w), x=x, y=y, m=rows), rows)

    def _rope(self, l: int, has_q: bool) -> KernelEntry:
        d = self.spec.drafter
        w = d.layer_window(l) or 0
        return need(self.fwd.find("rope_kv.cu.j2", f"drafter rope_kv ({'block' if has_q else 'context'}) layer {l}",
                                  HQ=d.num_attention_heads, HKV=d.num_key_value_heads, D=d.head_dim, HAS_Q=has_q,
                                  KV="bf16", V_FROM_K=False, V_NORM=False,
                                  SLOTS=ring_slots(w, self.fwd.manifest.conventions) if w else 0,
                                  THETA=float(d.rope_theta)))

    def _rope_op(self, l: int, rows: int, has_q: bool, q_raw, q_out) -> Op:
        A, W, p, d = self.fwd.ptr.A, self.fwd.ptr.W, f"draft.layers.{l}.self_attn.", self.spec.drafter
        return Op(f"draft.{l}.rope_kv", self._rope(l, has_q), dict(
            q_raw=q_raw, k_raw=A("dk_raw"), v_raw=A("dv_raw"), q_norm_w=W(p + "q_norm.weight"),
            k_norm_w=W(p + "k_norm.weight"), positions=A("positions"), q_out=q_out,
            k_cache=self.fwd.ptr.DKV(l, "k"), v_cache=self.fwd.ptr.DKV(l, "v"), lanes=NULL, lane_bytes=0,
            q_stride=d.num_attention_heads * d.head_dim, kv_stride=d.num_key_value_heads * d.head_dim, T=rows),
                  rows)  # the drafter context has one lane (the sequence that owns it)

    def ctx_ops(self, rows: int) -> list[Op]:
        """Context K/V of `rows` positions (positions[0..rows)) from the taps rows 0..rows-1 into the drafter cache."""
        d, A, W, f = self.spec.drafter, self.fwd.ptr.A, self.fwd.ptr.W, self.fwd
        h, nkv = d.hidden_size, d.num_key_value_heads * d.head_dim
        ops = [self._gemm("draft.fc", "draft.fc.weight", h, len(d.target_layer_ids) * self.spec.target.hidden_size,
                          rows, A("taps"), A("dctx"))]
        norm = need(f.find("rmsnorm.cu.j2", "drafter hidden_norm", H=h, IN="f32", OUT="f16", EPS=d.rms_norm_eps))
        ops.append(Op("draft.hidden_norm", norm, dict(x=A("dctx"), w=W("draft.hidden_norm.weight"), y=A("dctx_a"),
                                                      T=rows), rows))
        for l in range(d.num_hidden_layers):
            ops.append(self._gemm(f"draft.{l}.ctx_k", f"dsplit.{l}.k", nkv, h, rows, A("dctx_a"), A("dk_raw")))
            ops.append(self._gemm(f"draft.{l}.ctx_v", f"dsplit.{l}.v", nkv, h, rows, A("dctx_a"), A("dv_raw")))
            ops.append(self._rope_op(l, rows, False, NULL, NULL))  # (no queries: HAS_Q false never reads them)
        return ops

    def block_ops(self) -> list[Op]:
        """The 16-slot block at positions[0..16) -> drafts of slots 1..15 into ids[1..15] (ids[0] = last token)."""
        d, t, A, W, f = self.spec.drafter, self.spec.target, self.fwd.ptr.A, self.fwd.ptr.W, self.fwd
        h, nq, nkv, B = d.hidden_size, d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim, BLOCK
        emb = need(f.find("embed.cu.j2", "drafter block embedding", H=t.hidden_size, V=t.vocab_size,
                          MASK_ID=d.mask_token_id, OUT="f32", SCALE=float(d.embed_scale)))
        ops = [Op("draft.embed", emb, dict(ids=A("ids"), table=W("embed_tokens.weight"), out=A("dx"), T=B), B)]
        norm = need(f.find("rmsnorm.cu.j2", "drafter rmsnorm", H=h, IN="f32", OUT="f16", EPS=d.rms_norm_eps))
        add = need(f.find("add_rmsnorm.cu.j2", "drafter add+rmsnorm", H=h, IN="f32", OUT="f16", EPS=d.rms_norm_eps))
        ops.append(Op("draft.0.input_norm", norm, dict(x=A("dx"), w=W("draft.layers.0.input_layernorm.weight"),
                                                       y=A("da"), T=B), B))
        for l in range(d.num_hidden_layers):
            p = f"draft.layers.{l}."
            ops.append(self._gemm(f"draft.{l}.q", f"dsplit.{l}.q", nq, h, B, A("da"), A("dq_raw")))
            ops.append(self._gemm(f"draft.{l}.k", f"dsplit.{l}.k", nkv, h, B, A("da"), A("dk_raw")))
            ops.append(self._gemm(f"draft.{l}.v", f"dsplit.{l}.v", nkv, h, B, A("da"), A("dv_raw")))
            ops.append(self._rope_op(l, B, True, A("dq_raw"), A("dq")))
            w = d.layer_window(l) or 0
            attn = need(f.find("attn_fwd.cu.j2", f"drafter attention layer {l}", d=d.head_dim,
                               hq=d.num_attention_heads, hkv=d.num_key_value_heads, window=w,
                               ring=ring_slots(w, f.manifest.conventions) if w else 0, causal=d.is_causal(l),
                               scale=float(d.head_dim ** -0.5), kv_dtype="bf16", mmax=16))
            ops += f.attention_ops(f"draft.{l}.", attn, B, A("dq"), f.ptr.DKV(l, "k"), f.ptr.DKV(l, "v"), A("dattn"))
            ops.append(self._gemm(f"draft.{l}.o", p + "self_attn.o_proj.weight", h, nq, B, A("dattn"), A("do")))
            ops.append(Op(f"draft.{l}.post_attn_norm", add, dict(x=A("dx"), y=A("do"),
                                                                 w=W(p + "post_attention_layernorm.weight"),
                                                                 a=A("da"), T=B), B))
            ops.append(self._gemm(f"draft.{l}.gate_up", p + "mlp.gate_up_proj.weight", 2 * d.intermediate_size, h,
                                  B, A("da"), A("dmlp"), epi="silu_mul"))
            ops.append(self._gemm(f"draft.{l}.down", p + "mlp.down_proj.weight", h, d.intermediate_size, B,
                                  A("dmlp"), A("do")))
            nxt = f"draft.layers.{l + 1}.input_layernorm.weight" if l + 1 < d.num_hidden_layers else "draft.norm.weight"
            ops.append(Op(f"draft.{l}.ffn_norm", add, dict(x=A("dx"), y=A("do"), w=W(nxt), a=A("da"), T=B), B))
        # slots 1..15 only: the slot-0 prediction is never used, and ids[0] must keep the last token
        return ops + f.head_ops(A("da", 1), B - 1, A("ids", 1), greedy=True)

    def probe(self) -> list[str]:
        """What the speculative path lacks (empty: it can run). Uses the Forward's probing stubs."""
        f = self.fwd
        before, f._probing = len(f.missing), True
        try:
            for greedy in (True, False):
                f.ops(BLOCK, decode=False, last=True, greedy=greedy, taps=True, all_logits=True)
            for rows in (1, BLOCK, f.max_rows):
                f.ops(rows, decode=False, last=True, taps=True)
                self.ctx_ops(rows)
            self.block_ops()
        except Missing:
            pass
        finally:
            f._probing = False
        out = list(dict.fromkeys(f.missing[before:]))
        del f.missing[before:]
        return out


__all__ = ["BLOCK", "DraftForward", "plan_drafter_activations", "split_weights"]
