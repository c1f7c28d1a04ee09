"""Codegen stage: the model's forward lowered to launch lists over the planned kernels (step programs).

`Lower.ops(rows, ...)` returns the launches of one forward over `rows` tokens: for one row (decode) the fused q|k|v GEMV
with rope_kv folded in (each head's last block runs its warp), the split-K decode attention (its splits merged in the
same launch), the o_proj GEMV with the attention tail folded in, the router (logits + top-k in one launch), the M=1 MoE
pair; for more rows attention + a combine launch, o_proj + attn_tail and the router pair; for a prefill chunk the fused
q|k|v prefill GEMM (rope_kv reads its [T, q|k|v] rows in place), the prefill attention, and the grouped MoE kernels.
Each kernel comes from its family's function for the constants the launch needs (codegen/families/*.py; a target
linear's checkpoint format, `linear_format`, picks the NVFP4 or the fp16-weight form of its kernel), and the
plan (codegen/plan.py) is the set of kernels these forwards launch; arguments are symbols (codegen/symbols.py: `Sym`,
an activation row, a weight, a KV cache; `LaneBytes`), which the runtime binds to its buffers. The head's launches
(lm_head and its epilogues) are lowered by codegen/lower_head.py. codegen/programs.py evaluates this at a few
row counts per step shape and writes the launch lists into the manifest; the runtime (runtime/cuda/programs.py) only
binds and runs them. Lowered against a given kernel list, a kernel absent from it aborts that forward (`Missing`)
and is named in `missing`.
"""

from __future__ import annotations

from typing import Any

from ..model_spec.conventions import MAX_BATCH, VERIFY_ROWS
from ..model_spec.step_program import Op
from ..model_spec.types import ModelSpec
from ..model_spec.weight_layout import HALF_SUFFIX, PACKED_SUFFIX, SCALE_SUFFIX, TILE_SCALE_SUFFIX
from . import lower_head
from .arch import ArchSpec
from .families import embedding, moe, moe_grouped, norms, rope_kv, router
from .families.attention import attn_combine, target_attention
from .families.matmul import gemv_attn_tail, target_gemm, target_gemm_large
from .kernel_spec import KernelSpec, PlanError
from .symbols import NULL, Sym, Symbols


def small_mmax(rows: int) -> int:
    """The row capacity of the weight-streaming kernels (GEMMs and the MoE pair) that serve `rows` rows: the M = 1
    ones, the 16-row ones, else (a batched step) the MAX_BATCH-row ones."""
    return 1 if rows == 1 else VERIFY_ROWS if rows <= VERIFY_ROWS else MAX_BATCH


class Missing(Exception):
    """A launch's kernel is absent from the kernel list lowered against (recorded in Lower.missing); aborts lowering
    that forward."""


