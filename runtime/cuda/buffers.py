"""Runtime stage: the engine's device memory (activations, KV cache, the drafter's split weights, the page table)
and the step programs' pointer table over it (programs.Pointers)."""

from __future__ import annotations

import numpy as np

from ...model_spec.conventions import SAMPLE_PARAMS, page_pitch
from ...model_spec.step_program import draft_batch_blocks
from ...model_spec.types import ModelSpec
from ...model_spec.weight_layout import HALF_LANE_BYTES, LANES, TILE_K, TILE_N
from ..backend import MAX_TOP_LOGPROBS, BackendError
from ..convert.artifact import WeightsArtifact
from ..manifest import KernelManifest
from .device import Device, Stream, check, driver
from .kernels import Ptr
from .kv_cache import KVCache, KVPlan
from .launch_lists import copy2d
from .logits_params import LOGIT_ROW, TOKEN_BIAS, TOKEN_COUNT
from .memory import Arena, ArenaPlan, DeviceBuffer, PinnedBuffer
from ...model_spec.conventions import MAX_BATCH, VERIFY_ROWS
from .programs import Copy2D
from .tap_ring import TAP_RING_ROWS

MAX_LOGIT_BIAS = 300  # logit_bias entries per request the device lists hold (the OpenAI API's own limit)


def split_weights(spec: ModelSpec) -> list[tuple[str, str, int, int, int]]:
    """(name, fused source, first row, rows, k) of the drafter's k|v matrices cut out of the repacked q|k|v: the
    context update projects only keys and values (the block's GEMM reads the fused matrix whole; see
    Engine._split_drafter_weights)."""
    d = spec.drafter
    assert d is not None
    nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    return [
        (f"dsplit.{l}.kv", f"draft.layers.{l}.self_attn.qkv_proj.weight", nq, 2 * nkv, d.hidden_size)
        for l in range(d.num_hidden_layers)
    ]


def plan_drafter_activations(p: ArenaPlan, spec: ModelSpec, rows: int) -> None:
    """Drafter buffers: context path sized for a prefill chunk (`rows`), block path for a batched draft step's
    blocks (VERIFY_ROWS rows each), the gathered rows of its head (a batched verify's MAX_BATCH rows), and the
    tap ring (runtime/cuda/tap_ring.py)."""
    d, H = spec.drafter, spec.target.hidden_size
    assert d is not None
    B = draft_batch_blocks(rows) * VERIFY_ROWS
    nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    for name, shape, dt in (
        ("taps", (rows, len(d.target_layer_ids) * H), "f16"),
        ("tap_ring", (TAP_RING_ROWS, len(d.target_layer_ids) * H), "f16"),
        ("dctx", (rows, d.hidden_size), "f32"),
        ("dctx_a", (rows, d.hidden_size), "f16"),
        ("dkv_raw", (rows, 2 * nkv), "f32"),
        ("dx", (B, d.hidden_size), "f32"),
        ("da", (B, d.hidden_size), "f16"),
        ("dqkv_raw", (B, nq + 2 * nkv), "f32"),
        ("dq", (B, nq), "bf16"),
        ("dattn", (B, nq), "f16"),
        ("do", (B, d.hidden_size), "f32"),
        ("dmlp", (B, d.intermediate_size), "f16"),
        ("dhead", (MAX_BATCH, d.hidden_size), "f16"),
        # the acceptance rule on the device: [most tokens a step commits, emulated K or -1]; its count
        ("spec_rule", (2,), "i32"),
        ("spec_acc", (1,), "i32"),
    ):
        p.add_array(name, shape, dt)


