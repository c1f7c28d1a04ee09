"""Runtime stage: the CUDA engine — one weight upload, static buffers, chunked prefill and a graphed decode step.

Everything is allocated once (weights, KV cache, activations for up to `max_step_tokens` rows), so every pointer
is fixed and the one-token decode step is captured as a CUDA graph (one per mode: greedy, sampled). The step
embeds the previous step's `out_ids[0]` and reads its position from device memory (small async copies from
pinned memory), so between steps only the new token id (4 bytes) crosses to the host. The launches themselves
come from runtime/cuda/programs.py; a manifest lacking any kernel they need stops the engine at start, naming all.
DFlash speculative decoding (runtime/cuda/speculative.py) adds, when the model has a drafter and its kernels are built,
the drafter's KV cache and buffers, its k|v weights cut out of the fused q|k|v, tap capture in prefill, and two graphed
16-row graphs per step (draft; verify + drafter context update); otherwise `spec_missing` says what is absent.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import numpy as np

from ...model_spec.conventions import SAMPLE_PARAMS, page_pitch
from ...model_spec.types import ModelSpec
from ..backend import MAX_TOP_LOGPROBS, BackendError
from .device import Device, check, driver
from .programs import DECODE_BUCKETS, LM_ROWS, MAX_BATCH, NULL, Copy2D, Forward, _grid
from .graphs import CudaGraph
from .kv_cache import KVCache, plan_kv
from .logits_params import LOGIT_ROW, TOKEN_BIAS, TOKEN_COUNT, plain_row
from .memory import Arena, ArenaPlan, DeviceBuffer, PinnedBuffer
from ..manifest import KernelManifest
from .kernels import KernelSet, Ptr
from .speculative import BLOCK, DraftForward, plan_drafter_activations, split_weights
from ..convert.artifact import WeightsArtifact

MAX_LOGIT_BIAS = 300  # logit_bias entries per request the device lists hold (the OpenAI API's own limit)


def plan_activations(spec: ModelSpec, manifest: KernelManifest, max_rows: int, ctx: int, ext: bool,
                     speculative: bool) -> ArenaPlan:
    """Every activation buffer of an engine that runs steps of up to `max_rows` rows (the loader sizes the KV cache
    beside it: at 2,048 rows it is ~0.75 GB on the full-size model, most of it the MoE's f32 pair rows)."""
    t, R = spec.target, max_rows
    H, E, K = t.hidden_size, t.num_experts, t.top_k_experts
    qmax = max(t.num_attention_heads * t.layer_head_dim(l) for l in range(t.num_hidden_layers))
    kmax = max(t.layer_kv_heads(l) * t.layer_head_dim(l) for l in range(t.num_hidden_layers))
    heads = max(t.num_attention_heads + t.layer_kv_heads(l) * (2 if t.layer_has_v_proj(l) else 1)
                for l in range(t.num_hidden_layers))
    kernels = manifest.kernels.values()
    # workspaces, sized by the planner's params (whichever kernels declare them): split-K attention's partials
    # (ws_floats) and merge counters (cnt_words: one buffer, attention launches never overlap; zeroed below,
    # kept so), the logits kernels' per-row workspace, the grouped MoE's tile list (every entry written);
    # tail_cnt: the folded o_proj + attention tail's arrival counter (one word: o_proj launches never overlap);
    # qkv_cnt: the folded q|k|v GEMV + rope_kv's, a word per head of the widest layer
    ws, sws, acnt, tiles = (max([int(k.params.get(n, 0)) for k in kernels] + [1])
                            for n in ("ws_floats", "WS_ROW_BYTES", "cnt_words", "max_tiles"))
    p = ArenaPlan("activations")
    for name, shape, dt in (
            ("x", (R, H), "f32"), ("a", (R, H), "f16"), ("a1", (R, H), "f16"), ("a2", (R, H), "f16"),
            ("qkv", (R, qmax + 2 * kmax), "f32"), ("q", (R, qmax), "bf16"), ("attn", (R, qmax), "f16"),
            ("attn_ws", (ws,), "f32"), ("o", (R, H), "f32"), ("mlp_act", (R, t.intermediate_size), "f16"),
            ("mlp", (R, H), "f32"), ("moe_act", (MAX_BATCH * K, t.moe_intermediate_size), "f16"),
            ("moe", (R, H), "f32"), ("rlogits", (R, E), "f32"), ("topk_idx", (R, K), "i32"),
            ("topk_w", (R, K), "f32"), ("ids", (R,), "i32"), ("positions", (R + MAX_BATCH,), "i32"),
            ("lanes", (R,), "i32"), ("logits", (MAX_BATCH, t.vocab_size), "f32"), ("out_ids", (MAX_BATCH,), "i32"),
            ("carry", (MAX_BATCH,), "i32"),  # a batched step's tokens, for the next step's carried rows
            ("best", (LM_ROWS,), "i64"), ("counters", (LM_ROWS,), "u32"), ("status", (MAX_BATCH,), "i32"),
            ("params", (MAX_BATCH, SAMPLE_PARAMS.itemsize), "u8"), ("workspace", (LM_ROWS, sws), "u8"),
            ("moe_offsets", (E + 1,), "i32"), ("moe_pairs", (R * K,), "i32"), ("moe_tiles", (tiles, 4), "i32"),
            ("moe_act_sorted", (R * K, t.moe_intermediate_size), "f16"), ("moe_pair_out", (R * K, H), "f32"),
            ("router_cnt", (R,), "u32"), ("attn_cnt", (acnt,), "u32"), ("tail_cnt", (1,), "u32"),
            ("qkv_cnt", (heads,), "u32"),
            # the paged layers' page table: a row of page ids a sequence (lane), at the kernels' pitch
            ("kv_pages", (MAX_BATCH, int(manifest.conventions.get(
                "page_pitch", page_pitch(t.max_position_embeddings)))), "i32")):
        p.add_array(name, shape, dt)
    if ext:  # the processed head: runtime/cuda/logits_params.py packs what the rows point into
        V, M = t.vocab_size, MAX_BATCH
        for name, shape, dt in (
                ("processed", (LM_ROWS, V), "f32"), ("logit_rows", (M, LOGIT_ROW.itemsize), "u8"),
                ("logit_counts", (M * min(V, ctx), TOKEN_COUNT.itemsize), "u8"),
                ("logit_biases", (M * MAX_LOGIT_BIAS, TOKEN_BIAS.itemsize), "u8"),
                ("logit_masks", (M, V // 32), "u32"), ("proc_counters", (2 * LM_ROWS,), "u32"),
                ("proc_status", (M,), "i32"), ("lp_ids", (M, MAX_TOP_LOGPROBS), "i32"),
                ("lp_lps", (M, MAX_TOP_LOGPROBS), "float64"), ("lp_chosen", (M,), "float64")):
            p.add_array(name, shape, dt)
    if speculative:
        plan_drafter_activations(p, spec, R)
    return p


class Engine:
    """Device resources of one model; `prefill()` then `decode()` generate (runtime/cuda/profile.py times a step)."""

    # Pinned staging: 128 slots of [position, sampled position, token id, pad] (16 B), used in turn; the stream is
    # synchronised at least every 128 steps, so a slot is never rewritten before its async copy ran. Token readback
    # at 2048.
    _SLOTS, _READ = 128, 2048  # (one-row steps read their tokens at _READ + 4 and + 8, in turn)
    # DFlash: the staged block at _SPEC (positions, sampled positions, last token, lanes, rule), then at
    # _SPEC + _SPEC_FORCED two slots of forced drafts (draft_hook); the read-back (ids, out_ids, the accepted count)
    # in two slots; the slots used in turn, as the batched steps' (a step is launched before the one before it ran)
    _SPEC, _SPEC_FORCED, _SPEC_READ, _SPEC_READ_SLOT = 4096, 384, 6144, 256
    # Batched steps: [ids | positions | sampled positions | lanes] (MAX_BATCH int32 each), then SampleParams rows,
    # then the tokens read back. Two such slots, used in turn: a runner launches step n + 1 before it waits for
    # step n (launch_batch / wait_batch), so a slot is rewritten only after the step that used it was waited for.
    _BATCH, _BATCH_SLOT, _BATCH_READ = 8192, 2048, 1920  # (16 * MAX_BATCH B of int32, MAX_BATCH * 40 B of params)

    def __init__(self, spec: ModelSpec, device: Device, manifest: KernelManifest, artifact: WeightsArtifact,
                 weights: DeviceBuffer, ctx: int, kv_dtype: str = "bf16", lanes: int = 1,
                 pages: int | None = None) -> None:
        self.spec, self.device, self.manifest, self.art, self.weights = spec, device, manifest, artifact, weights
        self.ctx, self.lanes = ctx, lanes
        if not 1 <= lanes <= MAX_BATCH:
            raise BackendError(f"cuda backend: {lanes} sequences at once; batched decode steps hold 1..{MAX_BATCH}")
        self.max_rows = manifest.max_step_tokens
        # Programmatic dependent launch between consecutive kernels (the kernels' convention; THORGEN_PDL=0 is off)
        self.pdl = bool(manifest.conventions.get("pdl", False)) and os.environ.get("THORGEN_PDL", "1") != "0"
        # The dense MLP on a side stream beside router + MoE (THORGEN_FORK=0 runs everything on one stream)
        self.fork = os.environ.get("THORGEN_FORK", "1") != "0"
        self.side = device.stream()
        self.stream = device.stream()
        self.kernels = KernelSet(manifest, device)
        self.fwd = Forward(spec, manifest, "bf16" if kv_dtype == "bf16" else "fp8e4m3", self.max_rows)
        missing = self.fwd.probe()
        # Speculative decoding is optional: without a drafter (or its kernels) plain decoding still runs, and
        # generate_stream(speculative=True) names what is missing.
        self.spec_missing = self._probe_speculative()
        # Logits processing and logprobs (lm_logits kernels) are optional too: without them such requests are refused
        self.ext_missing = self.fwd.probe_ext()
        if artifact.lm_head != "nvfp4":
            missing.append("a bf16 lm_head GEMM (repack with --lm-head nvfp4, the supported path)")
        if missing:
            self.close()
            raise BackendError("cuda backend: the kernel manifest lacks what the forward needs: " + "; ".join(missing)
                               + ". Rebuild with `thorgen build` once those kernel families exist")
        self.kernels.load_all()
        # Fork/join events. Eager forwards (prefill chunks, bound again for every ragged chunk) share one pair: a
        # stream wait binds to the event's latest record at the time of the call, so re-recording is safe. Captured
        # graphs (a few, built once) get events of their own, kept until close.
        self._fork_ev, self._join_ev = device.event(timing=False), device.event(timing=False)
        self._graph_events: list[Any] = []
        self.kv = KVCache(device, plan_kv(spec, ctx, kv_dtype, drafter=self.speculative,
                                          conventions=manifest.conventions, lanes=lanes, pages=pages))
        self.act = Arena(device, plan_activations(spec, manifest, self.max_rows, ctx, not self.ext_missing,
                                                  self.speculative))
        self.pitch = self.act.plan.regions["kv_pages"].shape[1]
        self.dw = self._split_drafter_weights() if self.speculative else None
        # On self.stream, not the legacy stream: a non-blocking stream does not wait for legacy-stream work, so a
        # plain cuMemsetD8 could still be running when the first kernels read. argmax/sampler scratch (best,
        # counters) must start zeroed (the kernels keep it so); a zeroed KV cache keeps never-written slots finite.
        self.act.buffer.zero(self.stream)
        self.kv.arena.buffer.zero(self.stream)
        self.stream.synchronize()
        self._pinned = PinnedBuffer(self._BATCH + 2 * self._BATCH_SLOT)
        self._batch_events = [device.event(timing=False) for _ in range(2)]  # a batched launch's tokens landed
        self._staged = device.event(timing=False)  # the latest batched launch's host-to-device copies ran
        self._batch_slot = 0
        self._one_events = [device.event(timing=False) for _ in range(2)]  # a one-row launch's token landed
        self._spec_events = [device.event(timing=False) for _ in range(2)]  # a DFlash launch's tokens landed
        self._one_slot = self._spec_slot = self._staged_n = 0
        # The page table's host copy (pinned: rows are uploaded from it stream-ordered, runtime/cuda/kv_pages.py decides
        # them). Until a runner maps a lane, lane l's positions sit on pages l * P.. (P: one full context), wrapped
        # at the pool's end: what a direct caller (a benchmark, a test) gets, like one linear cache a lane.
        self._page_rows = PinnedBuffer(4 * MAX_BATCH * self.pitch)
        if self.kv.plan.pages:
            seq, table = self.kv.plan.seq_pages, self._page_rows.array.view(np.int32).reshape(MAX_BATCH, self.pitch)
            table[:] = (np.arange(MAX_BATCH)[:, None] * seq + np.arange(self.pitch)[None]) % self.kv.plan.pages
            self.act["kv_pages"].upload(table, stream=self.stream)
            self.stream.synchronize()
        self.fwd.ptr = self  # real buffers from now on
        self._graphs: dict[str, CudaGraph] = {}
        # Bound launch lists of prefill chunks and scoring passes by shape, most recent last: a ragged chunk
        # (the step budget less the running decodes) recurs as often as the decode count does, and binding
        # one costs milliseconds of Python (~450 launches) while the GPU waits.
        self._bound: OrderedDict[tuple, list[tuple[str, Any]]] = OrderedDict()
        # Test hook: callable(start, last_token) -> 15 drafts that replace the drafter's (written into ids[1..15]
        # between the draft and the verify graphs), so tests can force long acceptances and rollbacks.
        self.draft_hook: Any = None
        self.emulate_acceptance: int | None = None  # see CudaRunner.decode (thorgen bench --emulate-acceptance)
        self.spec_timing: list | None = None  # a list: each DFlash step appends its (draft ms, verify ms)

    # ---- speculative (DFlash) setup ---------------------------------------------------------------------------
    def _probe_speculative(self) -> list[str]:
        if self.spec.drafter is None:
            return [f"model {self.spec.name} has no DFlash drafter (no dflash/ folder)"]
        if "draft.fc.weight" not in self.art.tensors:
            return ["the repacked weights hold no drafter (repack with the drafter next to the model)"]
        try:
            return DraftForward(self.fwd).probe()
        except BackendError as exc:
            return [str(exc)]

    @property
    def speculative(self) -> bool:
        return not self.spec_missing

    def _split_drafter_weights(self) -> Arena:
        """The drafter's k|v matrices as half-layout weights of their own (the repack stores q|k|v fused, the context
        update projects keys and values only, and the GEMMs read whole matrices). In the step-major layout a row
        range of a matrix is, per 64-column step, one contiguous run of its 16-row units, so each part is one
        strided device copy, done once at start."""
        plan, parts = ArenaPlan("drafter k/v"), split_weights(self.spec)
        for name, _, _, n, k in parts:
            plan.add(name, n * k * 2, "f16", (n * k,))
        arena = Arena(self.device, plan)
        unit = 16 * 64 * 2  # bytes of one 16-row x 64-column unit of fp16
        for name, src, r0, n, k in parts:
            total = self.art.entry(src).shape
            rows = int(np.prod(total)) // k
            op = Copy2D(f"split {name}", self.W(src, r0 // 16 * unit), rows // 16 * unit, Ptr(arena[name].ptr),
                        n // 16 * unit, n // 16 * unit, k // 64)
            _copy2d(op)(self.stream)
        self.stream.synchronize()
        return arena

    # ---- buffers --------------------------------------------------------------------------------------------------
    def W(self, name: str, byte_offset: int = 0) -> Ptr:
        if name.startswith("dsplit."):
            return Ptr(self.dw[name].ptr + byte_offset)
        return Ptr(self.weights.ptr + self.art.entry(name).offset + byte_offset)

    def A(self, name: str, row: int = 0) -> Ptr:
        r = self.act.plan.regions[name]
        return Ptr(self.act[name].ptr + row * (r.nbytes // r.shape[0]))

    def KV(self, layer: int, which: str) -> Ptr:
        return Ptr((self.kv.k(layer) if which == "k" else self.kv.v(layer)).ptr)

    def lane_bytes(self, layer: int) -> int:
        l = self.kv.plan.layers[layer]  # (target layers come first in the plan)
        return 0 if l.paged else l.k_bytes  # (a paged layer's lanes are page-table rows)

    def dlane_bytes(self, layer: int) -> int:
        return self.kv.plan.drafter()[layer].k_bytes

    def map_pages(self, lane: int, first: int, pages: list[int]) -> None:
        """Page-table entries first.. of `lane` = `pages` (uploaded stream-ordered before the next launches, so a
        step in flight still reads the entries it was launched with). The pinned source is rewritten only once the
        copies of the latest batched launch ran: a launched-ahead step may still have its own entries to copy."""
        if not pages:
            return
        if not (0 <= lane < self.lanes and 0 <= first and first + len(pages) <= self.pitch):
            raise BackendError(f"page table: lane {lane} entries {first}..{first + len(pages) - 1} outside "
                               f"{self.lanes} x {self.pitch}")
        if min(pages) < 0 or max(pages) >= self.kv.plan.pages:
            raise BackendError(f"page table: page ids {min(pages)}..{max(pages)} outside the pool of "
                               f"{self.kv.plan.pages}")
        at = lane * self.pitch + first
        self._staged.synchronize()
        self._page_rows.array.view(np.int32)[at:at + len(pages)] = pages
        check(driver().cuMemcpyHtoDAsync(self.act["kv_pages"].ptr + 4 * at, self._page_rows.ptr + 4 * at,
                                         4 * len(pages), self.stream.handle), "page table entries")

    def DKV(self, layer: int, which: str) -> Ptr:
        """A drafter layer's K or V cache (the context K/V of committed positions, then the block's)."""
        return Ptr((self.kv.k(layer, "drafter") if which == "k" else self.kv.v(layer, "drafter")).ptr)

    # ---- launches -------------------------------------------------------------------------------------------------
    def bind(self, ops: list, captured: bool = False) -> list[tuple[str, Any]]:
        """Ops -> (label, callable(stream)) pairs: prepacked kernel launches and strided copies."""
        out: list[tuple[str, Any]] = []
        # PDL only between two kernels of one stream, and only where the program allows it (op.pdl): a copy, the
        # host's staging or a cross-stream join is a full dependency. Branch-1 ops run on the side stream: forked
        # from the main stream at the first one, joined back at the next op marked `join`.
        after = {0: False, 1: False}
        side_open = False
        for op in ops:
            if isinstance(op, Copy2D):
                out.append((op.label, _copy2d(op)))
                after[0] = False
                continue
            branch = getattr(op, "branch", 0) if self.fork else 0
            fork = branch == 1 and not side_open
            join = side_open and getattr(op, "join", False)
            if fork:
                side_open, after[1] = True, False
            if join:
                side_open, after[0] = False, False
            missing = [n for n in op.entry.args if n not in op.args]
            if missing:
                raise BackendError(f"cuda backend: {op.label}: kernel {op.entry.name} takes {missing}, which the "
                                   "engine does not provide (kernel signature changed?)")
            k = self.kernels.kernel(op.entry.name)
            launch = k.bind([op.args[n] for n in op.entry.args], grid=_grid(op.entry, op.rows, op.rowwise),
                            pdl=self.pdl and op.pdl and after[branch])
            after[branch] = True
            out.append((op.label, self._on_branch(launch, branch, fork, join, captured)))
        if side_open:
            raise BackendError("cuda backend: a side-stream branch is never joined (forward schedule bug)")
        return out

    def _on_branch(self, launch: Any, branch: int, fork: bool, join: bool, captured: bool) -> Any:
        """The launch, run on the side stream (branch 1; `fork`: first wait for the main stream's work so far) or
        on the main stream (`join`: first wait for everything the side stream has queued)."""
        if not (branch or join):
            return launch
        if captured:
            ev = self.device.event(timing=False)
            self._graph_events.append(ev)
        else:
            ev = self._fork_ev if branch else self._join_ev

        def run(stream: Any) -> None:
            if branch:
                if fork:
                    ev.record(stream)
                    self.side.wait(ev)
                launch(self.side)
            else:
                ev.record(self.side)
                stream.wait(ev)
                launch(stream)
        run.kernel = launch.kernel  # type: ignore[attr-defined]  (profiling labels)
        run.pdl = launch.pdl  # type: ignore[attr-defined]
        return run

    def _captured(self, key: str, ops: Callable[[], list], what: str) -> CudaGraph:
        """The graph `key`, captured from `ops()` the first time it is asked for."""
        g = self._graphs.get(key)
        if g is None:
            launches = self.bind(ops(), captured=True)
            g = CudaGraph.capture(self.stream, lambda: [l(self.stream) for _, l in launches], f"{what} ({key})")
            self._graphs[key] = g
        return g

    def _graph(self, greedy: bool, ext: bool = False) -> CudaGraph:
        return self._captured(("greedy" if greedy else "sample") + ("_ext" if ext else ""),
                              lambda: self.fwd.ops(1, decode=True, last=True, greedy=greedy, ext=ext), "decode step")

    def _stage(self, position: int, token: int | None, lane: int = 0) -> None:
        """Async copies of the step's position (and sampled position, KV lane, and a prompt token into
        out_ids[0]), from the next of the pinned slots in turn (a step launched ahead may still wait for its own)."""
        off = 16 * (self._staged_n % self._SLOTS)
        self._staged_n += 1
        vals = self._pinned.array[off:off + 16].view(np.int32)
        vals[:] = (position, position + 1, -1 if token is None else token, lane)
        cu, h, src = driver(), self.stream.handle, self._pinned.ptr + off
        pos = self.act["positions"].ptr
        check(cu.cuMemcpyHtoDAsync(pos, src, 4, h), "position")
        check(cu.cuMemcpyHtoDAsync(pos + 4 * self.max_rows, src + 4, 4, h), "sample position")
        check(cu.cuMemcpyHtoDAsync(self.act["lanes"].ptr, src + 12, 4, h), "KV lane")
        if token is not None:
            check(cu.cuMemcpyHtoDAsync(self.act["out_ids"].ptr, src + 8, 4, h), "prompt token")

    # ---- running --------------------------------------------------------------------------------------------------
    def set_sampling(self, sampling: Any) -> None:
        """Every row's SampleParams from one request's SamplingParams (what single-sequence steps sample with)."""
        rec = np.zeros(MAX_BATCH, SAMPLE_PARAMS)
        rec[:] = sample_record(sampling)
        self.act["params"].upload(rec.view(np.uint8), stream=self.stream)  # ordered before the next step's sampler

    def prefill(self, prompt: list[int], greedy: bool = True, taps: bool = False,
                launched: Callable[[], None] | None = None, begin: int = 0, lane: int = 0, ext: bool = False) -> int:
        """Run the prompt (positions begin..P-1; the K/V of 0..begin-1 is already cached) in chunks of
        max_step_tokens rows; returns the first new token. `taps`: also capture the DFlash taps and project them
        into the drafter's context cache (speculative). `launched()` runs once everything is enqueued, before
        the wait for the token (see decode)."""
        if taps and not self.speculative:
            raise BackendError("cuda backend: speculative decoding is unavailable: " + "; ".join(self.spec_missing))
        ids_buf, n = self.act["ids"], len(prompt)
        if not 0 <= begin < n:
            raise BackendError(f"prefill from position {begin} of a {n}-token prompt: at least one token must run")
        for start in range(begin, n, self.max_rows):
            rows = min(self.max_rows, n - start)
            last = start + rows == n
            if rows == 1 and not taps:  # the graphed step handles a single row (it embeds out_ids[0])
                self._stage(start, prompt[start], lane)
                self._graph(greedy if last else True, ext and last).replay(self.stream)
                continue
            # Stream-ordered copies: a synchronous cuMemcpyHtoD runs on the legacy stream, which this non-blocking
            # stream does not wait for (from pageable memory it may return before the DMA lands), so the chunk's
            # kernels could read the previous chunk's ids/positions. Pageable sources are staged at the call.
            ids = np.asarray(prompt[start:start + rows], np.int32)
            ids_buf.view(0, ids.nbytes).upload(ids, stream=self.stream)
            pos = self.act["positions"]
            pos.view(0, 4 * rows).upload(np.arange(start, start + rows, dtype=np.int32), stream=self.stream)
            pos.view(4 * self.max_rows, 4).upload(np.array([start + rows], np.int32), stream=self.stream)
            self.act["lanes"].view(0, 4 * rows).upload(np.full(rows, lane, np.int32), stream=self.stream)
            launches = self._bound_launches((rows, last, greedy, taps, ext and last), lambda: self.fwd.ops(
                rows, decode=False, last=last, greedy=greedy, taps=taps, ext=ext and last)
                + (DraftForward(self.fwd).ctx_ops(rows) if taps else []))
            for _, launch in launches:
                launch(self.stream)
        return self._read_token(launched)

    _BOUND_KEEP = 64  # launch lists kept (a few MB of packed parameters)

    def _bound_launches(self, key: tuple, ops: Callable[[], list]) -> list[tuple[str, Any]]:
        launches = self._bound.get(key)
        if launches is None:
            launches = self._bound[key] = self.bind(ops())
            if len(self._bound) > self._BOUND_KEEP:
                self._bound.popitem(last=False)
        self._bound.move_to_end(key)
        return launches

    def score(self, tokens: list[int], start: int, stop: int, top: int, lane: int = 0) -> list:
        """Prompt logprobs: run positions start..stop-1 of `tokens` (the K/V of 0..start-1 cached) and return,
        for each, the TokenLogprob of the token after it (tokens[p + 1]) with the `top` most likely ids.
        Batched forwards of up to MAX_BATCH consecutive positions in one lane (Forward.ops `score`)."""
        if not 0 <= start < stop < len(tokens):  # position p needs tokens[p + 1]
            raise BackendError(f"score positions {start}..{stop - 1} of {len(tokens)} tokens")
        if self.ext_missing:
            raise BackendError("cuda backend: prompt logprobs need kernels the manifest lacks: "
                               + "; ".join(self.ext_missing))
        out = []
        for r0 in range(start, stop, MAX_BATCH):
            rows = min(MAX_BATCH, stop - r0)
            put = [(self.act["ids"], tokens[r0:r0 + rows]), (self.act["positions"], range(r0, r0 + rows)),
                   (self.act["lanes"], [lane] * rows), (self.act["out_ids"], tokens[r0 + 1:r0 + 1 + rows])]
            for buf, vals in put:
                arr = np.asarray(vals, np.int32)
                buf.view(0, arr.nbytes).upload(arr, stream=self.stream)
            launches = self._bound_launches(("score", rows), lambda: self.fwd.ops(
                rows, decode=False, last=True, batched=True, score=True))
            for _, launch in launches:
                launch(self.stream)
            _, ids, lps, chosen = self.read_logits(rows)
            out += [logprob_entry(ids, lps, chosen, r, top) for r in range(rows)]
        return out

    def decode(self, position: int, greedy: bool = True, token: int | None = None,
               launched: Callable[[], None] | None = None, lane: int = 0, ext: bool = False) -> int:
        """One graphed step for the token at `position` (its id is out_ids[0], or `token` when given); returns the
        new token id. `launched()` runs while the GPU works, before the wait: host work done there (streaming the
        previous step's tokens to clients) then costs no GPU time."""
        launch = self.launch_one(position, greedy, token, lane, ext)
        if launched is not None:
            launched()
        return self.wait_batch(launch)[0]

    def launch_one(self, position: int, greedy: bool = True, token: int | None = None, lane: int = 0,
                   ext: bool = False) -> BatchLaunch:
        """Enqueue the graphed one-row step (decode) without waiting for it: a runner may enqueue the next step of
        the same sequence (token None: the one this step leaves in out_ids[0]) before it reads this one's token."""
        self._stage(position, token, lane)
        self._graph(greedy, ext).replay(self.stream)
        slot = self._one_slot
        self._one_slot ^= 1
        read = self._READ + 4 * (slot + 1)
        check(driver().cuMemcpyDtoHAsync(self._pinned.ptr + read, self.act["out_ids"].ptr, 4, self.stream.handle),
              "token id")
        self._one_events[slot].record(self.stream)
        return BatchLaunch(1, read, self._one_events[slot])

    def decode_batch(self, rows: list[tuple[int, int, int, Any]], launched: Callable[[], None] | None = None,
                     ext: bool = False) -> list[int]:
        """One batched step: rows of (KV lane, position, token id, sampling params or None for greedy), each the
        next token of its own sequence; returns each row's new token (launch_batch, then wait_batch)."""
        launch = self.launch_batch(rows, ext=ext)
        if launched is not None:
            launched()
        return self.wait_batch(launch)

    def launch_batch(self, rows: list[tuple[int, int, int, Any]], carried: dict[int, int] | None = None,
                     ext: bool = False) -> BatchLaunch:
        """Stage and enqueue one batched forward without waiting for it. The rows run the graph of the smallest
        bucket holding them (17..32 rows: the M = 32 kernels, each weight byte read once for all rows); padding
        rows repeat row 0 (they rewrite its K/V with the same values, and their tokens are dropped). `carried`
        maps a row to a row of the batched launch before this one: that row's input token is the one the previous
        launch computes there (copied on the device; the row's own token id is ignored), so a runner can launch
        step n + 1 before step n's tokens reach the host."""
        n = len(rows)
        if not 1 <= n <= MAX_BATCH:
            raise BackendError(f"a batched decode step of {n} rows: 1..{MAX_BATCH}")
        if len({r[0] for r in rows}) != n or not all(0 <= r[0] < self.lanes for r in rows):
            raise BackendError(f"batched decode: KV lanes {[r[0] for r in rows]} must be distinct, "
                               f"in 0..{self.lanes - 1}")
        carried = carried or {}
        greedy = all(r[3] is None or r[3].greedy for r in rows)
        B = next(b for b in DECODE_BUCKETS if b >= n)
        padded = rows + [rows[0]] * (B - n)
        slot = self._batch_slot
        self._batch_slot ^= 1
        base, M = self._BATCH + slot * self._BATCH_SLOT, MAX_BATCH
        vals = self._pinned.array[base:base + 16 * M].view(np.int32)
        vals[:] = 0
        for i, (lane, pos, tok, _) in enumerate(padded):
            vals[i], vals[M + i], vals[2 * M + i], vals[3 * M + i] = tok, pos, pos + 1, lane
        cu, h, src = driver(), self.stream.handle, self._pinned.ptr + base
        ids, pos_ptr, carry = self.act["ids"].ptr, self.act["positions"].ptr, self.act["carry"].ptr
        check(cu.cuMemcpyHtoDAsync(ids, src, 4 * B, h), "batch token ids")
        check(cu.cuMemcpyHtoDAsync(pos_ptr, src + 4 * M, 4 * B, h), "batch positions")
        check(cu.cuMemcpyHtoDAsync(pos_ptr + 4 * self.max_rows, src + 8 * M, 4 * B, h), "batch sampled positions")
        check(cu.cuMemcpyHtoDAsync(self.act["lanes"].ptr, src + 12 * M, 4 * B, h), "batch KV lanes")
        for dst, first, count in _runs(carried):  # carried ids: runs of consecutive rows, one copy each
            check(cu.cuMemcpyDtoDAsync(ids + 4 * dst, carry + 4 * first, 4 * count, h), "carried token ids")
        if 0 in carried and B > n:  # padding rows repeat row 0's token: copy it once, then double the copies
            check(cu.cuMemcpyDtoDAsync(ids + 4 * n, ids, 4, h), "padding token id")
            done = n + 1
            while done < B:
                count = min(done - n, B - done)
                check(cu.cuMemcpyDtoDAsync(ids + 4 * done, ids + 4 * n, 4 * count, h), "padding token ids")
                done += count
        if not greedy:  # greedy rows of a sampled step: temperature 0 (the sampler's argmax)
            rec = self._pinned.array[base + 16 * M:base + 16 * M + B * SAMPLE_PARAMS.itemsize].view(SAMPLE_PARAMS)
            for i, (_, _, _, sp) in enumerate(padded):
                rec[i] = sample_record(sp)
            check(cu.cuMemcpyHtoDAsync(self.act["params"].ptr, src + 16 * M, B * SAMPLE_PARAMS.itemsize, h),
                  "batch sampling params")
        self._staged.record(self.stream)
        self._captured(f"batch{B}_{'greedy' if greedy else 'sample'}" + ("_ext" if ext else ""),
                       lambda: self.fwd.ops(B, decode=False, last=True, greedy=greedy, batched=True, ext=ext),
                       f"decode x{B}").replay(self.stream)
        out = self.act["out_ids"].ptr
        check(cu.cuMemcpyDtoDAsync(carry, out, 4 * B, h), "tokens to carry")  # (a prefill may reuse out_ids next)
        read = base + self._BATCH_READ
        check(cu.cuMemcpyDtoHAsync(self._pinned.ptr + read, out, 4 * B, h), "batch token ids")
        self._batch_events[slot].record(self.stream)
        return BatchLaunch(n, read, self._batch_events[slot])

    def wait_batch(self, launch: BatchLaunch) -> list[int]:
        """The tokens of a launch_batch (waits for that launch only, not for work enqueued after it)."""
        launch.done.synchronize()
        return [int(t) for t in self._pinned.array[launch.read:launch.read + 4 * launch.rows].view(np.int32)]

    def spec_step(self, start: int, last: int, greedy: bool = True,
                  launched: Callable[[], None] | None = None, lane: int = 0) -> tuple[list[int], list[int]]:
        """One DFlash step for `last` at position `start` (runtime/cuda/speculative.py): returns (15 drafts, the
        target's 16 tokens for positions start+1..start+16). Two graphs (draft; verify + context update)."""
        launch = self.spec_launch(start, last, greedy, lane=lane)
        if launched is not None:
            launched()
        drafts, target, _ = self.spec_wait(launch)
        return drafts, target

    def spec_launch(self, start: int | None, last: int | None = None, greedy: bool = True, lane: int = 0,
                    most: int = BLOCK, emulate: int | None = None, hook_start: int | None = None) -> SpecLaunch:
        """Enqueue one DFlash step without waiting for it. `start` None: the step after the latest one enqueued,
        of the same sequence and rule, at the block that step's acceptance (draft.accept, on the device) chose
        (`hook_start`: that block's start where the host knows it, for draft_hook). Otherwise the block at `start`
        for `last` in KV lane `lane`, under the rule (at most `most` tokens a step, or exactly emulate + 1): what
        the device's acceptance then uses."""
        if not self.speculative:
            raise BackendError("cuda backend: speculative decoding is unavailable: " + "; ".join(self.spec_missing))
        cu, h, S = driver(), self.stream.handle, self._SPEC
        src = self._pinned.ptr + S
        slot = self._spec_slot  # (read-back and forced drafts: a launched-ahead step's copies may still be queued)
        self._spec_slot ^= 1
        if start is not None:  # (rewritten only when no step is in flight: the runner waits for an unused one)
            vals = self._pinned.array[S:S + 512].view(np.int32)
            vals[:BLOCK] = np.arange(start, start + BLOCK)
            vals[BLOCK:2 * BLOCK] = np.arange(start + 1, start + 1 + BLOCK)  # sampled positions
            vals[2 * BLOCK] = last
            vals[4 * BLOCK:5 * BLOCK] = lane
            vals[5 * BLOCK:5 * BLOCK + 2] = (most, -1 if emulate is None else emulate)
            pos, ids = self.act["positions"].ptr, self.act["ids"].ptr
            check(cu.cuMemcpyHtoDAsync(pos, src, 4 * BLOCK, h), "block positions")
            check(cu.cuMemcpyHtoDAsync(self.act["lanes"].ptr, src + 16 * BLOCK, 4 * BLOCK, h), "block KV lanes")
            check(cu.cuMemcpyHtoDAsync(pos + 4 * self.max_rows, src + 4 * BLOCK, 4 * BLOCK, h), "sampled positions")
            check(cu.cuMemcpyHtoDAsync(ids, src + 8 * BLOCK, 4, h), "last token")
            check(cu.cuMemcpyHtoDAsync(self.act["spec_rule"].ptr, src + 20 * BLOCK, 8, h), "acceptance rule")
        events = None if self.spec_timing is None else [self.device.event() for _ in range(3)]
        if events:
            events[0].record(self.stream)
        self._spec_graph("draft", greedy).replay(self.stream)
        if events:
            events[1].record(self.stream)
        if self.draft_hook is not None:
            at = start if start is not None else hook_start
            if at is None:
                raise BackendError("draft_hook: a DFlash step launched ahead without a host-known block start")
            forced = np.asarray(self.draft_hook(at, last), np.int32)
            if forced.shape != (BLOCK - 1,):
                raise BackendError(f"draft_hook returned {forced.shape[0]} drafts, the block needs {BLOCK - 1}")
            off = S + self._SPEC_FORCED + 64 * slot
            self._pinned.array[off:off + 4 * (BLOCK - 1)].view(np.int32)[:] = forced
            check(cu.cuMemcpyHtoDAsync(self.act["ids"].ptr + 4, self._pinned.ptr + off, 4 * (BLOCK - 1), h),
                  "forced drafts")
        self._spec_graph("verify", greedy).replay(self.stream)
        if events:
            events[2].record(self.stream)
        read = self._SPEC_READ + slot * self._SPEC_READ_SLOT
        dst = self._pinned.ptr + read
        check(cu.cuMemcpyDtoHAsync(dst, self.act["ids"].ptr, 4 * BLOCK, h), "drafts")
        check(cu.cuMemcpyDtoHAsync(dst + 4 * BLOCK, self.act["out_ids"].ptr, 4 * BLOCK, h), "verified tokens")
        check(cu.cuMemcpyDtoHAsync(dst + 8 * BLOCK, self.act["spec_acc"].ptr, 4, h), "accepted count")
        self._spec_events[slot].record(self.stream)
        return SpecLaunch(read, self._spec_events[slot], events)

    def spec_wait(self, launch: SpecLaunch) -> tuple[list[int], list[int], int]:
        """A spec_launch's (15 drafts, the target's 16 tokens, the device's committed count): waits for that step
        only, not for one enqueued after it."""
        launch.done.synchronize()
        if launch.timing:
            e = launch.timing
            self.spec_timing.append((e[1].elapsed_ms(e[0]), e[2].elapsed_ms(e[1])))
            for ev in e:
                ev.destroy()
        got = self._pinned.array[launch.read:launch.read + 8 * BLOCK + 4].view(np.int32)
        return [int(t) for t in got[1:BLOCK]], [int(t) for t in got[BLOCK:2 * BLOCK]], int(got[2 * BLOCK])

    def settle(self, launch: BatchLaunch | SpecLaunch) -> None:
        """Wait for a launched step whose tokens nobody reads (a runner's step launched ahead, then not needed)."""
        launch.done.synchronize()
        for ev in getattr(launch, "timing", None) or []:
            ev.destroy()

    def set_logits(self, batch: Any) -> None:
        """Upload a step's logits processing (runtime/logits_params.LogitsBatch) for its rows; every row past them
        (a bucket's padding rows included) only softcaps, so no row reads a previous step's entries. Stream-ordered
        before the next step."""
        if self.ext_missing:
            raise BackendError("cuda backend: logits processing / logprobs need kernels the manifest lacks: "
                               + "; ".join(self.ext_missing))
        recs = np.concatenate([batch.rows] + [plain_row()[None]] * (MAX_BATCH - batch.rows.shape[0]))
        for name, arr in (("logit_rows", recs), ("logit_counts", batch.counts), ("logit_biases", batch.biases),
                          ("logit_masks", batch.masks)):
            buf = self.act[name]
            if arr.nbytes > buf.nbytes:
                raise BackendError(f"cuda backend: this step's {name} need {arr.nbytes} bytes, the engine holds "
                                   f"{buf.nbytes} (logit_bias has at most {MAX_LOGIT_BIAS} entries per request)")
            if arr.nbytes:
                buf.view(0, arr.nbytes).upload(np.ascontiguousarray(arr), stream=self.stream)

    def read_logits(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """After an `ext` step: (lm_process status [rows], top-20 ids [rows, 20], their logprobs, the picked
        token's logprob [rows])."""
        self.stream.synchronize()
        k = MAX_TOP_LOGPROBS
        return (self.act["proc_status"].view(0, 4 * rows).download(np.int32, (rows,)),
                self.act["lp_ids"].view(0, 4 * k * rows).download(np.int32, (rows, k)),
                self.act["lp_lps"].view(0, 8 * k * rows).download(np.float64, (rows, k)),
                self.act["lp_chosen"].view(0, 8 * rows).download(np.float64, (rows,)))

    def _spec_graph(self, which: str, greedy: bool) -> CudaGraph:
        def ops() -> list:
            dfw = DraftForward(self.fwd)
            if which == "draft":
                return dfw.block_ops()
            return dfw.verify_ops(greedy)
        return self._captured("draft" if which == "draft" else f"verify_{'greedy' if greedy else 'sample'}", ops,
                              "DFlash")

    def _read_token(self, launched: Callable[[], None] | None = None) -> int:
        dst = self._pinned.ptr + self._READ
        check(driver().cuMemcpyDtoHAsync(dst, self.act["out_ids"].ptr, 4, self.stream.handle), "token id")
        if launched is not None:
            launched()
        self.stream.synchronize()
        return int(ctypes.c_int32.from_address(dst).value)

    def logits(self) -> np.ndarray:
        """float32 [V] logits (before softcap) of the last forward's last row (tests compare them)."""
        self.stream.synchronize()
        return self.act["logits"].download(np.float32, (self.spec.target.vocab_size,))

    def close(self) -> None:
        """Free everything (idempotent), the uploaded weights included: the engine owns them."""
        if getattr(self, "stream", None) is not None:
            with contextlib.suppress(Exception):  # (after a device error: free what can be freed all the same)
                self.stream.synchronize()  # a batched step launched ahead may still be running
        for g in getattr(self, "_graphs", {}).values():
            g.destroy()
        for name in ("act", "kv", "dw", "_pinned", "_page_rows"):
            r = getattr(self, name, None)
            if r is not None:
                r.free()
        self.kernels.unload()
        for ev in [getattr(self, "_fork_ev", None), getattr(self, "_join_ev", None), getattr(self, "_staged", None),
                   *getattr(self, "_batch_events", []), *getattr(self, "_one_events", []),
                   *getattr(self, "_spec_events", [])]:
            if ev is not None:
                ev.destroy()
        for ev in getattr(self, "_graph_events", []):
            ev.destroy()
        for st in (self.stream, getattr(self, "side", None)):
            if st is not None:
                st.destroy()
        self.weights.free()


def _copy2d(op: Copy2D) -> Any:
    """A callable(stream) issuing the strided device-to-device copy `op` (usable inside a graph capture)."""
    cu = driver()
    p = cu.CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = cu.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcPitch, p.dstDevice, p.dstPitch = op.src.address, op.src_pitch, op.dst.address, op.dst_pitch
    p.WidthInBytes, p.Height = op.width, op.height

    def run(stream: Any) -> None:
        check(cu.cuMemcpy2DAsync(p, stream.handle), op.label)
    run.kernel = None  # type: ignore[attr-defined]  # profile rows name copies by label
    return run


def logprob_entry(ids: np.ndarray, lps: np.ndarray, chosen: np.ndarray, row: int, top: int) -> tuple:
    """Row `row` of read_logits' arrays as a TokenLogprob: (its token's logprob, the `top` best (id, logprob))."""
    return float(chosen[row]), tuple((int(ids[row, j]), float(lps[row, j])) for j in range(top))


def sample_record(sampling: Any) -> np.void:
    """A thorgen::SampleParams record for runtime.backend.SamplingParams (None or greedy: temperature 0)."""
    rec = np.zeros((), SAMPLE_PARAMS)
    rec["top_p"] = 1.0  # (off)
    if sampling is not None and not sampling.greedy:
        rec["temperature"], rec["top_k"] = sampling.temperature, sampling.top_k
        rec["top_p"], rec["min_p"] = sampling.top_p, sampling.min_p
        rec["seed"] = np.uint64(int(sampling.seed or 0) % 2**64)
    return rec


__all__ = ["BatchLaunch", "Engine", "NULL", "SAMPLE_PARAMS", "SpecLaunch", "sample_record"]


class BatchLaunch(NamedTuple):
    """A batched (or one-row) step in flight: its row count, where its tokens land in pinned memory, the event
    after them."""

    rows: int
    read: int
    done: Any


class SpecLaunch(NamedTuple):
    """A DFlash step in flight: where its read-back lands in pinned memory, the event after it, and its timing
    events (draft start, verify start, verify end) when the engine times steps."""

    read: int
    done: Any
    timing: list | None


def _runs(carried: dict[int, int]) -> list[tuple[int, int, int]]:
    """(first row, first source row, count) for each run of consecutive rows carried from consecutive rows."""
    runs: list[list[int]] = []
    for dst in sorted(carried):
        src = carried[dst]
        if runs and runs[-1][0] + runs[-1][2] == dst and runs[-1][1] + runs[-1][2] == src:
            runs[-1][2] += 1
        else:
            runs.append([dst, src, 1])
    return [tuple(r) for r in runs]