class Lower:
    """Lowers forwards of one model onto the kernels its families give for them (`launched`: every kernel used, in
    order of first use). With `available` (a kernel list), a kernel not in it is recorded in `missing`."""

    def __init__(
        self, spec: ModelSpec, arch: ArchSpec, kv_dtype: str, max_rows: int, available: list[KernelSpec] | None = None
    ) -> None:
        self.spec, self.arch, self.kv_dtype, self.max_rows = spec, arch, kv_dtype, max_rows
        self.available = None if available is None else {k.name: k for k in available}
        self.launched: dict[str, KernelSpec] = {}
        self.missing: list[str] = []
        self.ptr = Symbols()
        self.probing = False  # a missing kernel is still returned, so every other one is looked at and recorded
        self._taps = self._images = False

    # ---- kernels ----------------------------------------------------------------------------------------------------
    def use(self, kernel: KernelSpec, what: str) -> KernelSpec:
        """`kernel` (from its family) as a launch's kernel: recorded in `launched`; with a kernel list, Missing
        (recorded in `missing`) when the list lacks it, PlanError when the list holds another kernel of its name."""
        if self.available is not None:
            have = self.available.get(kernel.name)
            if have is None:
                self.missing.append(f"{what} ({kernel.name})")
                if not self.probing:
                    raise Missing()
            elif have != kernel:
                raise PlanError(f"{what}: the kernel list's {kernel.name} is not the one its family gives")
        if self.launched.setdefault(kernel.name, kernel) != kernel:
            raise PlanError(f"{what}: two different kernels share the name {kernel.name}")
        return kernel

    def gemm(
        self, n: int, k: int, rows: int, epi: str = "store", batched: bool = False, fmt: str = "nvfp4"
    ) -> KernelSpec:
        """The GEMV (1 row), the 16-row GEMM, for a batched step of more rows the MAX_BATCH-row one (each weight byte
        read once for all rows), else the prefill GEMM; of the weight kind of checkpoint format `fmt`."""
        if rows > VERIFY_ROWS and not batched:
            return self.use(target_gemm_large(n, k, epi, self.arch, fmt), f"prefill GEMM n={n} k={k} {fmt}")
        mmax = small_mmax(rows)
        return self.use(target_gemm(n, k, mmax, epi, self.arch, fmt), f"GEMM n={n} k={k} m<={mmax} {fmt}")

    def linear_format(self, base: str) -> str:
        """The checkpoint format of stored matrix `base` (ModelSpec.linear_formats by role; the lm_head is the tied
        embedding quantized to NVFP4 at repack)."""
        f, role = self.spec.linear_formats, base.split(".")[2] if base.startswith("layers.") else ""
        return {"self_attn": f.attention, "mlp": f.dense_mlp, "experts": f.experts}.get(role, "nvfp4")

    # ---- the forward ------------------------------------------------------------------------------------------------
    def ops(
        self,
        rows: int,
        decode: bool = False,
        last: bool = True,
        greedy: bool = True,
        taps: bool = False,
        all_logits: bool = False,
        batched: bool = False,
        ext: bool = False,
        score: bool = False,
        images: bool = False,
    ) -> list[Op]:
        """Launches of one forward over `rows` tokens at positions[0..rows) of the sequence in KV lane lanes[0]
        (lanes[t] = that lane for every row t): token ids from `ids` (or, `decode`, from the previous step's
        out_ids[0]); with `last`, the next token of the last row lands in out_ids[0].
        `taps`: the DFlash tap layers also write their residual output (f16) into `taps` [rows, n_taps*H].
        `all_logits` (a verify block, rows <= VERIFY_ROWS): every row's next token lands in out_ids[row], drawn at
        sampled position positions[max_rows + row].
        `batched` (rows <= MAX_BATCH): row t is the next token ids[t] of its own sequence, at positions[t] in lane
        lanes[t]; its next token lands in out_ids[t] (sampled at positions[max_rows + t] with params[t]).
        `ext`: the head processes the logits and writes logprobs (head_ops).
        `score` (with `batched`; prompt logprobs): the rows are consecutive positions of one sequence in one lane
        (rowwise attention is causal: every row's K/V is written before any row attends), and the head writes
        each row's top-20 logprobs and the logprob of out_ids[row] (the next prompt token, staged by the caller)
        instead of picking a token.
        `images` (a prefill chunk holding image spans; not decode, batched or score): the sliding layers run the
        chunk attention kernel at any row count, with per-query upper key bounds kv_hi (i32 [rows]: an image's
        queries see its whole span); the runtime copies the image rows into x after the embed launch."""
        if batched and rows > MAX_BATCH:
            raise ValueError(f"a batched decode step of {rows} rows: at most {MAX_BATCH}")
        if images and (decode or batched or score or all_logits):
            raise ValueError("image spans run in prefill chunks only")
        self._images = images
        t, A, W = self.spec.target, self.ptr.A, self.ptr.W
        H, ops = t.hidden_size, []
        self._taps = taps
        emb = self.use(embedding.target_embed(self.spec, self.arch), "embedding")
        ops.append(
            Op(
                "embed",
                emb,
                dict(ids=A("out_ids") if decode else A("ids"), table=W("embed_tokens.weight"), out=A("x"), T=rows),
                rows,
            )
        )
        norm = self.use(norms.rmsnorm_kernel(H, t.rms_norm_eps, self.arch, inp="f32"), "rmsnorm f32->f16")
        ops.append(
            Op("input_norm", norm, dict(x=A("x"), w=W("layers.0.input_layernorm.weight"), y=A("a"), T=rows), rows)
        )
        for l in range(t.num_hidden_layers):
            ops += self._layer_ops(l, rows, batched, small=batched and not score)
        if last:
            if batched and not (score or ext):  # one lm_head pass over every row, then the picks per VERIFY_ROWS rows
                ops.append(self.gemm_op("lm_head", "lm_head", t.vocab_size, H, rows, A("a"), A("logits"), batched=True))
                for r0 in range(0, rows, VERIFY_ROWS):
                    ops += lower_head.pick_ops(
                        self, min(VERIFY_ROWS, rows - r0), A("logits", r0), A("out_ids", r0), greedy, r0
                    )
                return ops
            if batched:  # processed heads and scoring passes: lm_head and epilogues VERIFY_ROWS rows at a time
                for r0 in range(0, rows, VERIFY_ROWS):
                    n = min(VERIFY_ROWS, rows - r0)
                    if score:
                        ops += [self.gemm_op("lm_head", "lm_head", t.vocab_size, H, n, A("a", r0), A("logits"))]
                        ops += lower_head.logprobs_ops(self, n, A("out_ids", r0), r0)
                    else:
                        ops += self.head_ops(A("a", r0), n, A("out_ids", r0), greedy, r0, ext)
                return ops
            n = rows if all_logits else 1
            if n > VERIFY_ROWS:
                raise ValueError(f"all_logits over {rows} rows: the lm_head epilogues handle {VERIFY_ROWS}")
            ops += self.head_ops(A("a") if all_logits else A("a", rows - 1), n, A("out_ids"), greedy, ext=ext)
        return ops

    def head_ops(self, x: Sym, n: int, out_ids: Sym, greedy: bool = True, r0: int = 0, ext: bool = False) -> list[Op]:
        """lm_head over n rows of x, then argmax or the sampler (or, `ext`, the processed head with logprobs) into
        out_ids[0..n): codegen/lower_head.py's head_ops."""
        return lower_head.head_ops(self, x, n, out_ids, greedy, r0, ext)

    def gemm_op(
        self,
        label: str,
        base: str,
        n: int,
        k: int,
        rows: int,
        x: Sym,
        y: Sym,
        epi: str = "store",
        batched: bool = False,
    ) -> Op:
        """y[rows, n] = x[rows, k] . W^T for stored matrix `base` (the kernel by rows: Lower.gemm)."""
        return Op(
            label,
            self.gemm(n, k, rows, epi, batched, self.linear_format(base)),
            self._gemm_args(base, rows, x, y),
            rows,
        )

    def _weight_args(self, base: str) -> dict[str, Any]:
        """The weight arguments of stored matrix `base`: NVFP4 (w, s, gscale: codes, e4m3 block scales, f32 tile
        factors) or, stored bf16, the fp16 weights in the half layout (w: `base`.weight_half)."""
        W = self.ptr.W
        if self.linear_format(base) == "bf16":
            return dict(w=W(base + HALF_SUFFIX))
        return dict(w=W(base + PACKED_SUFFIX), s=W(base + SCALE_SUFFIX), gscale=W(base + TILE_SCALE_SUFFIX))

    def _gemm_args(self, base: str, rows: int, x: Sym, y: Sym) -> dict[str, Any]:
        return dict(self._weight_args(base), x=x, y=y, m=rows)

    def _layer_ops(self, l: int, rows: int, batched: bool = False, small: bool = False) -> list[Op]:
        """Layer l over `rows` tokens; `batched`: one per sequence (rowwise attention over their lanes); `small`:
        the weight-streaming kernels up to MAX_BATCH rows (a batched decode step; a scoring pass runs the prefill
        kernels, as the prompt's prefill does)."""
        t, A, W = self.spec.target, self.ptr.A, self.ptr.W
        p, H = f"layers.{l}.", t.hidden_size
        hd, hkv, hq = t.layer_head_dim(l), t.layer_kv_heads(l), t.num_attention_heads
        nq, nk, has_v = hq * hd, hkv * hd, t.layer_has_v_proj(l)
        qkv, kind, ops = f"{p}self_attn.qkv_proj", "f" if t.is_full(l) else "s", []
        n_qkv = nq + nk * (2 if has_v else 1)
        # full layers: paged, each row's lane a row of the page table kv_pages
        pages = NULL if t.layer_window(l) else A("kv_pages")
        prologue = dict(
            q_norm_w=W(f"{p}self_attn.q_norm.weight"),
            k_norm_w=W(f"{p}self_attn.k_norm.weight"),
            positions=A("positions"),
            q_out=A("q"),
            k_cache=self.ptr.KV(l, "k"),
            v_cache=self.ptr.KV(l, "v"),
            lanes=A("lanes"),
            lane_bytes=self.ptr.lane_bytes(l),
            pages=pages,
        )
        if rows == 1:  # one launch: the GEMV whose last block of each head runs rope_kv's warp for it (same bits)
            fold = self.use(
                rope_kv.target_gemv_rope_kv(self.spec, self.arch, l, self.kv_dtype),
                f"q|k|v GEMV + rope_kv layer kind {kind}",
            )
            ops.append(
                Op(
                    f"{p}qkv_rope",
                    fold,
                    dict(self._gemm_args(qkv, rows, A("a"), A("qkv")), **prologue, counters=A("qkv_cnt")),
                    rows,
                )
            )
        else:
            ops.append(self.gemm_op(f"{p}qkv", qkv, n_qkv, H, rows, A("a"), A("qkv"), batched=small))
            base = A("qkv")  # rope_kv reads each [rows, q|k|v] row in place (strides = the row width)
            rope = self.use(
                rope_kv.target_rope_kv(self.spec, self.arch, l, self.kv_dtype), f"rope_kv layer kind {kind}"
            )
            ops.append(
                Op(
                    f"{p}rope_kv",
                    rope,
                    dict(
                        q_raw=base,
                        k_raw=base + 4 * nq,
                        v_raw=base + 4 * (nq + nk) if has_v else NULL,
                        **prologue,
                        q_stride=n_qkv,
                        kv_stride=n_qkv,
                        T=rows,
                    ),
                    rows,
                )
            )
        small = rows <= 16 or batched  # a batched step runs the split decode kernel on 16-row slices
        if self._images and t.layer_window(l):
            attn = self.use(
                target_attention(self.spec, self.arch, l, self.kv_dtype, prefill=True, kv_hi=True),
                f"attention layer kind {kind} with image key bounds",
            )
            ops += self.attention_ops(
                f"{p}",
                attn,
                rows,
                A("q"),
                self.ptr.KV(l, "k"),
                self.ptr.KV(l, "v"),
                A("attn"),
                lanes=self.ptr.lane_bytes(l),
                pages=pages,
            )
            ops[-1].args["kv_hi"] = A("kv_hi")
        else:
            attn = self.use(
                target_attention(self.spec, self.arch, l, self.kv_dtype, prefill=not small),
                f"attention layer kind {kind} m<={VERIFY_ROWS if small else 'prefill'}",
            )
            ops += self.attention_ops(
                f"{p}",
                attn,
                rows,
                A("q"),
                self.ptr.KV(l, "k"),
                self.ptr.KV(l, "v"),
                A("attn"),
                lanes=self.ptr.lane_bytes(l),
                rowwise=batched,
                pages=pages,
            )
        ops += self._o_proj_tail_ops(l, rows, nq, small)
        # The dense MLP (reads a1, writes mlp) is independent of the router + MoE (a2 -> moe) until ffn_tail:
        # branch 1 lets it run on a side stream beside them.
        mlp = [
            self.gemm_op(
                f"{p}mlp_gate_up",
                f"{p}mlp.gate_up_proj",
                2 * t.intermediate_size,
                H,
                rows,
                A("a1"),
                A("mlp_act"),
                epi="gelu_mul",
                batched=small,
            ),
            self.gemm_op(
                f"{p}mlp_down", f"{p}mlp.down_proj", H, t.intermediate_size, rows, A("mlp_act"), A("mlp"), batched=small
            ),
        ]
        for op in mlp:
            op.branch = 1
        ops += mlp  # first, so the side stream starts before the router
        ops += self._router_ops(l, rows, small)
        ops += self._moe_ops(l, rows, small)
        nxt = f"layers.{l + 1}.input_layernorm.weight" if l + 1 < t.num_hidden_layers else "norm.weight"
        # more than one row: the MoE wrote a row per slot, which this ffn_tail sums itself (no combine launch)
        pairs = t.top_k_experts if rows > 1 else 0
        ft = self.use(
            norms.ffn_tail_kernel(H, t.rms_norm_eps, self.arch, pairs, t.num_experts if pairs else 0),
            "ffn_tail" + (" (summing the MoE's slot rows)" if pairs else ""),
        )
        moe_in = dict(moe=A("moe_pair_out"), ids=A("topk_idx")) if pairs else dict(moe=A("moe"), ids=NULL)
        ops.append(
            Op(
                f"{p}ffn_tail",
                ft,
                dict(
                    mlp=A("mlp"),
                    **moe_in,
                    x=A("x"),
                    w1=W(f"{p}post_feedforward_layernorm_1.weight"),
                    w2=W(f"{p}post_feedforward_layernorm_2.weight"),
                    w=W(f"{p}post_feedforward_layernorm.weight"),
                    layer_scalar=W(f"{p}layer_scalar"),
                    w_next=W(nxt),
                    a=A("a"),
                    **self._tap_args(l),
                    T=rows,
                ),
                rows,
                join=True,
            )
        )
        return ops

    def _o_proj_tail_ops(self, l: int, rows: int, nq: int, small: bool) -> list[Op]:
        """o_proj, then Gemma's attention tail (x += norm(o) * w_post; a1, a2 = norm(x) * w_pre1, w_pre2). One row:
        one launch, the GEMV whose last block runs the tail (counters zeroed once, left zeroed; bit-identical to
        the pair: a kernel boundary less on the decode critical path); more rows: the GEMM and attn_tail."""
        t, A, W, p = self.spec.target, self.ptr.A, self.ptr.W, f"layers.{l}."
        H, base = t.hidden_size, f"{p}self_attn.o_proj"
        tail_args = dict(
            w_post=W(f"{p}post_attention_layernorm.weight"),
            w_pre1=W(f"{p}pre_feedforward_layernorm.weight"),
            w_pre2=W(f"{p}pre_feedforward_layernorm_2.weight"),
            a1=A("a1"),
            a2=A("a2"),
        )
        if rows == 1:
            fold = self.use(
                gemv_attn_tail(H, nq, t.rms_norm_eps, self.arch, self.linear_format(base)),
                f"o_proj GEMV + attn_tail n={H} k={nq}",
            )
            args = dict(
                self._gemm_args(base, rows, A("attn"), A("o")), resid=A("x"), counters=A("tail_cnt"), **tail_args
            )
            return [Op(f"{p}o_proj_tail", fold, args, rows)]
        tail = self.use(norms.attn_tail_kernel(H, t.rms_norm_eps, self.arch), "attn_tail")
        return [
            self.gemm_op(f"{p}o_proj", base, H, nq, rows, A("attn"), A("o"), batched=small),
            Op(f"{p}attn_tail", tail, dict(o=A("o"), x=A("x"), **tail_args, T=rows), rows),
        ]

    def attention_ops(
        self,
        label: str,
        attn: KernelSpec,
        rows: int,
        q: Sym,
        kc: Sym,
        vc: Sym,
        out: Sym,
        lanes: int | None = None,
        rowwise: bool = False,
        pages: Sym = NULL,
    ) -> list[Op]:
        """The attention kernel over `rows` queries, and for split-K kernels the merge of their splits: in the same
        launch for one row (decode: the last split block merges; counters zeroed once, left zeroed), by an
        attn_combine launch for more (measured on the H200: for 16 queries one merging block per group is slower
        than a combine launch with one block per row). `lanes`: the caches hold a lane per sequence, this many
        bytes apart (lanes[] in device memory picks them); None: one lane. A batched step (rowwise: one query per
        sequence; needs `lanes`) runs on slices of the kernel's mmax rows, each block merging its own splits.
        `pages`: a paged cache's page table (a lane is then its row), else NULL."""
        if rowwise and lanes is None:
            raise ValueError(f"{label}attention: a rowwise (batched) launch reads each row's KV lane: give `lanes`")
        A, ns = self.ptr.A, int(attn.param("nsplit", 1))
        lane_args = (
            dict(lanes=NULL, lane_bytes=0, pages=pages, rowwise=0)
            if lanes is None
            else dict(lanes=A("lanes"), lane_bytes=lanes, pages=pages, rowwise=int(rowwise))
        )
        if rowwise:
            mmax, bpr = int(attn.param("mmax")), 2 * int(attn.param("hq")) * int(attn.param("d"))
            return [
                Op(
                    f"{label}attention",
                    attn,
                    dict(
                        q=q + r0 * bpr,
                        kc=kc,
                        vc=vc,
                        positions=A("positions", r0),
                        m=min(mmax, rows - r0),
                        out=out + r0 * bpr,
                        ws=A("attn_ws"),
                        counters=A("attn_cnt") if ns > 1 else NULL,
                        **dict(lane_args, lanes=A("lanes", r0)),
                    ),
                    min(mmax, rows - r0),
                    rowwise=True,
                )
                for r0 in range(0, rows, mmax)
            ]
        fused = rows == 1 and ns > 1
        ops = [
            Op(
                f"{label}attention",
                attn,
                dict(
                    q=q,
                    kc=kc,
                    vc=vc,
                    positions=A("positions"),
                    m=rows,
                    out=out,
                    ws=A("attn_ws"),
                    counters=A("attn_cnt") if fused else NULL,
                    **lane_args,
                ),
                rows,
            )
        ]
        if ns > 1 and not fused:
            comb = self.use(attn_combine(attn), "attention combine")
            ops.append(Op(f"{label}attn_combine", comb, dict(ws=A("attn_ws"), m=rows, out=out), rows))
        return ops

    def _router_ops(self, l: int, rows: int, batched: bool = False) -> list[Op]:
        """Router logits + top-k: one launch for one row (decode: each token's last block picks its top-k; counters
        zeroed once, left zeroed; bit-identical to the pair), the pair for more (measured faster at 16 rows). A
        batched step of up to MAX_BATCH rows keeps the 16-row blocking (its blocks loop over the rows); a prefill
        chunk's logits use the tiled GEMM form."""
        A, W, p = self.ptr.A, self.ptr.W, f"layers.{l}."
        common = dict(
            x=A("x"),
            scale=W(f"{p}router.scale"),
            proj=W(f"{p}router.proj.weight"),
            per_expert_scale=W(f"{p}router.per_expert_scale"),
            logits=A("rlogits"),
            topk_idx=A("topk_idx"),
            topk_w=A("topk_w"),
            T=rows,
        )
        if rows == 1:
            rt = self.use(router.router_fused(self.spec, self.arch), "router (logits + top-k)")
            return [Op(f"{p}router", rt, dict(common, counters=A("router_cnt")), rows)]
        if rows > VERIFY_ROWS and not batched:  # a prefill chunk: the tiled form (ceil(rows / BT) token tiles)
            rl = self.use(router.router_logits_tiled(self.spec, self.arch), "router logits (tiled)")
        else:
            rl = self.use(router.router_logits(self.spec, self.arch), f"router logits m<={VERIFY_ROWS}")
        tk = self.use(router.router_topk(self.spec, self.arch), "router top-k")
        return [
            Op(f"{p}router", rl, {a: common[a] for a in rl.args}, rows),
            Op(f"{p}topk", tk, {a: common[a] for a in tk.args}, rows),
        ]

    def _tap_args(self, l: int) -> dict[str, Any]:
        """ffn_tail's tap arguments: layer l's residual output into its column block of `taps` (f16 elements)."""
        d = self.spec.drafter
        if not self._taps or d is None or l not in d.target_layer_ids:
            return dict(tap=NULL, tap_stride=0, tap_col=0)
        H = self.spec.target.hidden_size
        return dict(
            tap=self.ptr.A("taps"),
            tap_stride=len(d.target_layer_ids) * H,
            tap_col=list(d.target_layer_ids).index(l) * H,
        )

    def _moe_ops(self, l: int, rows: int, batched: bool = False) -> list[Op]:
        """The MoE of layer l: for one row the M=1 gate/up + down -> moe [1, H]; up to 16 rows the M=16 gate/up
        and the down into a row per slot, a batched step of more the M=MAX_BATCH pair; else the grouped kernels: plan
        (pairs grouped by expert, tile list), gate/up and down over the tiles (each expert's weights read once per
        chunk). Both of those write moe_pair_out [rows * K, H], which ffn_tail sums per row."""
        A, m = self.ptr.A, f"layers.{l}.experts."
        if rows > VERIFY_ROWS and not batched:
            plan, gu, dn = (
                self.use(k, f"grouped MoE {what}")
                for k, what in zip(moe_grouped.plan_moe_grouped(self.spec, self.arch), ("plan", "gate/up", "down"))
            )
            routing = dict(pairs=A("moe_pairs"), tiles=A("moe_tiles"))
            return [
                Op(
                    f"layers.{l}.moe_plan",
                    plan,
                    dict(ids=A("topk_idx"), offsets=A("moe_offsets"), T=rows, **routing),
                    rows,
                ),
                Op(
                    f"layers.{l}.moe_grouped_gateup",
                    gu,
                    dict(self._weight_args(m + "gate_up_proj"), x=A("a2"), act=A("moe_act_sorted"), **routing),
                    rows,
                ),
                Op(
                    f"layers.{l}.moe_grouped_down",
                    dn,
                    dict(
                        self._weight_args(m + "down_proj"),
                        act=A("moe_act_sorted"),
                        wts=A("topk_w"),
                        ypair=A("moe_pair_out"),
                        **routing,
                    ),
                    rows,
                ),
            ]
        mmax = small_mmax(rows)
        gateup, down = moe.moe_kernels(self.spec, self.arch, mmax)
        up, down = self.use(gateup, f"MoE gate/up m<={mmax}"), self.use(down, f"MoE down m<={mmax}")
        pairs = mmax > 1  # the down per (unit, expert) into slot rows, which ffn_tail sums per token
        dw = dict(self._weight_args(m + "down_proj"), act=A("moe_act"))
        out = dict(ypair=A("moe_pair_out")) if pairs else dict(y=A("moe"))
        return [
            Op(
                f"layers.{l}.moe_gateup",
                up,
                dict(self._weight_args(m + "gate_up_proj"), x=A("a2"), ids=A("topk_idx"), act=A("moe_act"), m=rows),
                rows,
            ),
            Op(f"layers.{l}.moe_down", down, dict(dw, ids=A("topk_idx"), wts=A("topk_w"), m=rows, **out), rows),
        ]