def plan_activations(
    spec: ModelSpec, manifest: KernelManifest, max_rows: int, ctx: int, ext: bool, speculative: bool
) -> ArenaPlan:
    """Every activation buffer of an engine that runs steps of up to `max_rows` rows (the loader sizes the KV cache
    beside it: at 2,048 rows it is ~0.75 GB on the full-size model, most of it the MoE's f32 pair rows)."""
    t, R = spec.target, max_rows
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    qmax = max(t.num_attention_heads * t.layer_head_dim(l) for l in range(t.num_hidden_layers))
    kmax = max(t.layer_kv_heads(l) * t.layer_head_dim(l) for l in range(t.num_hidden_layers))
    heads = max(
        t.num_attention_heads + t.layer_kv_heads(l) * (2 if t.layer_has_v_proj(l) else 1)
        for l in range(t.num_hidden_layers)
    )
    kernels = manifest.kernels.values()
    # workspaces, sized by the planner's params (whichever kernels declare them): split-K attention's partials
    # (ws_floats) and merge counters (cnt_words: one buffer, attention launches never overlap; zeroed below,
    # kept so), the logits kernels' per-row workspace, the grouped MoE's tile list (every entry written);
    # tail_cnt: the folded o_proj + attention tail's arrival counter (one word: o_proj launches never overlap);
    # qkv_cnt: the folded q|k|v GEMV + rope_kv's, a word per head of the widest layer
    ws, sws, acnt, tiles = (
        max([int(k.params.get(n, 0)) for k in kernels] + [1])
        for n in ("ws_floats", "WS_ROW_BYTES", "cnt_words", "max_tiles")
    )
    p = ArenaPlan("activations")
    for name, shape, dt in (
        ("x", (R, H), "f32"),
        ("a", (R, H), "f16"),
        ("a1", (R, H), "f16"),
        ("a2", (R, H), "f16"),
        ("qkv", (R, qmax + 2 * kmax), "f32"),
        ("q", (R, qmax), "bf16"),
        ("attn", (R, qmax), "f16"),
        ("attn_ws", (ws,), "f32"),
        ("o", (R, H), "f32"),
        ("mlp_act", (R, t.intermediate_size), "f16"),
        ("mlp", (R, H), "f32"),
        ("moe_act", (MAX_BATCH * K, t.moe_intermediate_size), "f16"),
        ("moe", (R, H), "f32"),
        ("rlogits", (R, E), "f32"),
        ("topk_idx", (R, K), "i32"),
        ("topk_w", (R, K), "f32"),
        ("ids", (R,), "i32"),
        ("positions", (R + MAX_BATCH,), "i32"),
        ("lanes", (R,), "i32"),
        ("logits", (MAX_BATCH, t.vocab_size), "f32"),
        ("out_ids", (MAX_BATCH,), "i32"),
        ("carry", (MAX_BATCH,), "i32"),  # a batched step's tokens, for the next step's carried rows
        ("best", (VERIFY_ROWS,), "i64"),
        ("counters", (VERIFY_ROWS,), "u32"),
        ("status", (MAX_BATCH,), "i32"),
        ("params", (MAX_BATCH, SAMPLE_PARAMS.itemsize), "u8"),
        ("workspace", (VERIFY_ROWS, sws), "u8"),
        ("moe_offsets", (E + 1,), "i32"),
        ("moe_pairs", (R * K,), "i32"),
        ("moe_tiles", (tiles, 4), "i32"),
        ("moe_act_sorted", (R * K, t.moe_intermediate_size), "f16"),
        ("moe_pair_out", (R * K, H), "f32"),
        ("router_cnt", (R,), "u32"),
        ("attn_cnt", (acnt,), "u32"),
        ("tail_cnt", (1,), "u32"),
        ("qkv_cnt", (heads,), "u32"),
        # the paged layers' page table: a row of page ids a sequence (lane), at the kernels' pitch
        (
            "kv_pages",
            (MAX_BATCH, int(manifest.conventions.get("page_pitch", page_pitch(t.max_position_embeddings)))),
            "i32",
        ),
    ):
        p.add_array(name, shape, dt)
    if spec.vision is not None:  # a prefill chunk's image rows (staged, copied into x) and its key bounds
        p.add_array("img_rows", (R, H), "f32")
        p.add_array("kv_hi", (R,), "i32")
    if ext:  # the processed head: runtime/cuda/logits_params.py packs what the rows point into
        V, M = t.vocab_size, MAX_BATCH
        for name, shape, dt in (
            ("processed", (VERIFY_ROWS, V), "f32"),
            ("logit_rows", (M, LOGIT_ROW.itemsize), "u8"),
            ("logit_counts", (M * min(V, ctx), TOKEN_COUNT.itemsize), "u8"),
            ("logit_biases", (M * MAX_LOGIT_BIAS, TOKEN_BIAS.itemsize), "u8"),
            ("logit_masks", (M, V // 32), "u32"),
            ("proc_counters", (2 * VERIFY_ROWS,), "u32"),
            ("proc_status", (M,), "i32"),
            ("lp_ids", (M, MAX_TOP_LOGPROBS), "i32"),
            ("lp_lps", (M, MAX_TOP_LOGPROBS), "float64"),
            ("lp_chosen", (M,), "float64"),
        ):
            p.add_array(name, shape, dt)
    if speculative:
        plan_drafter_activations(p, spec, R)
    return p


class EngineBuffers:
    """Activations, KV cache and drafter weights of one engine, and the pointer table the step programs bind
    through. The uploaded weights stay the engine's (it frees them)."""

    def __init__(
        self,
        spec: ModelSpec,
        device: Device,
        stream: Stream,
        manifest: KernelManifest,
        artifact: WeightsArtifact,
        weights: DeviceBuffer,
        kv: KVPlan,
        max_rows: int,
        ctx: int,
        ext: bool,
        speculative: bool,
    ) -> None:
        self.spec, self.device, self.art, self.weights = spec, device, artifact, weights
        self.kv = KVCache(device, kv)
        self.act = Arena(device, plan_activations(spec, manifest, max_rows, ctx, ext, speculative))
        self.dw = self._split_drafter_weights(stream) if speculative else None
        # On the engine's stream, not the legacy stream: a non-blocking stream does not wait for legacy-stream
        # work, so a plain cuMemsetD8 could still be running when the first kernels read. argmax/sampler scratch
        # (best, counters) must start zeroed (the kernels keep it so); a zeroed KV cache keeps never-written slots
        # finite.
        self.act.buffer.zero(stream)
        self.kv.arena.buffer.zero(stream)
        stream.synchronize()
        self.pages = PageTable(device, stream, self.act["kv_pages"], kv)

    def _split_drafter_weights(self, stream: Stream) -> Arena:
        """The drafter's k|v matrices as half-layout weights of their own (the repack stores q|k|v fused, the context
        update projects keys and values only, and the GEMMs read whole matrices). In the step-major layout a row
        range of a matrix is, per 64-column step, one contiguous run of its 16-row units, so each part is one
        strided device copy, done once at start."""
        plan, parts = ArenaPlan("drafter k/v"), split_weights(self.spec)
        for name, _, _, n, k in parts:
            plan.add(name, n * k * 2, "f16", (n * k,))
        arena = Arena(self.device, plan)
        unit = LANES * HALF_LANE_BYTES  # bytes of one unit's step of fp16
        for name, src, r0, n, k in parts:
            rows = int(np.prod(self.art.entry(src).shape)) // k
            op = Copy2D(
                f"split {name}",
                self.W(src, r0 // TILE_N * unit),
                rows // TILE_N * unit,
                Ptr(arena[name].ptr),
                n // TILE_N * unit,
                n // TILE_N * unit,
                k // TILE_K,
            )
            copy2d(op)(stream)
        stream.synchronize()
        return arena

    # ---- the pointer table (programs.Pointers) ----------------------------------------------------------------
    def W(self, name: str, byte_offset: int = 0) -> Ptr:
        if name.startswith("dsplit."):
            return Ptr(self.dw[name].ptr + byte_offset)
        return Ptr(self.weights.ptr + self.art.entry(name).offset + byte_offset)

    def A(self, name: str, row: int = 0) -> Ptr:
        r = self.act.plan.regions[name]
        return Ptr(self.act[name].ptr + row * (r.nbytes // r.shape[0]))

    def KV(self, layer: int, which: str) -> Ptr:
        return Ptr((self.kv.k(layer) if which == "k" else self.kv.v(layer)).ptr)

    def DKV(self, layer: int, which: str) -> Ptr:
        """A drafter layer's K or V cache (the context K/V of committed positions, then the block's)."""
        return Ptr((self.kv.k(layer, "drafter") if which == "k" else self.kv.v(layer, "drafter")).ptr)

    def lane_bytes(self, layer: int) -> int:
        l = self.kv.plan.layers[layer]  # (target layers come first in the plan)
        return 0 if l.paged else l.k_bytes  # (a paged layer's lanes are page-table rows)

    def dlane_bytes(self, layer: int) -> int:
        return self.kv.plan.drafter()[layer].k_bytes

    def free(self) -> None:
        for part in (self.pages, self.act, self.kv, self.dw):
            if part is not None:
                part.free()


class PageTable:
    """The paged layers' page table: a pinned host copy, rows uploaded stream-ordered (runtime/engine/kv_manager.py
    decides them). Until a runner maps a lane, lane l's positions sit on pages l * P.. (P: one full context),
    wrapped at the pool's end: what a direct caller (a benchmark, a test) gets, like one linear cache a lane."""

    def __init__(self, device: Device, stream: Stream, table: DeviceBuffer, kv: KVPlan) -> None:
        self.stream, self.table, self.pool = stream, table, kv.pages
        self.lanes, self.pitch = kv.lanes, table.nbytes // (4 * MAX_BATCH)
        self._host = PinnedBuffer(4 * MAX_BATCH * self.pitch)
        self._uploaded = device.event(timing=False)  # the latest upload from the host copy ran
        if kv.pages:
            rows = self._host.array.view(np.int32).reshape(MAX_BATCH, self.pitch)
            rows[:] = (np.arange(MAX_BATCH)[:, None] * kv.seq_pages + np.arange(self.pitch)[None]) % kv.pages
            table.upload(rows, stream=stream)
            stream.synchronize()

    def map(self, lane: int, first: int, pages: list[int]) -> None:
        """Entries first.. of `lane` = `pages` (uploaded stream-ordered before the next launches, so a step in
        flight still reads the entries it was launched with). The host copy is rewritten only once the previous
        upload from it ran (a step launched ahead may have its own entries still queued)."""
        if not pages:
            return
        if not (0 <= lane < self.lanes and 0 <= first and first + len(pages) <= self.pitch):
            raise BackendError(
                f"page table: lane {lane} entries {first}..{first + len(pages) - 1} outside {self.lanes} x {self.pitch}"
            )
        if min(pages) < 0 or max(pages) >= self.pool:
            raise BackendError(f"page table: page ids {min(pages)}..{max(pages)} outside the pool of {self.pool}")
        at = lane * self.pitch + first
        self._uploaded.synchronize()
        self._host.array.view(np.int32)[at : at + len(pages)] = pages
        check(
            driver().cuMemcpyHtoDAsync(
                self.table.ptr + 4 * at, self._host.ptr + 4 * at, 4 * len(pages), self.stream.handle
            ),
            "page table entries",
        )
        self._uploaded.record(self.stream)

    def free(self) -> None:
        self._host.free()
        self._uploaded.destroy()


__all__ = ["MAX_LOGIT_BIAS", "EngineBuffers", "PageTable", "plan_activations"]
