"""Runtime stage: the CUDA engine — one weight upload, static buffers, chunked prefill and graphed decode steps.

Everything is allocated once (runtime/cuda/buffers.py: weights, KV cache, activations for up to `max_step_tokens`
rows), so every pointer is fixed and each decode step is captured as a CUDA graph (runtime/cuda/launch_lists.py;
one per mode: greedy, sampled, and per batch bucket). A one-row step embeds the previous step's `out_ids[0]` and
reads its position from device memory (small async copies from the pinned staging ring, runtime/cuda/staging.py),
so between steps only the new token id (4 bytes) crosses to the host. Steps are launched (`launch_one`,
`launch_batch`, `dflash.launch`) and waited for (`wait`, `dflash.wait`) separately: a runner enqueues step n + 1
before it reads step n. The launches come from runtime/cuda/programs.py; a manifest lacking any kernel they need
stops the engine at start, naming all. DFlash speculative decoding (runtime/cuda/dflash.py) adds, when the model
has a drafter and its kernels are built, the drafter's KV cache and buffers, its k|v weights cut out of the fused
q|k|v, tap capture in prefill, and two 16-row graphs per step; otherwise `spec_missing` says what is absent.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from ...model_spec.conventions import MAX_BATCH, SAMPLE_PARAMS
from ...model_spec.step_program import DRAFT_CONTEXT, program_key
from ...model_spec.types import ModelSpec
from ..backend import MAX_TOP_LOGPROBS, BackendError, ImageRowCache, SamplingParams, check_image_spans
from ..convert.artifact import WeightsArtifact
from ..engine.sequence import Sequence as EngineSequence
from ..manifest import KernelManifest
from .buffers import MAX_LOGIT_BIAS, EngineBuffers, plan_activations
from .device import Device, check, driver
from .kernels import KernelSet
from .kv_cache import plan_kv
from .launch_lists import LaunchLists
from .logits_params import LogitsBatch, logprob_entry, plain_row
from .memory import DeviceBuffer
from ..options import EngineOptions
from .dflash import DFlashSteps, DraftForward
from .programs import Forward
from .staging import ENGINE_SLOTS, Slot, StagingRing
from .steps import DecodeSteps, StepParts, sample_record
from .pieces import PrefillPieces
from .vision import VisionEncoder, chunk_images, stage_images, vision_missing


class Engine:
    """Device resources of one model and its step launches (runtime/cuda/profile.py times a step)."""

    def __init__(
        self,
        spec: ModelSpec,
        device: Device,
        manifest: KernelManifest,
        artifact: WeightsArtifact,
        weights: DeviceBuffer,
        ctx: int,
        kv_dtype: str = "bf16",
        lanes: int = 1,
        pages: int | None = None,
        options: EngineOptions = EngineOptions(),
    ) -> None:
        self.spec, self.device, self.manifest, self.art, self.weights = spec, device, manifest, artifact, weights
        self.ctx, self.lanes, self.options = ctx, lanes, options
        if not 1 <= lanes <= MAX_BATCH:
            raise BackendError(f"cuda backend: {lanes} sequences at once; batched decode steps hold 1..{MAX_BATCH}")
        self.max_rows = manifest.max_step_tokens
        # the steps' streams at the greatest priority: the vision tower's encodes (VisionEncoder, the least) run
        # beside them, and where blocks of both wait for multiprocessors the steps' go first
        self.side = device.stream(priority="greatest")
        self.stream = device.stream(priority="greatest")
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
            raise BackendError(
                "cuda backend: the kernel manifest lacks what the forward needs: "
                + "; ".join(missing)
                + ". Rebuild with `thorgen build` once those kernel families exist"
            )
        self.kernels.load_all()
        self.launches = LaunchLists(
            device, self.kernels, self.stream, self.side, options, pdl_safe=bool(manifest.conventions.get("pdl", False))
        )
        kv = plan_kv(
            spec, ctx, kv_dtype, drafter=self.speculative, conventions=manifest.conventions, lanes=lanes, pages=pages
        )
        self.buffers = EngineBuffers(
            spec,
            device,
            self.stream,
            manifest,
            artifact,
            weights,
            kv,
            self.max_rows,
            ctx,
            not self.ext_missing,
            self.speculative,
        )
        self.fwd.ptr = self.buffers  # the programs bind real buffers from now on
        self.pieces = PrefillPieces(device, self.act)  # a chunk run a few layers at a time (prefill_piece)
        self.staging = StagingRing(ENGINE_SLOTS)
        parts = StepParts(device, self.stream, self.act, self.fwd, self.launches, self.staging, self.max_rows)
        self.steps = DecodeSteps(parts, lanes)
        self.dflash = DFlashSteps(parts) if self.speculative else None  # (its test and bench hooks live there)
        # Image input is optional too: without the tower's weights or programs, requests with images are refused
        self.vision_missing = vision_missing(spec, artifact, self.fwd)
        self.vision = None if self.vision_missing else VisionEncoder(parts, spec, manifest, self.buffers)
        self.encoder_cache = None if self.vision is None else ImageRowCache(self.vision)

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

    @property
    def act(self):
        return self.buffers.act

    @property
    def kv(self):
        return self.buffers.kv

    @property
    def pitch(self) -> int:
        return self.buffers.pages.pitch

    def check_request(self, seq: EngineSequence) -> None:
        """BackendError for a sequence (runtime/engine/sequence.py) this engine cannot run: speculative without a
        drafter, logits processing without its kernels, images without the tower or larger than a prefill chunk,
        prompt ids or logit_bias ids outside the vocabulary; makes its grammar's matcher."""
        sampling = seq.sampling
        if seq.speculative and not self.speculative:
            raise BackendError(
                "cuda backend: speculative (DFlash) decoding is unavailable: "
                + "; ".join(self.spec_missing)
                + "; use --no-speculative"
            )
        if sampling.extended or sampling.prompt_logprobs is not None:
            if self.ext_missing:
                raise BackendError(
                    f"{sampling.describe_extended()} needs kernels this build lacks ("
                    + "; ".join(self.ext_missing)
                    + "); rebuild with `thorgen build`"
                )
            if len(sampling.logit_bias) > MAX_LOGIT_BIAS:
                raise BackendError(f"logit_bias has {len(sampling.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        if seq.images:
            if self.vision is None:
                raise BackendError(
                    "cuda backend: images need the vision tower on the device: " + "; ".join(self.vision_missing)
                )
            if sampling.prompt_logprobs is not None:
                raise BackendError("cuda backend: prompt logprobs of a prompt with images are not supported")
            for span in seq.images:
                self.vision.check(span.image)
            if max(s.end - s.offset for s in seq.images) > self.max_rows:
                raise BackendError(
                    f"cuda backend: an image of more than {self.max_rows} soft tokens does not fit one prefill chunk"
                )
            # the placeholders and the images must agree (a prompt without images keeps its ids as text, as before)
            assert self.spec.vision is not None
            check_image_spans(seq.prompt, seq.images, self.spec.vision.placeholder_ids)
        seq.prepare(self.spec.target.vocab_size)

    def map_pages(self, lane: int, first: int, pages: list[int]) -> None:
        """Page-table entries first.. of `lane` = `pages` (buffers.PageTable.map)."""
        self.buffers.pages.map(lane, first, pages)

    # ---- inputs of the next step --------------------------------------------------------------------------------
    def set_sampling(self, sampling: SamplingParams) -> None:
        """Every row's SampleParams from one request's SamplingParams (what single-sequence steps sample with)."""
        rec = np.zeros(MAX_BATCH, SAMPLE_PARAMS)
        rec[:] = sample_record(sampling)
        self.act["params"].upload(rec.view(np.uint8), stream=self.stream)  # ordered before the next step's sampler

    def set_logits(self, batch: LogitsBatch) -> None:
        """Upload a step's logits processing (runtime/logits_params.LogitsBatch) for its rows; every row past them
        (a bucket's padding rows included) only softcaps, so no row reads a previous step's entries. Stream-ordered
        before the next step."""
        if self.ext_missing:
            raise BackendError(
                "cuda backend: logits processing / logprobs need kernels the manifest lacks: "
                + "; ".join(self.ext_missing)
            )
        recs = np.concatenate([batch.rows] + [plain_row()[None]] * (MAX_BATCH - batch.rows.shape[0]))
        for name, arr in (
            ("logit_rows", recs),
            ("logit_counts", batch.counts),
            ("logit_biases", batch.biases),
            ("logit_masks", batch.masks),
        ):
            buf = self.act[name]
            if arr.nbytes > buf.nbytes:
                raise BackendError(
                    f"cuda backend: this step's {name} need {arr.nbytes} bytes, the engine holds "
                    f"{buf.nbytes} (logit_bias has at most {MAX_LOGIT_BIAS} entries per request)"
                )
            if arr.nbytes:
                buf.view(0, arr.nbytes).upload(np.ascontiguousarray(arr), stream=self.stream)

    # ---- prefill and scoring --------------------------------------------------------------------------------------
    def prefill(
        self,
        prompt: list[int],
        greedy: bool = True,
        taps: bool = False,
        launched: Callable[[], None] | None = None,
        begin: int = 0,
        lane: int = 0,
        ext: bool = False,
        images: Sequence[tuple[int, np.ndarray]] = (),
    ) -> int:
        """Run the prompt (positions begin..P-1; the K/V of 0..begin-1 is already cached) in chunks of
        max_step_tokens rows; returns the first new token. `taps`: also capture the DFlash taps and project them
        into the drafter's context cache (speculative). `launched()` runs once everything is enqueued, before
        the wait for the token: host work done there (streaming the previous step's tokens) costs no GPU time.
        `images`: (prompt position, float32 rows [N, H]) of the images (VisionEncoder.encode) replacing those
        positions' embeddings; a chunk holding one runs the image program (its sliding layers' keys bounded per
        query, runtime/cuda/vision.py stage_images) and must hold it whole."""
        if taps and not self.speculative:
            raise BackendError("cuda backend: speculative decoding is unavailable: " + "; ".join(self.spec_missing))
        n = len(prompt)
        if not 0 <= begin < n:
            raise BackendError(f"prefill from position {begin} of a {n}-token prompt: at least one token must run")
        for start in range(begin, n, self.max_rows):
            rows = min(self.max_rows, n - start)
            last = start + rows == n
            spans = chunk_images(images, start, start + rows) if images else []
            if rows == 1 and not taps and not spans:  # the graphed step handles a single row (it embeds out_ids[0])
                self.steps.stage_row(start, prompt[start], lane)
                self.steps.row_graph(greedy if last else True, ext and last).replay(self.stream)
                continue
            self._stage_chunk(prompt, start, rows, lane)
            self.launches.run(self._chunk_launches(spans, start, rows, last, greedy, taps, ext))
        return self._first_token(launched)

    def prefill_piece(
        self,
        prompt: list[int],
        greedy: bool = True,
        taps: bool = False,
        launched: Callable[[], None] | None = None,
        begin: int = 0,
        lane: int = 0,
        ext: bool = False,
        images: Sequence[tuple[int, np.ndarray]] = (),
    ) -> int | None:
        """`prefill` of the prompt's last chunk (positions begin..P-1, at most max_rows) a few layers at a time
        (runtime/cuda/pieces.py): each call runs the chunk's next piece and returns None, and the call after the
        last piece returns the first new token, copied out behind that piece. (Read in the last piece's call, it
        would hold the decoders' step behind the piece and the one before it: on an H200 that step took 16.4 ms
        against 9.6-9.9 ms for the others, ~3.7 ms of them the decode.) A chunk another call started, unless of the
        same lane (then it was scheduled anew and starts again), keeps its pieces: this one then waits (returns None,
        nothing run)."""
        n = len(prompt)
        spans = chunk_images(images, begin, n) if images else []
        key = (lane, begin, n, greedy, taps, ext, tuple((r, len(e)) for r, e in spans))
        held = self.pieces.chunk
        if held is not None and held.key != key and held.key[0] == lane:
            self.pieces.drop()
        if not 0 <= begin < n or n - begin > self.max_rows:
            return self.prefill(prompt, greedy, taps, launched, begin, lane, ext, images)
        if self.pieces.busy(key):
            if launched is not None:
                launched()
            return None
        rows, chunk = n - begin, self.pieces.current(key)
        if chunk is not None and chunk.token is not None:
            return self._piece_token(chunk.token, launched)
        self._stage_chunk(prompt, begin, rows, lane)
        if chunk is None:
            shape, ops = self._chunk_ops(spans, begin, rows, True, greedy, taps, ext)
            chunk = self.pieces.begin(key, shape, ops, rows)
        # (each piece of a shape bound once: binding a piece's ~150 launches took milliseconds of Python, while
        # the decoders waited)
        self.launches.run(self.pieces.next_piece(chunk, self.launches.bind))
        if self.pieces.finished(chunk):
            chunk.token = self._token_out("piece_token")
            self.pieces.sampled_event.record(self.stream)
        if launched is not None:
            launched()
        return None

    def _piece_token(self, slot: Slot, launched: Callable[[], None] | None) -> int:
        """The token a chunk's last piece sampled and copied to `slot` (prefill_piece), once the piece is done."""
        if launched is not None:
            launched()
        self.pieces.sampled_event.synchronize()
        self.pieces.drop()
        return int(slot.record["tokens"][0])

    def _stage_chunk(self, prompt: list[int], start: int, rows: int, lane: int) -> None:
        """A chunk's token ids, positions (and its end after them) and lanes. Stream-ordered copies: a synchronous
        cuMemcpyHtoD runs on the legacy stream, which this non-blocking stream does not wait for (from pageable
        memory it may return before the DMA lands), so the chunk's kernels could read the previous chunk's
        ids/positions. Pageable sources are staged at the call."""
        ids = np.asarray(prompt[start : start + rows], np.int32)
        self.act["ids"].view(0, ids.nbytes).upload(ids, stream=self.stream)
        pos = self.act["positions"]
        pos.view(0, 4 * rows).upload(np.arange(start, start + rows, dtype=np.int32), stream=self.stream)
        pos.view(4 * self.max_rows, 4).upload(np.array([start + rows], np.int32), stream=self.stream)
        self.act["lanes"].view(0, 4 * rows).upload(np.full(rows, lane, np.int32), stream=self.stream)

    def _token_out(self, kind: str) -> Slot:
        """The next `kind` staging slot, the chunk's sampled token (out_ids[0]) copied into it in stream order."""
        slot = self.staging.next(kind)
        check(driver().cuMemcpyDtoHAsync(slot.at("tokens"), self.act["out_ids"].ptr, 4, self.stream.handle), "token id")
        return slot

    def _first_token(self, launched: Callable[[], None] | None) -> int:
        """The token the last chunk sampled, read once `launched()` ran beside the GPU's work."""
        slot = self._token_out("prefill_token")
        if launched is not None:
            launched()
        self.stream.synchronize()
        return int(slot.record["tokens"][0])

    def _chunk_launches(
        self, spans: list, start: int, rows: int, last: bool, greedy: bool, taps: bool, ext: bool
    ) -> list[tuple[str, Any]]:
        """A chunk's launch list: a text chunk's, one per kind of chunk and program row range, set for `rows`
        (LaunchLists.eager_rows: chunks of new sizes bind nothing); one holding images, one per shape."""
        if spans:
            return self.launches.eager(*self._chunk_ops(spans, start, rows, last, greedy, taps, ext))
        ext = ext and last
        keys = [program_key(last=last, greedy=greedy, taps=taps, ext=ext), *([DRAFT_CONTEXT] if taps else [])]
        return self.launches.eager_rows(
            ("text", last, greedy, taps, ext),
            rows,
            self.fwd.span(keys, rows),
            lambda r: self._text_ops(r, last, greedy, taps, ext),
        )

    def _chunk_ops(
        self, spans: list, start: int, rows: int, last: bool, greedy: bool, taps: bool, ext: bool
    ) -> tuple[tuple, Callable[[], list]]:
        """A chunk's images staged (if it holds any), and (the key of its launch list by shape, what builds the
        list): the image program with its rows' copies, or the text one."""
        ext = ext and last
        if spans:
            copies = stage_images(self.buffers, self.stream, spans, start, rows)
            key = (rows, last, greedy, taps, ext, *((r, len(e)) for r, e in spans))
            return key, lambda: self._image_ops(rows, last, greedy, taps, ext, copies)
        return (rows, last, greedy, taps, ext), lambda: self._text_ops(rows, last, greedy, taps, ext)

    def _text_ops(self, rows: int, last: bool, greedy: bool, taps: bool, ext: bool) -> list:
        """A text chunk's launches (and the drafter's context projection of its taps)."""
        ops = self.fwd.ops(rows, decode=False, last=last, greedy=greedy, taps=taps, ext=ext and last)
        return ops + (DraftForward(self.fwd).ctx_ops(rows) if taps else [])

    def _image_ops(self, rows: int, last: bool, greedy: bool, taps: bool, ext: bool, copies: list) -> list:
        """A chunk holding images: the image program, the image rows copied into x right after the embed."""
        ops = self.fwd.ops(rows, decode=False, last=last, greedy=greedy, taps=taps, ext=ext, images=True)
        if not ops or ops[0].label != "embed":
            raise BackendError(
                "cuda backend: the image prefill program does not start with the embed launch; "
                "rebuild with `thorgen build`"
            )
        return ops[:1] + copies + ops[1:] + (DraftForward(self.fwd).ctx_ops(rows) if taps else [])

    def score_prompt(self, seq: EngineSequence, start: int, end: int) -> int:
        """A prefill chunk [start, end) of a sequence whose prompt gets logprobs: the rows that predict prompt
        tokens (start..scored-1) run through `score` into seq.prompt_logprobs; returns `scored`, where the
        chunk's prefill goes on (its last row samples the first token)."""
        scored = seq.scored_upto(start, end) - 1
        if scored > start:
            assert seq.prompt_logprobs is not None and seq.lane is not None
            top = seq.sampling.prompt_logprobs or 0
            seq.prompt_logprobs += self.score(seq.tokens, start, scored, top, seq.lane)
            return scored
        return start

    def image_rows(self, seq: EngineSequence, start: int, end: int) -> list[tuple[int, np.ndarray]]:
        """(prompt position, rows) of the images of `seq` in positions start..end-1, through the encoder cache."""
        if self.encoder_cache is None:
            return []
        return [(s.offset, self.encoder_cache.rows(s.image)) for s in seq.images if s.offset < end and s.end > start]

    def score(self, tokens: list[int], start: int, stop: int, top: int, lane: int = 0) -> list:
        """Prompt logprobs: run positions start..stop-1 of `tokens` (the K/V of 0..start-1 cached) and return,
        for each, the TokenLogprob of the token after it (tokens[p + 1]) with the `top` most likely ids.
        Batched forwards of up to MAX_BATCH consecutive positions in one lane (Forward.ops `score`)."""
        if not 0 <= start < stop < len(tokens):  # position p needs tokens[p + 1]
            raise BackendError(f"score positions {start}..{stop - 1} of {len(tokens)} tokens")
        if self.ext_missing:
            raise BackendError(
                "cuda backend: prompt logprobs need kernels the manifest lacks: " + "; ".join(self.ext_missing)
            )
        out = []
        for r0 in range(start, stop, MAX_BATCH):
            rows = min(MAX_BATCH, stop - r0)
            put = [
                (self.act["ids"], tokens[r0 : r0 + rows]),
                (self.act["positions"], range(r0, r0 + rows)),
                (self.act["lanes"], [lane] * rows),
                (self.act["out_ids"], tokens[r0 + 1 : r0 + 1 + rows]),
            ]
            for buf, vals in put:
                arr = np.asarray(vals, np.int32)
                buf.view(0, arr.nbytes).upload(arr, stream=self.stream)
            self.launches.run(
                self.launches.eager(
                    ("score", rows), lambda: self.fwd.ops(rows, decode=False, last=True, batched=True, score=True)
                )
            )
            _, ids, lps, chosen = self.read_logits(rows)
            out += [logprob_entry(ids, lps, chosen, r, top) for r in range(rows)]
        return out

    # ---- outputs ----------------------------------------------------------------------------------------------------
    def read_logits(self, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """After an `ext` step: (lm_process status [rows], top-20 ids [rows, 20], their logprobs, the picked
        token's logprob [rows])."""
        self.stream.synchronize()
        k = MAX_TOP_LOGPROBS
        return (
            self.act["proc_status"].view(0, 4 * rows).download(np.int32, (rows,)),
            self.act["lp_ids"].view(0, 4 * k * rows).download(np.int32, (rows, k)),
            self.act["lp_lps"].view(0, 8 * k * rows).download(np.float64, (rows, k)),
            self.act["lp_chosen"].view(0, 8 * rows).download(np.float64, (rows,)),
        )

    def logits(self) -> np.ndarray:
        """float32 [V] logits (before softcap) of the last forward's last row (tests compare them)."""
        self.stream.synchronize()
        return self.act["logits"].download(np.float32, (self.spec.target.vocab_size,))

    def close(self) -> None:
        """Free everything (idempotent), the uploaded weights included: the engine owns them."""
        if getattr(self, "stream", None) is not None:
            with contextlib.suppress(Exception):  # (after a device error: free what can be freed all the same)
                self.stream.synchronize()  # a batched step launched ahead may still be running
        for part in ("vision", "dflash", "steps", "launches", "pieces"):
            if getattr(self, part, None) is not None:
                getattr(self, part).destroy()
                setattr(self, part, None)
        for part in ("buffers", "staging"):
            if getattr(self, part, None) is not None:
                getattr(self, part).free()
                setattr(self, part, None)
        self.kernels.unload()
        for name in ("stream", "side"):
            if getattr(self, name, None) is not None:
                getattr(self, name).destroy()
                setattr(self, name, None)
        self.weights.free()


# (MAX_LOGIT_BIAS, SAMPLE_PARAMS and plan_activations: the names callers import from here)
__all__ = ["MAX_LOGIT_BIAS", "SAMPLE_PARAMS", "Engine", "EngineOptions", "plan_activations"]
