"""Codegen stage: the vision tower's forward (B images of one patch grid) lowered onto the vision family's kernels:
the `vision_encode` step programs (one per B), as codegen/lower.py does the text model's.

The program's row count is an image's soft-token count N; its L = 9 N patches (the preprocessing keeps only real
patches, a row-major grid of whole 3x3 cells) make every launch's rows linear in N. The B images' patches go back to
back: the row kernels and GEMMs run B L rows, the attention and the pool each image's own (the same sums as the image
alone). In: vis_patches (u8 [B L, 768], the pixels), vis_pos (i32 [B L, 2]: x, y).
Out: vis_out (f32 [B N, text hidden]), each image's rows that replace its placeholder embeddings, back to back."""

from __future__ import annotations

from ..model_spec.step_program import Op
from ..model_spec.vision_layout import (
    LAYER_NORMS,
    PATCH_PROJ,
    POS_TABLE,
    PROJECTION,
    STD_BIAS,
    STD_SCALE,
    layer_prefix,
    vision_dims,
)
from .families import vision
from .lower import Lower
from .symbols import NULL

_INPUT, _POST_ATTN, _PRE_FF, _POST_FF = LAYER_NORMS


class LowerVision:
    """The tower's launches, lowered like the target's (through Lower.use)."""

    def __init__(self, fwd: Lower) -> None:
        self.fwd, self.d = fwd, vision_dims(fwd.spec)

    def _gemm(self, label: str, w: str, n: int, k: int, rows: int, x, y, epi: str = "store") -> Op:
        f = self.fwd
        kern = f.use(vision.gemm(n, k, epi, self.d, f.arch), f"vision GEMM n={n} k={k}")
        return Op(label, kern, dict(w=f.ptr.W(w), x=x, y=y, m=rows), rows)

    def encode_ops(self, tokens: int, images: int = 1) -> list[Op]:
        """`images` images of `tokens` soft tokens each (9 * tokens patches an image) -> vis_out rows
        0..images * tokens - 1, image b's from b * tokens."""
        f, d = self.fwd, self.d
        A, W, per = f.ptr.A, f.ptr.W, d.pool_rows * tokens
        L = images * per  # the rows of every row kernel and GEMM
        prep = f.use(vision.patch_prep(d, f.arch), "vision patch input")
        ops = [
            Op("vis.patch_prep", prep, dict(p=A("vis_patches"), out=A("vis_pin"), T=L), L),
            self._gemm("vis.patch_proj", PATCH_PROJ, d.hidden, d.patch_dim, L, A("vis_pin"), A("vis_x")),
        ]
        emb = f.use(vision.embed_norm(d, f.arch), "vision position tables + input norm")
        ops.append(
            Op(
                "vis.pos_embed",
                emb,
                dict(
                    x=A("vis_x"), table=W(POS_TABLE), pos=A("vis_pos"), w=W(layer_prefix(0) + _INPUT), a=A("vis_a"), T=L
                ),
                L,
            )
        )
        rope = f.use(vision.qkv_rope(d, f.arch), "vision q/k/v norm + 2-D RoPE")
        attn = f.use(vision.attention(d, f.arch), "vision attention")
        sand = f.use(vision.sandwich(d, f.arch), "vision sandwich norm")
        for l in range(d.layers):
            p, q = layer_prefix(l), f"vis.{l}."
            nxt = W(layer_prefix(l + 1) + _INPUT) if l + 1 < d.layers else NULL  # the last layer: no next norm
            ops += [
                self._gemm(q + "qkv", p + "qkv", 3 * d.hidden, d.hp, L, A("vis_a"), A("vis_qkv")),
                Op(
                    q + "qkv_rope",
                    rope,
                    dict(
                        qkv=A("vis_qkv"),
                        q_norm_w=W(p + "q_norm"),
                        k_norm_w=W(p + "k_norm"),
                        pos=A("vis_pos"),
                        q=A("vis_q"),
                        k=A("vis_k"),
                        v=A("vis_v"),
                        T=L,
                    ),
                    L,
                ),
                Op(
                    q + "attention",
                    attn,
                    dict(q=A("vis_q"), k=A("vis_k"), v=A("vis_v"), out=A("vis_attn"), T=per, B=images),
                    per,  # (its grid: an image's query tiles; each block takes them in every image)
                ),
                self._gemm(q + "o", p + "o", d.hidden, d.heads * d.dp, L, A("vis_attn"), A("vis_y")),
                Op(
                    q + "post_attn",
                    sand,
                    dict(
                        x=A("vis_x"), y=A("vis_y"), w_post=W(p + _POST_ATTN), w_next=W(p + _PRE_FF), a=A("vis_a"), T=L
                    ),
                    L,
                ),
                self._gemm(q + "gate_up", p + "gate_up", 2 * d.ip, d.hp, L, A("vis_a"), A("vis_act"), "gelu_mul"),
                self._gemm(q + "down", p + "down", d.hidden, d.ip, L, A("vis_act"), A("vis_y")),
                Op(
                    q + "post_ffn",
                    sand,
                    dict(x=A("vis_x"), y=A("vis_y"), w_post=W(p + _POST_FF), w_next=nxt, a=A("vis_a"), T=L),
                    L,
                ),
            ]
        tail = f.use(vision.pool(d, f.arch), "vision pool + standardize")
        ops += [
            Op(
                "vis.pool",
                tail,
                dict(
                    x=A("vis_x"),
                    pos=A("vis_pos"),
                    std_bias=W(STD_BIAS),
                    std_scale=W(STD_SCALE),
                    out=A("vis_pooled"),
                    T=images * tokens,
                    TI=tokens,
                ),
                images * tokens,
            ),
            self._gemm(
                "vis.projection", PROJECTION, d.text_hidden, d.hp, images * tokens, A("vis_pooled"), A("vis_out")
            ),
        ]
        return ops
