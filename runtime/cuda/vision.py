"""Runtime stage: `VisionEncoder`, the vision tower on the device: its activations and the vision.encode step programs
bound to them (the engine keeps recently encoded images' rows in an ImageRowCache in front of it).

A program (codegen/lower_vision.py) runs B images of one patch grid, N soft tokens (9 N patches) each, back to back
(B N <= MAX_SOFT_TOKENS, so the activations sized for the largest image hold them; B <= MAX_ENCODE_IMAGES): one
pass over the tower's weights for them all, each image's rows the same bits as its encode alone. It runs as a few
CUDA graphs (pieces of bounded work), captured per (N, B) (the most recent GRAPHS_KEPT kept): a handful of launches
from the host instead of ~250. The rows come back to the host
(f32 [N, text hidden], 3.2 MB for a 280-token image on the full model), which keeps them across steps and
preemption, and the engine stages them into a prefill chunk's residual rows.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ...model_spec.step_program import program_key
from ...model_spec.types import ModelSpec
from ...model_spec.vision_layout import (
    MAX_SOFT_TOKENS,
    PATCH_ACTS,
    TOKEN_ACTS,
    VISION_ENCODE,
    VisionDims,
    act_width,
    encode_images_limit,
    vision_dims,
    vision_encode_key,
    vision_tensors,
)
from ..backend import BackendError, ImageInput, patch_width
from ..convert.artifact import WeightsArtifact
from ..manifest import KernelManifest
from .graphs import CudaGraph
from .device import Stream
from .kernels import Ptr
from .memory import Arena, ArenaPlan, PinnedBuffer
from .programs import Copy2D, Forward
from .steps import StepParts

GRAPHS_KEPT = 16  # captured encodes, by (soft-token count, images)
# An encode beside running sequences goes in pieces of this much tensor work, one between two steps: ~3 ms of the
# tower at the ~200 TFLOP/s it runs at on an H100, so each step waits at most that long for it.
PIECE_FLOP = 0.6e12

if TYPE_CHECKING:
    from .buffers import EngineBuffers


def plan_vision(spec: ModelSpec) -> ArenaPlan:
    """The tower's activations, sized for the largest image (MAX_SOFT_TOKENS soft tokens, 9x as many patches):
    ~0.56 GB on the full model."""
    d, p = vision_dims(spec), ArenaPlan("vision activations")
    for acts, rows in ((PATCH_ACTS, d.max_patches), (TOKEN_ACTS, MAX_SOFT_TOKENS)):
        for name, (width, dtype) in acts.items():
            p.add_array(name, (rows, act_width(d, width)), dtype)
    return p


def vision_missing(spec: ModelSpec, artifact: WeightsArtifact, fwd: Forward) -> list[str]:
    """Why an engine with these weights and programs cannot encode images (empty: it can)."""
    if spec.vision is None:
        return [f"model {spec.name} has no vision tower"]
    lacking = [n for n in vision_tensors(spec) if n not in artifact.tensors]
    if lacking:
        return [f"the repacked weights hold no vision tower ({lacking[0]} ...): repack them again"]
    keys = [program_key(last=False, images=True)] + [program_key(greedy=g, images=True) for g in (True, False)]
    return fwd.missing("vision", VISION_ENCODE, *keys)


class _Pointers:
    """The vision program's symbols: weights in the engine's upload, activations in the tower's arena."""

    def __init__(self, buffers: EngineBuffers, arena: Arena) -> None:
        self.buffers, self.arena = buffers, arena

    def W(self, name: str, byte_offset: int = 0) -> Ptr:
        return self.buffers.W(name, byte_offset)

    def A(self, name: str, row: int = 0) -> Ptr:
        r = self.arena.plan.regions[name]
        return Ptr(self.arena[name].ptr + row * (r.nbytes // r.shape[0]))

    def KV(self, layer: int, which: str) -> Ptr:
        raise BackendError("cuda backend: the vision program addresses no KV cache; rebuild with `thorgen build`")

    DKV = KV

    def lane_bytes(self, layer: int) -> int:
        return 0

    def dlane_bytes(self, layer: int) -> int:
        return 0


def check_image(d: VisionDims, image: ImageInput) -> None:
    """BackendError unless the image's arrays fit the program (uint8 pixels, whole 3x3 cells, 1..MAX_SOFT_TOKENS
    tokens, every patch position inside the tower's position table)."""
    n = image.soft_tokens
    patches, positions = np.asarray(image.patches), np.asarray(image.positions)
    if patches.dtype != np.uint8:
        raise BackendError(f"image patches of {patches.dtype}: the vision program takes uint8 pixels")
    if not 1 <= n <= MAX_SOFT_TOKENS:
        raise BackendError(f"image of {n} soft tokens: the vision program runs 1..{MAX_SOFT_TOKENS}")
    if patches.shape != (d.pool_rows * n, d.patch_dim) or positions.shape != (d.pool_rows * n, 2):
        raise BackendError(
            f"image patches {patches.shape} / positions {positions.shape}: expected "
            f"[{d.pool_rows * n}, {d.patch_dim}] / [{d.pool_rows * n}, 2] for {n} soft tokens"
        )
    if positions.min() < 0 or positions.max() >= d.table:
        raise BackendError(
            f"image patch positions {positions.min()}..{positions.max()} leave the position table of {d.table}"
        )


class VisionEncoder:
    """The device tower: `start(images, pieces)` enqueues one encode of a few images of one patch grid (upload,
    graphs, download into pinned memory) and returns at once; `poll()` hands back their rows once the GPU is done;
    `wait()` waits for them. One encode is in flight at a time (the tower's activations are one arena);
    `encode(image)` is start + wait of one image. `images_per_encode(image)` says how many of its grid one start
    takes.

    Alone (`pieces` False) the whole encode goes on the tower's own stream, at the least priority. Beside running
    sequences (`pieces` True) it goes on the engine's stream one piece of ~PIECE_FLOP at a time, one piece per
    poll() (the scheduler polls once a step): the tower's blocks run for up to hundreds of microseconds, and a
    decode step sharing the GPU with them waits on them at every one of its ~300 launches, so interleaving bounded
    pieces between the steps is what keeps the running streams' inter-token time to one step plus one piece."""

    def __init__(self, parts: StepParts, spec: ModelSpec, manifest: KernelManifest, buffers: EngineBuffers) -> None:
        self.parts, self.spec = parts, spec
        self.dims = vision_dims(spec)
        self.arena = Arena(parts.device, plan_vision(spec))
        self.fwd = Forward(spec, manifest, parts.fwd.kv_dtype, parts.max_rows)  # (its own program, its own pointers)
        self.fwd.ptr = _Pointers(buffers, self.arena)
        self.stream = parts.device.stream(priority="least")
        self.done_event = parts.device.event(timing=False)
        self.arena.buffer.zero(self.stream)
        self.stream.synchronize()
        self.graphs: OrderedDict[tuple[int, int], list[CudaGraph]] = OrderedDict()  # (N, B) -> the encode's pieces
        self.piece_flop = PIECE_FLOP
        d = self.dims
        # pixels in (uint8 [patches, patch_dim]) and rows out (float32 [soft tokens, text hidden]), pinned
        self.pinned_in = PinnedBuffer(d.max_patches * d.patch_dim)
        self.pinned_out = PinnedBuffer(4 * MAX_SOFT_TOKENS * d.text_hidden)
        self.in_flight: list[ImageInput] = []
        self._pieces: list[CudaGraph] = []  # the encode in flight's pieces not yet enqueued
        self._on = self.stream  # the stream the encode in flight runs on
        self._finished: list[tuple[str, np.ndarray]] = []  # an encode waited for before poll() asked

    def check(self, image: ImageInput) -> None:
        check_image(self.dims, image)

    def images_per_encode(self, image: ImageInput) -> int:
        """The most images of `image`'s patch grid one encode takes: within the activations and the programs the
        manifest holds (one built before there were several: 1)."""
        held = (
            b for b in range(encode_images_limit(image.soft_tokens), 1, -1) if vision_encode_key(b) in self.fwd.programs
        )
        return next(held, 1)

    def stage(self, images: Sequence[ImageInput], stream: Stream) -> None:
        """Check the images (one patch grid, no more than an encode takes) and enqueue the upload of their uint8
        patches (through pinned memory; the first kernel scales them) and positions on `stream`, back to back."""
        for image in images:
            self.check(image)
        first = images[0]
        if any(i.soft_tokens != first.soft_tokens or patch_width(i) != patch_width(first) for i in images):
            raise BackendError("cuda backend: one encode takes images of one patch grid")
        if not 1 <= len(images) <= self.images_per_encode(first):
            raise BackendError(
                f"cuda backend: an encode of {first.soft_tokens}-token images takes 1..{self.images_per_encode(first)}"
                f" of them, not {len(images)}"
            )
        patches = np.concatenate([i.patches for i in images])
        pixels = self.pinned_in.array[: patches.size].reshape(patches.shape)
        np.copyto(pixels, patches)
        self.arena["vis_patches"].upload(pixels, stream=stream)
        positions = np.concatenate([np.asarray(i.positions, np.int32) for i in images])
        self.arena["vis_pos"].upload(np.ascontiguousarray(positions), stream=stream)

    def ops(self, soft_tokens: int, images: int = 1) -> list:
        """The encode program's ops for `images` images of `soft_tokens` soft tokens each."""
        return self.fwd.program(vision_encode_key(images), soft_tokens)

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def start(self, images: Sequence[ImageInput], pieces: bool = False) -> None:
        """Enqueue the encode of `images` (one patch grid; the encode in flight, if any, is waited for first): whole
        on the tower's stream, or in `pieces` on the engine's (the first now, one more each poll())."""
        if self.in_flight:
            self._finished += self._collect()
        self._on = self.parts.stream if pieces else self.stream
        self.stage(images, self._on)
        self._pieces = list(self._graph(images[0].soft_tokens, len(images)))
        self.in_flight = list(images)
        self._enqueue(everything=not pieces)

    def _enqueue(self, everything: bool) -> None:
        """The next piece (or all that are left); after the last, the rows' download and the done event."""
        while self._pieces:
            self._pieces.pop(0).replay(self._on)
            if not everything:
                break
        if not self._pieces and self.in_flight:
            self.arena["vis_out"].download_async(self._rows_view(self._out_rows()), self._on)
            self.done_event.record(self._on)

    def _out_rows(self) -> int:
        return sum(i.soft_tokens for i in self.in_flight)

    def poll(self) -> list[tuple[str, np.ndarray]]:
        """(image hash, its rows) of each image of an encode that has completed since the last poll, else []
        (enqueueing the next piece of one in pieces)."""
        if self._finished:
            done, self._finished = self._finished, []
            return done
        if not self.in_flight:
            return []
        if self._pieces:
            self._enqueue(everything=False)
            return []
        return self._collect() if self.done_event.done() else []

    def wait(self) -> list[tuple[str, np.ndarray]]:
        """poll(), waiting for the encode in flight (its pieces left enqueued at once; [] when none is)."""
        if not self._finished and self.in_flight:
            return self._collect()
        return self.poll()

    def _collect(self) -> list[tuple[str, np.ndarray]]:
        images = self.in_flight
        assert images
        self._enqueue(everything=True)
        self.done_event.synchronize()
        rows = self._rows_view(self._out_rows())
        self.in_flight = []
        out, at = [], 0
        for image in images:  # each image's rows, back to back
            out.append((image.hash, rows[at : at + image.soft_tokens].copy()))
            at += image.soft_tokens
        return out

    def _rows_view(self, n: int) -> np.ndarray:
        width = self.dims.text_hidden
        return self.pinned_out.array[: 4 * n * width].view(np.float32).reshape(n, width)

    def encode(self, image: ImageInput) -> np.ndarray:
        """One image through the device tower, waited for (an encode started before is kept for poll())."""
        pending = self._collect() if self.in_flight else []
        self.start([image])
        ((_, rows),) = self._collect()
        self._finished = self._finished + pending
        return rows

    def _graph(self, n: int, images: int) -> list[CudaGraph]:
        """The encode of `images` n-token images as graphs, one per piece: captured (on the tower's stream) the
        first time, the least recent shape dropped past GRAPHS_KEPT (each holds ~250 kernel nodes; images of a few
        sizes are the common traffic)."""
        key = (n, images)
        g = self.graphs.get(key)
        if g is None:
            g = []
            for i, piece in enumerate(encode_pieces(self.ops(n, images), self.piece_flop)):
                launches = self.parts.launches.bind(piece, captured=True)
                g.append(
                    CudaGraph.capture(
                        self.stream,
                        lambda ls=launches: [l(self.stream) for _, l in ls],
                        f"vision {images}x{n} piece {i}",
                    )
                )
            self.graphs[key] = g
            if len(self.graphs) > GRAPHS_KEPT:
                for old in self.graphs.popitem(last=False)[1]:
                    old.destroy()
        self.graphs.move_to_end(key)
        return g

    def destroy(self) -> None:
        if self.in_flight:
            self._enqueue(everything=True)
            self.done_event.synchronize()
            self.in_flight = []
        for pieces in self.graphs.values():
            for g in pieces:
                g.destroy()
        self.graphs.clear()
        self.pinned_in.free()
        self.pinned_out.free()
        self.done_event.destroy()
        self.stream.destroy()
        self.arena.free()


def op_flop(op) -> float:
    """The tensor-core work of one encode launch: its GEMM or attention FLOPs (the row kernels' is negligible)."""
    name, param = op.entry.name, op.entry.param
    if name.startswith("vis_gemm"):
        return 2.0 * op.rows * param("n") * param("k")
    if name.startswith("vis_attn"):  # (rows: an image's patches; B images)
        return 4.0 * op.rows * op.rows * param("NH") * param("DC") * int(op.args.get("B", 1))
    return 0.0


def encode_pieces(ops: list, piece_flop: float) -> list[list]:
    """The encode's launches in order, cut into pieces of at most `piece_flop` (a launch larger than that is a
    piece by itself): ~2 pieces a layer at 1120 soft tokens, ~5 layers a piece at 280."""
    pieces: list[list] = [[]]
    work = 0.0
    for op in ops:
        flop = op_flop(op)
        if pieces[-1] and work + flop > piece_flop:
            pieces.append([])
            work = 0.0
        pieces[-1].append(op)
        work += flop
    return pieces


def chunk_images(images: Sequence[tuple[int, np.ndarray]], start: int, end: int) -> list[tuple[int, np.ndarray]]:
    """(row in the chunk, rows [N, H]) of the images (prompt position, rows) inside positions start..end-1;
    BackendError for one the chunk would split (its tokens attend to each other both ways)."""
    out = []
    for pos, rows in images:
        if pos < end and pos + len(rows) > start:
            if pos < start or pos + len(rows) > end:
                raise BackendError(
                    f"cuda backend: a prefill chunk {start}..{end} splits the image at positions "
                    f"{pos}..{pos + len(rows)}"
                )
            out.append((pos - start, rows))
    return out


def stage_images(
    buffers: EngineBuffers, stream, spans: list[tuple[int, np.ndarray]], start: int, rows: int
) -> list[Copy2D]:
    """Upload a chunk's image rows (into img_rows at their chunk rows) and its key bounds (kv_hi: each row's
    position, an image row's the last position of its image), stream-ordered before the chunk; returns the
    copies of the image rows into x that follow the embed launch."""
    act = buffers.act
    width = buffers.spec.target.hidden_size * 4
    kv_hi = np.arange(start, start + rows, dtype=np.int32)
    copies = []
    for r, emb in spans:
        n = len(emb)
        act["img_rows"].view(r * width, n * width).upload(np.ascontiguousarray(emb, np.float32), stream=stream)
        kv_hi[r : r + n] = start + r + n - 1
        copies.append(
            Copy2D(
                f"image rows {r}..{r + n}",
                buffers.A("img_rows", r),
                n * width,
                buffers.A("x", r),
                n * width,
                n * width,
                1,
            )
        )
    act["kv_hi"].view(0, 4 * rows).upload(kv_hi, stream=stream)
    return copies


__all__ = ["VisionEncoder", "chunk_images", "plan_vision", "stage_images", "vision_missing"]
