"""Codegen stage: the DFlash drafter's launches lowered onto its families' kernels (the draft block, and the context
K/V update of committed positions), as codegen/lower.py does the target's; codegen/programs.py writes them into the
manifest. The step itself: runtime/cuda/dflash.py."""

from __future__ import annotations

from dataclasses import replace

from ..model_spec.conventions import VERIFY_ROWS  # DFlashSpec.block_size must match
from ..model_spec.step_program import Op, draft_batch_blocks, drafter_problem
from .families import drafter_glue, norms
from .families.attention import drafter_attention
from .families.drafter_gemm import drafter_gemm
from .families.rope_kv import drafter_rope_kv
from .kernel_spec import KernelSpec
from .lower import Lower
from .lower_head import pick_ops
from .symbols import NULL


class LowerDraft:
    """The drafter's launches, lowered like the target's (through Lower.use)."""

    def __init__(self, fwd: Lower) -> None:
        self.fwd, self.spec = fwd, fwd.spec
        problem = drafter_problem(self.spec)
        if problem:
            raise ValueError(problem)

    def _gemm(self, label: str, w: str, n: int, k: int, rows: int, x, y, epi: str = "store") -> Op:
        f = self.fwd
        what = (
            f"drafter prefill GEMM n={n} k={k}" if rows > VERIFY_ROWS else f"drafter GEMM n={n} k={k} m<={VERIFY_ROWS}"
        )
        return Op(label, f.use(drafter_gemm(n, k, rows, epi, f.arch), what), dict(w=f.ptr.W(w), x=x, y=y, m=rows), rows)

    def _rope(self, l: int, has_q: bool) -> KernelSpec:
        return self.fwd.use(
            drafter_rope_kv(self.spec, self.fwd.arch, l, has_q),
            f"drafter rope_kv ({'block' if has_q else 'context'}) layer {l}",
        )

    def _rope_op(self, l: int, rows: int, has_q: bool, raw, stride: int, q_out) -> Op:
        """rope_kv over one GEMM's [rows, (q|)k|v] output `raw` (row stride `stride`): keys and values (and, with
        `has_q`, the queries) read in place."""
        A, W, p, d = self.fwd.ptr.A, self.fwd.ptr.W, f"draft.layers.{l}.self_attn.", self.spec.drafter
        nq, nkv = (d.num_attention_heads * d.head_dim if has_q else 0), d.num_key_value_heads * d.head_dim
        return Op(
            f"draft.{l}.rope_kv",
            self._rope(l, has_q),
            dict(
                q_raw=raw if has_q else NULL,
                k_raw=raw + 4 * nq,
                v_raw=raw + 4 * (nq + nkv),
                q_norm_w=W(p + "q_norm.weight"),
                k_norm_w=W(p + "k_norm.weight"),
                positions=A("positions"),
                q_out=q_out,
                k_cache=self.fwd.ptr.DKV(l, "k"),
                v_cache=self.fwd.ptr.DKV(l, "v"),
                lanes=A("lanes"),
                lane_bytes=self.fwd.ptr.dlane_bytes(l),
                pages=NULL,
                q_stride=stride,
                kv_stride=stride,
                T=rows,
            ),
            rows,
        )  # (the sequence's own drafter lane; no queries: HAS_Q false never reads them)

    def ctx_ops(self, rows: int) -> list[Op]:
        """Context K/V of `rows` positions (positions[0..rows)) from the taps rows 0..rows-1 into the drafter cache."""
        d, A, W, f = self.spec.drafter, self.fwd.ptr.A, self.fwd.ptr.W, self.fwd
        h, nkv = d.hidden_size, d.num_key_value_heads * d.head_dim
        ops = [
            self._gemm(
                "draft.fc",
                "draft.fc.weight",
                h,
                len(d.target_layer_ids) * self.spec.target.hidden_size,
                rows,
                A("taps"),
                A("dctx"),
            )
        ]
        norm = f.use(norms.rmsnorm_kernel(h, d.rms_norm_eps, f.arch, inp="f32"), "drafter hidden_norm")
        ops.append(
            Op(
                "draft.hidden_norm",
                norm,
                dict(x=A("dctx"), w=W("draft.hidden_norm.weight"), y=A("dctx_a"), T=rows),
                rows,
            )
        )
        for l in range(d.num_hidden_layers):
            ops.append(self._gemm(f"draft.{l}.ctx_kv", f"dsplit.{l}.kv", 2 * nkv, h, rows, A("dctx_a"), A("dkv_raw")))
            ops.append(self._rope_op(l, rows, False, A("dkv_raw"), 2 * nkv, NULL))
        return ops

    def verify_ops(self, greedy: bool = True) -> list[Op]:
        """The verify step over the 16-slot block at positions[0..16) (ids[0..16) = [last, drafts]): the target's
        forward with the DFlash taps; then the drafter's context update of those 16 positions on the side stream
        (branch 1), beside the target's lm_head and picks (every row's token into out_ids[row]), which need only the
        last layer: the side stream is idle there (the last tap layer is earlier); then the acceptance, once both
        are done (join)."""
        f, A = self.fwd, self.fwd.ptr.A
        ops = f.ops(VERIFY_ROWS, last=True, greedy=greedy, taps=True, all_logits=True)
        head = f.head_ops(A("a"), VERIFY_ROWS, A("out_ids"), greedy)
        body, tail = ops[: -len(head)], ops[-len(head) :]
        assert [(o.label, o.entry.name) for o in tail] == [(o.label, o.entry.name) for o in head], "head not last"
        ctx = [replace(op, branch=1) for op in self.ctx_ops(VERIFY_ROWS)]
        return body + ctx + tail + [replace(op, join=True) for op in self.accept_ops()]

    def accept_ops(self) -> list[Op]:
        """After a verify step: its committed count into spec_acc, and the next step's block (positions, sampled
        positions, ids[0]) from it, under the rule in spec_rule (runtime/cuda/runner.py launches that step ahead)."""
        A, f = self.fwd.ptr.A, self.fwd
        e = f.use(drafter_glue.accept(self.spec, f.arch), "DFlash acceptance on the device")
        return [
            Op(
                "draft.accept",
                e,
                dict(
                    ids=A("ids"),
                    out_ids=A("out_ids"),
                    positions=A("positions"),
                    sampled=A("positions", f.max_rows),
                    rule=A("spec_rule"),
                    accepted=A("spec_acc"),
                ),
                VERIFY_ROWS,
                pdl=False,
            )
        ]

    def block_ops(self) -> list[Op]:
        """The 16-slot block at positions[0..16) -> drafts of slots 1..15 into ids[1..15] (ids[0] = last token)."""
        ops = self._body(VERIFY_ROWS, 1)
        # slots 1..15 only: the slot-0 prediction is never used, and ids[0] must keep the last token
        ops += self.fwd.head_ops(self.fwd.ptr.A("da", 1), VERIFY_ROWS - 1, self.fwd.ptr.A("ids", 1), greedy=True)
        # No programmatic dependent launches in the block: its graph replayed in 0.688 ms without them against
        # 0.765 with them (H200; the target's decode gains 58 us from PDL)
        return [replace(op, pdl=False) for op in ops]

    def batch_ops(self, rows: int) -> list[Op]:
        """A batched draft step's layers: the blocks of rows / 16 sequences (block b: rows 16 b .. 16 b + 15 at
        positions[16 b ..] in lane lanes[16 b], its last token at ids[16 b]) through the drafter at once (its weights
        read once), each block's attention over its own lane with its own block mask; the final norm's rows in da.
        The drafts the verify takes come from `head_ops` over the rows gathered from da."""
        ops = self._body(rows, draft_batch_blocks(self.fwd.max_rows))
        return [replace(op, pdl=False) for op in ops]

    def head_ops(self, rows: int) -> list[Op]:
        """The drafts of `rows` rows of dhead (gathered final-norm rows of a batched draft step): lm_head once over
        them all, the argmax of each into carry[row] (where a batched verify's rows take them from)."""
        f, A = self.fwd, self.fwd.ptr.A
        t = self.spec.target
        ops = [
            f.gemm_op("lm_head", "lm_head", t.vocab_size, t.hidden_size, rows, A("dhead"), A("logits"), batched=True)
        ]
        for r0 in range(0, rows, VERIFY_ROWS):
            ops += pick_ops(f, min(VERIFY_ROWS, rows - r0), A("logits", r0), A("carry", r0), True, r0)
        return [replace(op, pdl=False) for op in ops]

    def _body(self, rows: int, blocks: int) -> list[Op]:
        """Embedding, the drafter's layers and its final norm (into da) of `rows` rows: one block of 16 (`blocks`
        1), or blocks of 16 of up to `blocks` sequences."""
        d, A, W, f = self.spec.drafter, self.fwd.ptr.A, self.fwd.ptr.W, self.fwd
        h, B = d.hidden_size, rows
        nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
        emb = f.use(drafter_glue.block_embed(self.spec, f.arch), "drafter block embedding")
        ops = [Op("draft.embed", emb, dict(ids=A("ids"), table=W("embed_tokens.weight"), out=A("dx"), T=B), B)]
        norm = f.use(norms.rmsnorm_kernel(h, d.rms_norm_eps, f.arch, inp="f32"), "drafter rmsnorm")
        add = f.use(norms.add_rmsnorm_kernel(h, d.rms_norm_eps, f.arch, inp="f32"), "drafter add+rmsnorm")
        ops.append(
            Op(
                "draft.0.input_norm",
                norm,
                dict(x=A("dx"), w=W("draft.layers.0.input_layernorm.weight"), y=A("da"), T=B),
                B,
            )
        )
        for l in range(d.num_hidden_layers):
            p = f"draft.layers.{l}."
            ops.append(
                self._gemm(
                    f"draft.{l}.qkv", p + "self_attn.qkv_proj.weight", nq + 2 * nkv, h, B, A("da"), A("dqkv_raw")
                )
            )
            ops.append(self._rope_op(l, B, True, A("dqkv_raw"), nq + 2 * nkv, A("dq")))
            attn = f.use(drafter_attention(self.spec, f.arch, l, blocks), f"drafter attention layer {l}")
            ops += f.attention_ops(
                f"draft.{l}.",
                attn,
                B,
                A("dq"),
                f.ptr.DKV(l, "k"),
                f.ptr.DKV(l, "v"),
                A("dattn"),
                lanes=f.ptr.dlane_bytes(l),
            )
            ops.append(self._gemm(f"draft.{l}.o", p + "self_attn.o_proj.weight", h, nq, B, A("dattn"), A("do")))
            ops.append(
                Op(
                    f"draft.{l}.post_attn_norm",
                    add,
                    dict(x=A("dx"), y=A("do"), w=W(p + "post_attention_layernorm.weight"), a=A("da"), T=B),
                    B,
                )
            )
            ops.append(
                self._gemm(
                    f"draft.{l}.gate_up",
                    p + "mlp.gate_up_proj.weight",
                    2 * d.intermediate_size,
                    h,
                    B,
                    A("da"),
                    A("dmlp"),
                    epi="silu_mul",
                )
            )
            ops.append(
                self._gemm(f"draft.{l}.down", p + "mlp.down_proj.weight", h, d.intermediate_size, B, A("dmlp"), A("do"))
            )
            nxt = f"draft.layers.{l + 1}.input_layernorm.weight" if l + 1 < d.num_hidden_layers else "draft.norm.weight"
            ops.append(Op(f"draft.{l}.ffn_norm", add, dict(x=A("dx"), y=A("do"), w=W(nxt), a=A("da"), T=B), B))
        return ops
