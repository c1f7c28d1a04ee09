"""Test support (not a test module): NumPy stand-ins for every kernel template, used by the fake CUDA driver of
tests/fake_driver.py. Each reads its arguments from the fake device memory and writes its outputs there, as
float64 references that round where the kernel stores (through float32: `RK.store`), so the emulated engine agrees
with the reference backend's numerics="w4a16" mode token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

import reference_kernels as RK
from thorgen.codegen.families import moe_grouped as MG
from thorgen.model_spec.nvfp4 import bf16_to_f32, dequantize_nvfp4
from thorgen.runtime.convert import layouts as L
from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference import engine_attention as EA
from thorgen.runtime.reference.sampling import sample
from emulated_logits import LogitsKernels  # (tests/ is on sys.path: fake_driver imports this module)
from emulated_vision import VisionKernels

import matmul_reference as MR

if TYPE_CHECKING:
    from fake_driver import FakeDriver

F64 = np.float64


class EmuError(AssertionError):
    """A launch or copy the emulated GPU rejects (out-of-bounds access, null pointer, bad argument)."""


# ---- the kernels ------------------------------------------------------------------------------------------------


def _gelu(x):
    return MR.gelu_tanh(x)


class KernelEmulator(LogitsKernels, VisionKernels):
    """NumPy stand-ins for each kernel template, reading and writing the fake driver's memory."""

    def __init__(self, drv: FakeDriver) -> None:
        self.d = drv
        self.overrides: dict[tuple, np.ndarray] = {}  # (w, s, gscale, n, k) -> float64 weight to use instead
        self.after = None  # optional callback(name, manifest entry, args) after every kernel (debugging)
        self.taps: list[np.ndarray] = []  # the residual stream after every ffn_tail (per layer), for bisecting
        self._dense: dict[tuple, np.ndarray] = {}
        # the MoE down kernels' float64 slot rows by device address, until the ffn_tail that sums them takes them
        self._pair_rows: dict[int, np.ndarray] = {}

    def v(self, addr, dtype, shape, what=""):
        return self.d.view(addr, dtype, shape, what)

    def nvfp4(self, w, s, g, n, k, order, what):
        """Dequantized float64 [n, k] of a t16x64 weight at (w, s, gscale); cached by address."""
        key = (w, s, g, n, k)
        if key in self.overrides:
            return self.overrides[key]
        if key not in self._dense:
            packed, scale = L.unpack_nvfp4(
                self.v(w, np.uint8, n * k // 2, what), self.v(s, np.uint8, n * k // 16, what), n, k, order
            )
            inv = np.repeat(self.v(g, np.float32, n // 8, what).astype(F64), 8)
            self._dense[key] = dequantize_nvfp4(packed, scale, 1.0).astype(F64) * inv[:, None]
        return self._dense[key]

    @staticmethod
    def check_grid(e: dict, a: dict, grid) -> None:
        """The launch grid covers the rows (the kernels' own coverage rules; grid-stride row kernels need >= 1)."""
        t, p, g = e["template"], e["params"], grid
        rows = a.get("T", a.get("m", 1))
        need = []
        if t.startswith("attn_fwd"):
            qb = 1 if a.get("rowwise") else 16 * p["mt"] // (p["hq"] // p["hkv"])  # queries per block
            # rowwise (batched) launches may run fewer splits (the planner's ROWWISE_SPLITS); the others all
            need = [(0, -(-rows // qb)), (1, p["hkv"]), (2, 1 if a.get("rowwise") else p["nsplit"])]
            if a.get("rowwise") and p.get("ROWWISE_SPLITS") and g[2] != p["ROWWISE_SPLITS"][rows - 1]:
                raise EmuError(
                    f"a rowwise launch of {rows} rows with {g[2]} key splits; the plan says "
                    f"{p['ROWWISE_SPLITS'][rows - 1]}"
                )
        elif t.startswith("attn_combine"):
            need = [(0, rows * p["hq"])]
        elif t.startswith("moe_gateup"):
            need = [(0, 2 * p["ie"] // 16 // p.get("un", 1)), (1, min(p["experts"], rows * p["topk"]))]
        elif t.startswith("moe_down_pairs"):
            need = [(0, p["h"] // 16 // p.get("un", 1)), (1, min(p["experts"], rows * p["topk"]))]
        elif t.startswith("moe_down"):
            need = [(0, p["h"] // 16)]
        elif t.startswith("moe_grouped_gateup") or t.startswith("moe_grouped_down"):  # tiles: checked by the kernel
            need = [(0, (2 * p["ie"] if "gateup" in t else p["h"]) // (16 * p["nwarp"] * p["upw"]))]
        elif t.startswith("router_logits_tiled"):
            need = [(0, p["E"] // p["BE"]), (1, -(-rows // p["BT"]))]
        elif "bm" in p:
            cols = p["bn"] if p.get("wgmma") else 16 * p["nwarp"]  # weight rows a block (gemm_large_wgmma: bn)
            need = [(0, p["n"] // cols), (1, -(-rows // p["bm"]))]
        elif t.startswith("nvfp4_gemm"):
            need = [(0, p["n"] // 16 // p.get("un", 1))]
        elif "ROW_AXIS" in p:
            need = [(int(p["ROW_AXIS"]), 1)]
        if "IMAGE_AXIS" in p:  # a block index per image (vis_attn)
            need.append((int(p["IMAGE_AXIS"]), int(a["B"])))
        for axis, n in need:
            if g[axis] < n:
                raise EmuError(f"grid {tuple(g)} has {g[axis]} blocks on axis {axis}, the rows need {n}")

    def run(self, name: str, e: dict, a: dict, grid) -> None:
        t, p = e["template"], e["params"]
        fn = getattr(self, "k_" + t.split(".")[0])
        self.grid = tuple(grid)
        try:
            self.check_grid(e, a, grid)
            fn(p, a, name)
        except EmuError as exc:
            raise EmuError(f"{name}: {exc}") from None
        if self.after is not None:
            self.after(name, e, a)

    def k_embed(self, p, a, n):
        T, H, V = a["T"], p["H"], p["V"]
        ids = self.v(a["ids"], np.int32, T, "ids")
        if ((ids < 0) | (ids >= V)).any():
            raise EmuError(f"token ids {ids} out of range")
        table = self.v(a["table"], np.uint16, (V, H), "table")
        self.v(a["out"], np.float32, (T, H), "out")[:] = RK.embed_ref(
            ids, table, p["SCALE"], p["MASK_ID"], p.get("BLOCK", 1)
        )

    def k_spec_accept(self, p, a, n):
        B = p["B"]
        ids, out = self.v(a["ids"], np.int32, B, "ids"), self.v(a["out_ids"], np.int32, B, "out_ids")
        pos, rule = self.v(a["positions"], np.int32, B, "positions"), self.v(a["rule"], np.int32, 2, "rule")
        acc, pos[:], self.v(a["sampled"], np.int32, B, "sampled")[:], ids[0] = RK.spec_accept_ref(
            ids, out, int(pos[0]), int(rule[0]), int(rule[1])
        )
        self.v(a["accepted"], np.int32, 1, "accepted")[0] = acc

    def k_rmsnorm(self, p, a, n):
        T, H = a["T"], p["H"]
        x = RK.load(self.v(a["x"], RK.np_dtype(p["IN"]), (T, H), "x"), p["IN"])
        y = RK.rmsnorm_ref(x, self.v(a["w"], np.uint16, H, "w"), p["EPS"])
        self.v(a["y"], RK.np_dtype(p["OUT"]), (T, H), "y")[:] = RK.store(y, p["OUT"])

    def half(self, w, n, k, what):
        """float64 [n, k] of an fp16 weight in the half layout (layouts.pack_half) at w; cached by address."""
        key = ("half", w, n, k)
        if key in self.overrides:
            return self.overrides[key]
        if key not in self._dense:
            bits = self.v(w, np.uint16, n * k, what)
            self._dense[key] = L.unpack_half(bits, n, k).view(np.float16).astype(F64)
        return self._dense[key]

    def weight(self, p, a, n, k, what="weight"):
        """The launch's [n, k] weight by the kernel's weight kind: NVFP4 (w, s, gscale) or fp16 (w)."""
        if p["kind"] == "half":
            return self.half(a["w"], n, k, what)
        return self.nvfp4(a["w"], a["s"], a["gscale"], n, k, p["fp4_order"], what)

    def _gemm(self, p, a, n):
        """Every GEMM form (NVFP4 or fp16 weights): store f32 (and the folded attn_tail / rope_kv of one row), or
        act(gate) * up in f16 over 8-row-interleaved gate/up weights (gelu for the target and the vision tower, silu
        for the drafter)."""
        m, N, K = a["m"], p["n"], p["k"]
        W = self.weight(p, a, N, K)
        x = self.v(a["x"], np.float16, (m, K), "x").astype(F64)
        if p["epi"] in ("store", "attn_tail", "rope_kv"):
            self.v(a["y"], np.float32, (m, N), "y")[:] = x @ W.T
            if p["epi"] != "store" and m != 1:
                raise EmuError(f"the folded {p['epi']} serves one row, not {m}")
            if p["epi"] == "attn_tail":  # the last block's attn_tail on the row (bit-identical on the GPU)
                self._counters_zero(a, 1, "o_proj tail")
                self.k_attn_tail(dict(H=N, EPS=p["eps"]), dict(a, o=a["y"], x=a["resid"], T=1), n)
            if p["epi"] == "rope_kv":  # each head's last block runs rope_kv's warp for it (bit-identical)
                nq, nk = p["HQ"] * p["D"], p["HKV"] * p["D"]
                self._counters_zero(a, N // p["D"], "q|k|v heads")
                self.k_rope_kv(
                    p,
                    dict(
                        a,
                        q_raw=a["y"],
                        k_raw=a["y"] + 4 * nq,
                        v_raw=0 if p["V_FROM_K"] else a["y"] + 4 * (nq + nk),
                        q_stride=N,
                        kv_stride=N,
                        T=1,
                    ),
                    n,
                )
        elif p["epi"] == "gelu_mul":
            g, u = L.deinterleave8(W)
            self.v(a["y"], np.float16, (m, N // 2), "y")[:] = RK.store(_gelu(x @ g.T) * (x @ u.T), "f16")
        else:
            g, u = L.deinterleave8(W)
            gx = x @ g.T
            self.v(a["y"], np.float16, (m, N // 2), "y")[:] = RK.store(gx / (1.0 + np.exp(-gx)) * (x @ u.T), "f16")

    k_nvfp4_gemm = _gemm
    k_nvfp4_gemm_large = _gemm

    def k_add_rmsnorm(self, p, a, n):
        T, H = a["T"], p["H"]
        x = self.v(a["x"], np.float32, (T, H), "x")
        s, y = RK.add_rmsnorm_ref(
            x, self.v(a["y"], np.float32, (T, H), "y"), self.v(a["w"], np.uint16, H, "w"), p["EPS"]
        )
        x[:] = s
        self.v(a["a"], RK.np_dtype(p["OUT"]), (T, H), "a")[:] = RK.store(y, p["OUT"])

    def k_rope_kv(self, p, a, n):
        T, HQ, HKV, D = a["T"], p["HQ"], p["HKV"], p["D"]
        pos = self.v(a["positions"], np.int32, T, "positions").copy()

        def rows(name, width, stride):  # token t's inputs: `width` floats at t * stride (q|k|v rows read in place)
            return np.stack([self.v(a[name] + 4 * t * stride, np.float32, width, name) for t in range(T)])

        q_raw = rows("q_raw", HQ * D, a["q_stride"]) if p["HAS_Q"] else None
        k_raw = rows("k_raw", HKV * D, a["kv_stride"])
        v_raw = None if p["V_FROM_K"] else rows("v_raw", HKV * D, a["kv_stride"])
        q, k, v = RK.rope_kv_ref(
            q_raw,
            k_raw,
            v_raw,
            self.v(a["q_norm_w"], np.uint16, D),
            self.v(a["k_norm_w"], np.uint16, D),
            pos,
            HQ=HQ,
            HKV=HKV,
            D=D,
            rot=p["ROT"],
            theta=p["THETA"],
            has_q=p["HAS_Q"],
            v_from_k=p["V_FROM_K"],
            v_norm=p["V_NORM"],
            eps=p["EPS"],
        )
        if q is not None:
            self.v(a["q_out"], RK.np_dtype(p["Q"]), (T, HQ, D), "q_out")[:] = RK.store(q, p["Q"])
        kvdt, eb = RK.np_dtype(p["KV"]), np.dtype(RK.np_dtype(p["KV"])).itemsize
        lanes = self.v(a["lanes"], np.int32, T, "lanes").copy() if a["lanes"] else np.zeros(T, np.int64)
        for t, slot in enumerate(RK.cache_slots(pos, p["SLOTS"])):
            if p["PAGE"]:  # paged: the lane's page-table row maps the position (lane_bytes unused)
                slot = self._page_slots(a, p["PAGE"], p["PITCH"], int(lanes[t]), np.array([pos[t]]))[0]
                row = int(slot) * HKV * D * eb
            else:
                row = int(lanes[t]) * a["lane_bytes"] + int(slot) * HKV * D * eb
            self.v(a["k_cache"] + row, kvdt, (HKV, D), "k_cache")[:] = RK.store(k[t], p["KV"])
            self.v(a["v_cache"] + row, kvdt, (HKV, D), "v_cache")[:] = RK.store(v[t], p["KV"])

    def k_attn_fwd(self, p, a, n):
        m, d, hq = a["m"], p["d"], p["hq"]
        if not 1 <= m <= p["mmax"]:
            raise EmuError(f"m={m} outside 1..{p['mmax']}")
        shape, kv = EA.AttnShape.of(p), "fp8" if p["kv_dtype"] == "fp8e4m3" else "bf16"
        ns, win = p["nsplit"], p["window"]
        q = bf16_to_f32(self.v(a["q"], np.uint16, (m, hq, d), "q")).astype(F64)
        if a["rowwise"]:  # a batched step: query i is its own sequence's, at positions[i] in lane lanes[i]
            if not (a["lanes"] and p["causal"]):
                raise EmuError("rowwise attention needs lanes and a causal mask")
            pos = self.v(a["positions"], np.int32, m, "positions").copy()
            lanes = self.v(a["lanes"], np.int32, m, "lanes").copy()
            kvs = [self._load_kv(p, a, int(pos[i]), 1, int(lanes[i])) for i in range(m)]
            if ns == 1:
                self.v(a["out"], np.float16, (m, hq, d), "out")[:] = np.concatenate(
                    [EA.attention_rows(q[i : i + 1], *kvs[i], int(pos[i]), win or None, shape, kv) for i in range(m)]
                )
                return
            # each query's parts are its own (its chunks of TPP key tiles), whatever blocks the launch has: the
            # kernel runs them all, several a block (batch invariance)
            parts = [
                EA.attention_partials(q[i : i + 1], *kvs[i], int(pos[i]), win or None, shape, kv) for i in range(m)
            ]
            self._split_out(p, a, m, np.concatenate([o for o, _ in parts], 1), np.concatenate([x for _, x in parts], 1))
            return
        if p.get("seg"):  # a batched draft step: blocks of seg queries, each its own sequence's, computed alone
            self._segments(p, a, q, m, int(p["seg"]))
            return
        p0 = int(self.v(a["positions"], np.int32, 1, "positions")[0])
        lane = int(self.v(a["lanes"], np.int32, 1, "lanes")[0]) if a["lanes"] else 0
        keys, vals = self._load_kv(p, a, p0, m, lane)
        end = p0 + m
        if not p["causal"]:
            # Bidirectional within the block (the drafter's full layer, no window): every query sees keys
            # 0..p0+m-1, i.e. it behaves like a causal query at the block's last position.
            if win:
                raise EmuError("windowed bidirectional attention is not a planned kernel")
            part = [EA.attention_partials(q[i : i + 1], keys, vals, end - 1, None, shape, kv) for i in range(m)]
            o_p, ml_p = np.concatenate([o for o, _ in part], 1), np.concatenate([x for _, x in part], 1)
            if ns == 1:
                self.v(a["out"], np.float16, (m, hq, d), "out")[:] = EA.attention_combine(o_p, ml_p)
                return
            self._split_out(p, a, m, o_p, ml_p)
            return
        if p.get("kv_hi"):  # per-query upper key bounds (an image span's queries see the whole span)
            if not (p["causal"] and ns == 1):
                raise EmuError("per-query key bounds are for causal prefill kernels")
            hi = self.v(a["kv_hi"], np.int32, m, "kv_hi").astype(np.int64)
            if (hi > end - 1).any():
                raise EmuError(f"kv_hi {hi.max()} past the chunk's last position {end - 1}")
            self.v(a["out"], np.float16, (m, hq, d), "out")[:] = EA.attention_rows(
                q, keys, vals, p0, win or None, shape, kv, hi
            )
            return
        if ns == 1:
            out = EA.attention_rows(q, keys, vals, p0, win or None, shape, kv)
            self.v(a["out"], np.float16, (m, hq, d), "out")[:] = out
            return
        o_p, ml_p = EA.attention_partials(q, keys, vals, p0, win or None, shape, kv)
        self._split_out(p, a, m, o_p, ml_p)

    def _segments(self, p, a, q, m: int, seg: int) -> None:
        """attn_fwd with SEG: block b (queries b seg ..) at positions[b seg] .. in lane lanes[b seg], its mask within
        itself; each block's output (or split partials) as a launch of it alone gives."""
        if a["rowwise"] or p.get("kv_hi"):
            raise EmuError("segmented attention is neither rowwise nor bounded per query")
        if not a["lanes"]:
            raise EmuError("segmented attention needs each block's lane")
        shape, kv, win = EA.AttnShape.of(p), "fp8" if p["kv_dtype"] == "fp8e4m3" else "bf16", p["window"] or None
        pos = self.v(a["positions"], np.int32, m, "positions").copy()
        lanes = self.v(a["lanes"], np.int32, m, "lanes").copy()
        outs, parts = [], []
        for b0 in range(0, m, seg):
            n = min(seg, m - b0)
            p0 = int(pos[b0])
            if not (pos[b0 : b0 + n] == p0 + np.arange(n)).all() or (lanes[b0 : b0 + n] != lanes[b0]).any():
                raise EmuError(f"block at query {b0}: positions {pos[b0 : b0 + n]} lanes {lanes[b0 : b0 + n]}")
            keys, vals = self._load_kv(p, a, p0, n, int(lanes[b0]))
            qs = q[b0 : b0 + n]
            if p["causal"]:
                if p["nsplit"] == 1:
                    outs.append(EA.attention_rows(qs, keys, vals, p0, win, shape, kv))
                else:
                    parts.append(EA.attention_partials(qs, keys, vals, p0, win, shape, kv))
                continue
            if win:
                raise EmuError("windowed bidirectional attention is not a planned kernel")
            part = [EA.attention_partials(qs[i : i + 1], keys, vals, p0 + n - 1, None, shape, kv) for i in range(n)]
            o_p, ml_p = np.concatenate([o for o, _ in part], 1), np.concatenate([x for _, x in part], 1)
            if p["nsplit"] == 1:
                outs.append(EA.attention_combine(o_p, ml_p))
            else:
                parts.append((o_p, ml_p))
        if outs:
            self.v(a["out"], np.float16, (m, p["hq"], p["d"]), "out")[:] = np.concatenate(outs)
            return
        self._split_out(p, a, m, np.concatenate([o for o, _ in parts], 1), np.concatenate([x for _, x in parts], 1))

    def _page_slots(self, a, page: int, pitch: int, lane: int, pos: np.ndarray) -> np.ndarray:
        """Slots of positions `pos` of a paged cache through row `lane` of the page table."""
        if not a["pages"]:
            raise EmuError("a paged cache needs the page table (pages is null)")
        row = self.v(a["pages"] + 4 * lane * pitch, np.int32, pitch, "pages")
        return row[pos // page].astype(np.int64) * page + pos % page

    def _load_kv(self, p, a, p0: int, m: int, lane: int):
        """Keys/values [p0+m, Hkv, D] (float64) by position of queries p0..p0+m-1 over the cache of KV lane `lane`
        (ring slots read for the positions a query may see, older ones zero; a paged cache through the lane's
        page-table row)."""
        d, hkv, ring, win, page = p["d"], p["hkv"], p["ring"], p["window"], p["page"]
        kvdt = RK.np_dtype(p["kv_dtype"])
        end = p0 + m
        lo = max(0, p0 - win + 1) if win else 0
        pos = np.arange(lo, end)
        if page:
            sl = self._page_slots(a, page, p["pitch"], lane, pos)
            slots, lane_off = int(sl.max()) + 1, 0
        else:
            # (the slots the queries read: a lane planned linear because --ctx < ring is only --ctx slots long)
            sl, lane_off = (pos % ring if ring else pos), lane * a["lane_bytes"]
            slots = int(sl.max()) + 1
        kc = self.v(a["kc"] + lane_off, kvdt, (slots, hkv, d), "kc")
        vc = self.v(a["vc"] + lane_off, kvdt, (slots, hkv, d), "vc")
        keys, vals = np.zeros((end, hkv, d), F64), np.zeros((end, hkv, d), F64)
        keys[lo:], vals[lo:] = MR.kv_load(kc[sl], p["kv_dtype"]), MR.kv_load(vc[sl], p["kv_dtype"])
        if not (np.isfinite(keys).all() and np.isfinite(vals).all()):
            raise EmuError("attention read non-finite cache values")
        return keys, vals

    def _counters_zero(self, a, n: int, what: str) -> None:
        """The fused kernels' arrival counters must be zero at entry (the runtime zeroes them once; the kernels
        leave them zeroed), else the GPU kernel would pick the wrong last block."""
        cnt = self.v(a["counters"], np.uint32, n, what)
        if cnt.any():
            raise EmuError(f"{what}: counters not zero at entry: {cnt[cnt != 0][:8]}")

    def _split_out(self, p, a, m, o_p, ml_p) -> None:
        """A split decode kernel: the partials land in ws (as the kernel writes them); given counters the last split
        block's merge writes out (attn_split.cuh; attn_combine's math), else an attn_combine launch must follow."""
        d, hq, ns, mmax, z = p["d"], p["hq"], p["nsplit"], p["mmax"], len(o_p)  # (z <= ns: the launch's splits)
        ws = self.v(a["ws"], np.float32, p["ws_floats"], "ws")
        ws[: ns * mmax * hq * d].reshape(ns, mmax, hq, d)[:z, :m] = o_p
        ws[ns * mmax * hq * d : ns * mmax * hq * (d + 2)].reshape(ns, mmax, hq, 2)[:z, :m] = ml_p
        if a["counters"]:
            self._counters_zero(a, p["cnt_words"], "attention")
            self.v(a["out"], np.float16, (m, hq, d), "out")[:] = EA.attention_combine(o_p, ml_p)

    def k_attn_combine(self, p, a, n):
        m, d, hq, ns, mmax = a["m"], p["d"], p["hq"], p["nsplit"], p["mmax"]
        ws = self.v(a["ws"], np.float32, ns * mmax * hq * (d + 2), "ws")
        o = ws[: ns * mmax * hq * d].reshape(ns, mmax, hq, d)[:, :m]
        ml = ws[ns * mmax * hq * d :].reshape(ns, mmax, hq, 2)[:, :m]
        self.v(a["out"], np.float16, (m, hq, d), "out")[:] = EA.attention_combine(o, ml)

    def k_attn_tail(self, p, a, n):
        T, H = a["T"], p["H"]
        bf = lambda k: self.v(a[k], np.uint16, H, k)  # noqa: E731
        x = self.v(a["x"], np.float32, (T, H), "x")
        xn, a1, a2 = RK.attn_tail_ref(
            self.v(a["o"], np.float32, (T, H), "o"), x, bf("w_post"), bf("w_pre1"), bf("w_pre2"), p["EPS"]
        )
        x[:] = xn
        self.v(a["a1"], np.float16, (T, H), "a1")[:] = RK.store(a1, "f16")
        self.v(a["a2"], np.float16, (T, H), "a2")[:] = RK.store(a2, "f16")

    def k_ffn_tail(self, p, a, n):
        T, H = a["T"], p["H"]
        bf = lambda k: self.v(a[k], np.uint16, H, k)  # noqa: E731
        x = self.v(a["x"], np.float32, (T, H), "x")
        w_next = bf("w_next") if a["w_next"] else None
        moe = (
            self._pair_sum(a, T, p["PAIRS"], p["EXPERTS"], H)
            if p.get("PAIRS")
            else self.v(a["moe"], np.float32, (T, H), "moe")
        )
        xn, nxt = RK.ffn_tail_ref(
            self.v(a["mlp"], np.float32, (T, H), "mlp"),
            moe,
            x,
            bf("w1"),
            bf("w2"),
            bf("w"),
            self.v(a["layer_scalar"], np.uint16, 1),
            w_next,
            p["EPS"],
        )
        x[:] = xn
        self.taps.append(np.array(x))
        if nxt is not None:
            self.v(a["a"], np.float16, (T, H), "a")[:] = RK.store(nxt, "f16")
        if a["tap"]:  # the DFlash tap: x' rows into tap[row * tap_stride + tap_col ...] (TAP dtype)
            tdt = RK.np_dtype(p["TAP"])
            for r in range(T):
                self.v(a["tap"] + (r * a["tap_stride"] + a["tap_col"]) * np.dtype(tdt).itemsize, tdt, H, "tap")[:] = (
                    RK.store(xn[r], p["TAP"])
                )

    def k_router_logits(self, p, a, n):
        T, H, E = a["T"], p["H"], p["E"]
        lg = RK.router_logits_ref(
            self.v(a["x"], np.float32, (T, H), "x"),
            self.v(a["scale"], np.uint16, H),
            self.v(a["proj"], np.uint16, (E, H)),
            p["EPS"],
        )
        self.v(a["logits"], np.float32, (T, E), "logits")[:] = lg

    def k_router_logits_tiled(self, p, a, n):
        """The prefill chunk's GEMM-tiled logits: on the GPU bit-identical to router_logits (the same fmaf order)."""
        self.k_router_logits(p, a, n)

    def k_router_fused(self, p, a, n):
        """router_logits + router_topk in one launch (bit-identical to the pair on the GPU)."""
        self._counters_zero(a, a["T"], "router")
        self.k_router_logits(p, a, n)
        self.k_router_topk(p, a, n)

    def k_router_topk(self, p, a, n):
        T, E, K = a["T"], p["E"], p["K"]
        idx, w = RK.router_topk_ref(
            self.v(a["logits"], np.float32, (T, E), "logits"), K, self.v(a["per_expert_scale"], np.uint16, E)
        )
        self.v(a["topk_idx"], np.int32, (T, K), "topk_idx")[:] = idx
        self.v(a["topk_w"], np.float32, (T, K), "topk_w")[:] = w

    def _expert(self, a, e, n_, k_, p):
        if p["kind"] == "half":  # fp16 experts: [E][n_ * k_] halves, no scales
            return self.half(a["w"] + e * n_ * k_ * 2, n_, k_, f"expert {e}")
        wb, sb = n_ * k_ // 2, n_ * k_ // 16
        return self.nvfp4(
            a["w"] + e * wb, a["s"] + e * sb, a["gscale"] + 4 * e * (n_ // 8), n_, k_, p["fp4_order"], f"expert {e}"
        )

    def k_moe_gateup(self, p, a, n):
        m, K, ie, h = a["m"], p["topk"], p["ie"], p["h"]
        if not 1 <= m <= p["mmax"]:
            raise EmuError(f"m={m} outside 1..{p['mmax']}")
        ids = self.v(a["ids"], np.int32, (m, K), "ids")
        x = self.v(a["x"], np.float16, (m, h), "x").astype(F64)
        act = self.v(a["act"], np.float16, (m * K, ie), "act")
        for t in range(m):
            for k in range(K):
                g, u = L.deinterleave8(self._expert(a, int(ids[t, k]), 2 * ie, h, p))
                act[t * K + k] = RK.store(_gelu(x[t] @ g.T) * (x[t] @ u.T), "f16")

    def k_moe_down(self, p, a, n):
        m, K, ie, h = a["m"], p["topk"], p["ie"], p["h"]
        ids = self.v(a["ids"], np.int32, (m, K), "ids")
        wts = self.v(a["wts"], np.float32, (m, K), "wts").astype(F64)
        act = self.v(a["act"], np.float16, (m * K, ie), "act").astype(F64)
        y = np.zeros((m, h), F64)
        for t in range(m):
            for k in range(K):
                y[t] += wts[t, k] * (self._expert(a, int(ids[t, k]), h, ie, p) @ act[t * K + k])
        self.v(a["y"], np.float32, (m, h), "y")[:] = y

    def k_moe_down_pairs(self, p, a, n):
        """Every valid slot's routing-weighted expert output into its pair row (ffn_tail sums them)."""
        m, K, ie, h = a["m"], p["topk"], p["ie"], p["h"]
        ids = self.v(a["ids"], np.int32, (m, K), "ids")
        wts = self.v(a["wts"], np.float32, (m, K), "wts").astype(F64)
        act = self.v(a["act"], np.float16, (m * K, ie), "act").astype(F64)
        ypair = self.v(a["ypair"], np.float32, (m * K, h), "ypair")
        for t in range(m):
            for k in range(K):
                if 0 <= ids[t, k] < p["experts"]:
                    row = wts[t, k] * (self._expert(a, int(ids[t, k]), h, ie, p) @ act[t * K + k])
                    ypair[t * K + k] = RK.store(row, "f32")
                    self._pair_rows[a["ypair"] + 4 * h * (t * K + k)] = row

    # grouped MoE (prefill chunks > 16 rows): plan -> gate/up and down per tile (ffn_tail sums the slot rows)
    def k_moe_grouped_plan(self, p, a, n):
        K, E, T = p["topk"], p["experts"], min(max(a["T"], 0), p["mmax"])
        off, pairs, tiles = MG.plan_reference(
            self.v(a["ids"], np.int32, (T, K), "ids"), E, p["tile_rows"], p["max_tiles"]
        )
        self.v(a["offsets"], np.int32, E + 1, "offsets")[:] = off
        self.v(a["pairs"], np.int32, int(off[E]), "pairs")[:] = pairs[: off[E]]  # the kernel writes only these
        self.v(a["tiles"], np.int32, tiles.shape, "tiles")[:] = tiles

    def _moe_tiles(self, p, a):
        """(tile index, expert, sorted index range, pair ids) of every real tile; each must lie inside the grid."""
        for i, (e, start, rows, _) in enumerate(self.v(a["tiles"], np.int32, (p["max_tiles"], 4), "tiles")):
            if not (0 <= e < p["experts"] and rows > 0):
                continue
            if i >= self.grid[1]:
                raise EmuError(f"tile {i} lies outside the launch grid {self.grid}")
            yield int(e), slice(int(start), int(start + rows)), self.v(a["pairs"], np.int32, int(start + rows))[start:]

    def k_moe_grouped_gateup(self, p, a, n):
        K, ie, h = p["topk"], p["ie"], p["h"]
        for e, rng, pairs in self._moe_tiles(p, a):
            x = self.v(a["x"], np.float16, (int(pairs.max()) // K + 1, h), "x")[pairs // K].astype(F64)
            g, u = L.deinterleave8(self._expert(a, e, 2 * ie, h, p))
            self.v(a["act"], np.float16, (rng.stop, ie), "act")[rng] = RK.store(_gelu(x @ g.T) * (x @ u.T), "f16")

    def k_moe_grouped_down(self, p, a, n):
        ie, h = p["ie"], p["h"]
        for e, rng, pairs in self._moe_tiles(p, a):
            act = self.v(a["act"], np.float16, (rng.stop, ie), "act")[rng].astype(F64)
            wts = self.v(a["wts"], np.float32, int(pairs.max()) + 1, "wts")[pairs].astype(F64)
            y = (act @ self._expert(a, e, h, ie, p).T) * wts[:, None]
            self.v(a["ypair"], np.float32, (int(pairs.max()) + 1, h), "ypair")[pairs] = RK.store(y, "f32")
            self._pair_rows.update((a["ypair"] + 4 * h * int(q), row) for q, row in zip(pairs, y))

    def _pair_sum(self, a, T, K, experts, H):
        """A row's MoE output from its slot rows (moe_down_pairs, moe_grouped_down): the down kernels' float64 rows
        summed in slot order over the valid slots and rounded once (like the w4a16 reference), after checking that
        the f32 rows in device memory are exactly those rows: the wiring is checked; the kernels' own f32 per-slot
        rounding and f32 adds (~5e-8 relative) are accumulation-class roundings, which this emulator does not model
        for any kernel."""
        ids = self.v(a["ids"], np.int32, (T, K), "ids")
        ypair = self.v(a["moe"], np.float32, (T * K, H), "moe (slot rows)")
        y = np.zeros((T, H), F64)
        for k in range(K):
            for t in np.nonzero((ids[:, k] >= 0) & (ids[:, k] < experts))[0]:
                row = self._pair_rows.pop(a["moe"] + 4 * H * (int(t) * K + k), None)
                if row is None or not np.array_equal(RK.store(row, "f32"), ypair[t * K + k]):
                    raise EmuError(f"ffn_tail: slot row {t * K + k} holds no row a MoE down kernel wrote")
                y[t] += row
        return RK.store(y, "f32")

    def k_lm_argmax(self, p, a, n):
        T, V = a["T"], p["V"]
        capped = RK.softcap_ref(self.v(a["logits"], np.float32, (T, V), "logits"), p["SOFTCAP"])
        self.v(a["out_ids"], np.int32, T, "out_ids")[:] = RK.argmax_ref(capped)

    def k_lm_sample(self, p, a, n):
        if p["STAGE"] != "finish":
            return
        from thorgen.runtime.cuda.engine import SAMPLE_PARAMS

        T, V = a["T"], p["V"]
        recs = self.v(a["params"], np.uint8, T * SAMPLE_PARAMS.itemsize, "params").view(SAMPLE_PARAMS)
        pos = self.v(a["positions"], np.int32, T, "positions")
        logits = self.v(a["logits"], np.float32, (T, V), "logits")
        out = self.v(a["out_ids"], np.int32, T, "out_ids")
        for t, rec in enumerate(recs):  # each row its own parameters
            sp = SamplingParams(
                temperature=float(rec["temperature"]),
                top_k=int(rec["top_k"]),
                top_p=float(rec["top_p"]),
                min_p=float(rec["min_p"]),
                seed=int(rec["seed"]),
            )
            out[t] = sample(RK.softcap_ref(logits[t], p["SOFTCAP"]), sp, int(pos[t]))
