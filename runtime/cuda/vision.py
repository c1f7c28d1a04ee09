"""Runtime stage: `VisionEncoder`, the vision tower on the device: its activations and the vision.encode step program
bound to them (the engine keeps recently encoded images' rows in an ImageRowCache in front of it).

The program (codegen/lower_vision.py) runs one image of N soft tokens (its 9 N patches) as one CUDA graph, captured
per N (the most recent GRAPHS_KEPT kept): one launch from the host instead of ~250. The rows come back to the host
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
    vision_dims,
    vision_tensors,
)
from ..backend import BackendError, ImageInput
from ..convert.artifact import WeightsArtifact
from ..manifest import KernelManifest
from .graphs import CudaGraph
from .kernels import Ptr
from .memory import Arena, ArenaPlan, PinnedBuffer
from .programs import Copy2D, Forward
from .steps import StepParts

GRAPHS_KEPT = 16  # captured encode graphs, by soft-token count

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
    """BackendError unless the image's arrays fit the program (whole 3x3 cells, 1..MAX_SOFT_TOKENS tokens, every
    patch position inside the tower's position table)."""
    n = image.soft_tokens
    patches, positions = np.asarray(image.patches), np.asarray(image.positions)
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
    """The device tower on its own stream, at the least priority: `start(image)` enqueues one image's encode (upload,
    graph, download into pinned memory) and returns at once; `poll()` hands back its rows once the GPU is done, so
    the engine's decode steps run beside an encode instead of waiting for it (where blocks of both wait for
    multiprocessors, the steps' stream, at the greatest priority, goes first). One encode is in flight at a time
    (the tower's activations are one arena). `encode(image)` is the same, waited for."""

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
        self.graphs: OrderedDict[int, CudaGraph] = OrderedDict()  # soft tokens -> the captured encode
        d = self.dims
        # pixels in (float32 [patches, patch_dim]) and rows out (float32 [soft tokens, text hidden]), pinned
        self.pinned_in = PinnedBuffer(4 * d.max_patches * d.patch_dim)
        self.pinned_out = PinnedBuffer(4 * MAX_SOFT_TOKENS * d.text_hidden)
        self.in_flight: ImageInput | None = None
        self._finished: tuple[str, np.ndarray] | None = None  # an encode waited for before poll() asked

    def check(self, image: ImageInput) -> None:
        check_image(self.dims, image)

    def stage(self, image: ImageInput) -> None:
        """Check the image and enqueue the upload of its patches (through pinned memory, written in place by the
        uint8 -> float32 table) and positions on the tower's stream."""
        self.check(image)
        pixels = self.pinned_in.array[: 4 * image.patches.size].view(np.float32).reshape(image.patches.shape)
        image.pixel_values(out=pixels)
        self.arena["vis_patches"].upload(pixels, stream=self.stream)
        self.arena["vis_pos"].upload(np.ascontiguousarray(image.positions, np.int32), stream=self.stream)

    def ops(self, soft_tokens: int) -> list:
        """The encode program's ops for an image of `soft_tokens` soft tokens."""
        return self.fwd.program(VISION_ENCODE, soft_tokens)

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def start(self, image: ImageInput) -> None:
        """Enqueue the image's encode on the tower's stream (the one in flight, if any, is waited for first)."""
        if self.in_flight is not None:
            self._finished = self._collect()
        n = image.soft_tokens
        self.stage(image)
        self._graph(n).replay(self.stream)
        self.arena["vis_out"].download_async(self._rows_view(n), self.stream)
        self.done_event.record(self.stream)
        self.in_flight = image

    def poll(self) -> tuple[str, np.ndarray] | None:
        """(image hash, its rows) of an encode that has completed since the last poll, else None."""
        if self._finished is not None:
            done, self._finished = self._finished, None
            return done
        if self.in_flight is None or not self.done_event.done():
            return None
        return self._collect()

    def wait(self) -> tuple[str, np.ndarray] | None:
        """poll(), waiting for the encode in flight (None when none is)."""
        if self._finished is None and self.in_flight is not None:
            return self._collect()
        return self.poll()

    def _collect(self) -> tuple[str, np.ndarray]:
        image = self.in_flight
        assert image is not None
        self.done_event.synchronize()
        self.in_flight = None
        return image.hash, self._rows_view(image.soft_tokens).copy()

    def _rows_view(self, n: int) -> np.ndarray:
        width = self.dims.text_hidden
        return self.pinned_out.array[: 4 * n * width].view(np.float32).reshape(n, width)

    def encode(self, image: ImageInput) -> np.ndarray:
        """One image through the device tower, waited for (an encode started before is kept for poll())."""
        pending = self._collect() if self.in_flight is not None else None
        self.start(image)
        _, rows = self._collect()
        self._finished = pending
        return rows

    def _graph(self, n: int) -> CudaGraph:
        """The encode of an n-token image as a graph: captured (on the tower's stream) the first time, the least
        recent dropped past GRAPHS_KEPT (each holds ~250 kernel nodes; images of a few sizes are the common
        traffic)."""
        g = self.graphs.get(n)
        if g is None:
            launches = self.parts.launches.bind(self.ops(n), captured=True)
            g = CudaGraph.capture(self.stream, lambda: [l(self.stream) for _, l in launches], f"vision {n}")
            self.graphs[n] = g
            if len(self.graphs) > GRAPHS_KEPT:
                self.graphs.popitem(last=False)[1].destroy()
        self.graphs.move_to_end(n)
        return g

    def destroy(self) -> None:
        if self.in_flight is not None:
            self.done_event.synchronize()
            self.in_flight = None
        for g in self.graphs.values():
            g.destroy()
        self.graphs.clear()
        self.pinned_in.free()
        self.pinned_out.free()
        self.done_event.destroy()
        self.stream.destroy()
        self.arena.free()


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
