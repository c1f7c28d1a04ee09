"""What the repack writes: every output tensor of weights.bin in file order and the jobs that produce it.

What is written (names relative to `model.language_model.`; format in runtime/convert/artifact.py):
  * NVFP4 matrices in the t16x64 tile layout of convert/layouts.py, byte order "shift" (sm_90) or "nat" (sm_100+,
    hardware e2m1 cvt), fused the way the GEMM kernels read them: `self_attn.qkv_proj` (q|k|v, or q|k on k_eq_v
    layers), `self_attn.o_proj`, `mlp.gate_up_proj` (8-row tiles interleaved), `mlp.down_proj`, per layer
    `experts.gate_up_proj` / `experts.down_proj` with a leading expert axis, and `lm_head`. Each matrix M has
    M.weight_packed, M.weight_scale (e4m3), M.weight_tile_scale (f32 global multiplier per 8-row tile, what the
    kernels multiply by) and M.weight_multiplier (f32, each fused part's multiplier as Checkpoint.nvfp4_parts hands
    it out: compressed-tensors' float32(1)/weight_global_scale, ModelOpt's weight_scale_2), so the conversion of
    one checkpoint into the other repacks to the same bytes.
  * Linears the checkpoint stores bf16 (a ModelOpt or bf16 checkpoint), fused the same way: `M.weight_half`, fp16
    (converted once) in the "half_t16x64" layout (convert/linears.py pack_bf16_linear), which the fp16-weight
    GEMMs read, or, with quantize="nvfp4", quantized to NVFP4
    by thorgen's quantizer into the NVFP4 tensors above (each source linear's error kept in `quant_errors`).
  * The tied lm_head quantized to NVFP4 (global scale from the amax of the whole embedding, then 4096-row chunks
    quantized with it, 256 columns at a time: identical to quantizing the table at once) unless lm_head="bf16"
    (kernels then read `embed_tokens.weight`, which is always stored raw bf16 for the embedding lookup).
  * The vision tower (when the spec has one): `vision.*` in model_spec/vision_layout.py's layout, written by
    convert/vision.py's vision_arrays (fp16 GEMM weights in the half layout, zero-padded to the tiles).
  * Norms, router, layer scalars: raw bf16. Drafter (`draft.` prefix): linears as fp16 in the step-major half
    layout of layouts.pack_half (qkv concat, gate/up interleaved), its norms raw bf16.
Streaming: jobs yield (tensor, piece) to weights.ArtifactWriter, and consumed source ranges are released from the
process (madvise), so memory stays flat; the artifact is built in `<out>.tmp-XXXX` and renamed onto `<out>`.
With jobs > 1 the plan's jobs run in spawned worker processes that pwrite at the planned offsets and hash their
own tensors; the file is byte-identical to the one-process run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ...model_spec.checkpoint import Checkpoint
from ...model_spec.nvfp4 import bf16_to_f32, global_scale_for, multiplier_of_divisor, unpack_e2m1
from ...model_spec.tensors import TARGET_PREFIX, drafter_tensors, target_layer_tensors
from ...model_spec.formats import role_of
from ...model_spec.types import ALL_NVFP4, LinearFormats, ModelSpec
from ...model_spec.vision_layout import vision_tensors
from ...model_spec.weight_layout import (
    GROUP,
    GSCALE_ROWS,
    HALF_LAYOUT,
    HALF_SUFFIX,
    PACKED_SUFFIX,
    SCALE_SUFFIX,
    TILE_K,
    TILE_SCALE_SUFFIX,
    W_LAYOUT,
    fp4_order_for,
    nvfp4_sizes,
)
from . import layouts as L
from .linears import pack_bf16_linear, quantize_linear
from .quantize import quantize_bf16
from .artifact import DRAFT_PREFIX, ArtifactError, OutTensor, chunks, release_pages

DEFAULT_ARCH = "sm_90a"  # the H200; the artifact records the arch because the fp4 byte order depends on it
Progress = Callable[[int, int, str], None]  # (bytes done, bytes total, current item)
LM_HEAD_ROW_BLOCK = 16384  # embedding rows quantized at a time (bounds fp32 temporaries and resident pages)


def fp4_order(arch: str) -> str:
    """The fp4 byte order of the kernels built for `arch` (sm_100a and later decode e2m1 in hardware)."""
    try:
        return fp4_order_for(arch)
    except ValueError as exc:
        raise ArtifactError(f"--arch {exc}") from None


def _shift_luts() -> np.ndarray | None:
    """Per byte position r of a 4-byte word, the 32-bit "shift" pattern of each byte value (OR-decomposable)."""
    words = getattr(L, "_shift_words", None)
    if words is None:
        return None
    out = []
    for r in range(4):
        b = np.zeros((256, 4), np.uint8)
        b[:, r] = np.arange(256)
        out.append(words(unpack_e2m1(b)))
    return np.stack(out)


_LUTS = _shift_luts()


def pack_fp4(packed: np.ndarray, scale: np.ndarray, order: str) -> tuple[np.ndarray, np.ndarray]:
    """layouts.pack_nvfp4, with the "shift" order done as 4 table lookups per word on top of the "nat" transpose
    (4x faster on the full model's 12 GB; tests/test_repack.py checks it equals layouts.pack_nvfp4 bit for bit)."""
    if order != "shift" or _LUTS is None:
        return L.pack_nvfp4(packed, scale, order)
    w, s = L.pack_nvfp4(packed, scale, "nat")
    b = w.reshape(-1, 4)
    # np.take without its bounds check (a byte always indexes a 256-entry table), cheaper than b[:, r] indexing
    words = np.take(_LUTS[0], b[:, 0], mode="clip")
    for r in (1, 2, 3):
        words |= np.take(_LUTS[r], b[:, r], mode="clip")
    return words.view(np.uint8), s


# ---- the matrices of the model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Matrix:
    """One stored NVFP4 matrix: `parts` (source short prefixes, rows) fused by `fusion` along N; K inputs."""

    base: str
    fusion: str  # "single", "concat" (stacked rows) or "interleave8" (gate/up 8-row tiles)
    parts: tuple[tuple[str, int], ...]
    k: int
    experts: int = 0  # > 0: one matrix per expert, sources are f"{...}.experts.{e}.{proj}"

    @property
    def n(self) -> int:
        return sum(r for _, r in self.parts)


def target_matrices(spec: ModelSpec, layer: int) -> list[Matrix]:
    t = spec.target
    p, h, hd = f"layers.{layer}.", t.hidden_size, t.layer_head_dim(layer)
    q, kv = t.num_attention_heads * hd, t.layer_kv_heads(layer) * hd
    qkv = ((f"{p}self_attn.q_proj", q), (f"{p}self_attn.k_proj", kv))
    if t.layer_has_v_proj(layer):
        qkv += ((f"{p}self_attn.v_proj", kv),)
    i, ie = t.intermediate_size, t.moe_intermediate_size
    return [
        Matrix(f"{p}self_attn.qkv_proj", "concat", qkv, h),
        Matrix(f"{p}self_attn.o_proj", "single", ((f"{p}self_attn.o_proj", h),), q),
        Matrix(f"{p}mlp.gate_up_proj", "interleave8", ((f"{p}mlp.gate_proj", i), (f"{p}mlp.up_proj", i)), h),
        Matrix(f"{p}mlp.down_proj", "single", ((f"{p}mlp.down_proj", h),), i),
        Matrix(
            f"{p}experts.gate_up_proj",
            "interleave8",
            ((f"{p}experts.gate_proj", ie), (f"{p}experts.up_proj", ie)),
            h,
            t.num_experts,
        ),
        Matrix(f"{p}experts.down_proj", "single", ((f"{p}experts.down_proj", h),), ie, t.num_experts),
    ]


def _src(m: Matrix, part: str, e: int) -> str:
    """Checkpoint prefix of one part (expert e inserted for per-expert matrices)."""
    if m.experts:
        head, proj = part.rsplit(".", 1)
        return f"{TARGET_PREFIX}{head}.{e}.{proj}"
    return TARGET_PREFIX + part


def pack_matrix(
    m: Matrix, parts: list[tuple[np.ndarray, np.ndarray, float]], order: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weights, scales, tile multipliers) of one matrix (one expert) from its parts' (packed, scale, multiplier)."""
    if m.fusion == "interleave8":
        (gp, gs, gm), (up, us, um) = parts
        w, s = pack_fp4(L.interleave8(gp, up), L.interleave8(gs, us), order)
        tiles = np.empty(2 * gp.shape[0] // GSCALE_ROWS, np.float32)
        tiles[0::2] = np.float32(gm)
        tiles[1::2] = np.float32(um)
        return w, s, tiles
    packed = parts[0][0] if len(parts) == 1 else np.concatenate([p for p, _, _ in parts])
    scale = parts[0][1] if len(parts) == 1 else np.concatenate([s for _, s, _ in parts])
    w, s = pack_fp4(packed, scale, order)
    return w, s, L.tile_gscales([(p.shape[0], float(g)) for p, _, g in parts])


# ---- planning ---------------------------------------------------------------------------------------------------

Job = Callable[[], Iterator[tuple[str, np.ndarray]]]


class Planner:
    """The output tensors in file order plus the jobs that produce them (jobs run later, in order)."""

    def __init__(
        self, ckpt: Checkpoint, lm_head: str, arch: str, chunk_cols: int, formats: LinearFormats | None = None
    ) -> None:
        self.ck, self.lm_head, self.arch, self.chunk_cols = ckpt, lm_head, arch, chunk_cols
        self.formats = formats or ckpt.spec.linear_formats  # what the artifact stores per role
        self.order = fp4_order(arch)
        self.tensors: list[OutTensor] = []
        self.jobs: list[tuple[str, int, Job]] = []  # (label, bytes, job)
        self.scales: dict[str, float] = {}
        self.quant_errors: dict[str, dict] = {}  # source linear -> {max_rel, rms_rel} of --quantize nvfp4

    def _add(self, name: str, dtype: str, shape: tuple[int, ...], layout: str = "raw", **meta: object) -> OutTensor:
        t = OutTensor(name, dtype, tuple(int(d) for d in shape), layout, tuple(meta.items()))
        self.tensors.append(t)
        return t

    def raw(self, src: str, name: str, draft: bool = False) -> None:
        arr = self.ck.draft_tensor(src) if draft else self.ck.tensor(src)
        t = self._add(name, {"uint16": "bf16", "float32": "f32", "uint8": "u8"}[arr.dtype.name], arr.shape)
        self.jobs.append((name, t.nbytes, lambda: chunks(name, arr)))

    def _matrix_tensors(self, m: Matrix, n: int, k: int) -> tuple[OutTensor, ...]:
        lead = (m.experts,) if m.experts else ()
        meta = {"logical_shape": [n, k], "fusion": m.fusion, "parts": [list(p) for p in m.parts], "order": self.order}
        codes, scales, tiles = nvfp4_sizes(n, k)
        return (
            self._add(m.base + PACKED_SUFFIX, "u8", lead + (codes,), W_LAYOUT, **meta),
            self._add(m.base + SCALE_SUFFIX, "e4m3", lead + (scales,), W_LAYOUT, **meta),
            self._add(m.base + TILE_SCALE_SUFFIX, "f32", lead + (tiles,)),
            self._add(m.base + ".weight_multiplier", "f32", lead + (len(m.parts),)),
        )

    def stored_matrix(self, m: Matrix) -> None:
        """One matrix in the format its role has in the artifact: NVFP4 (as stored, or quantized from bf16) or bf16."""
        role = role_of(TARGET_PREFIX + m.parts[0][0])
        if getattr(self.formats, role) == "bf16":
            self.bf16_matrix(m)
        else:
            self.matrix(m, quantize=getattr(self.ck.spec.linear_formats, role) == "bf16")

    def _nvfp4_parts(self, src: str, quantize: bool) -> tuple[np.ndarray, np.ndarray, np.float32]:
        if not quantize:
            return self.ck.nvfp4_parts(src)
        w = self.ck.linear_bf16(src)
        parts, error = quantize_linear(w)
        release_pages(w)
        self.quant_errors[src[len(TARGET_PREFIX) :]] = error
        return parts

    def matrix(self, m: Matrix, quantize: bool = False) -> None:
        tp, ts, tt, tg = self._matrix_tensors(m, m.n, m.k)

        def job() -> Iterator[tuple[str, np.ndarray]]:
            gss = np.empty((max(m.experts, 1), len(m.parts)), np.float32)
            for e in range(max(m.experts, 1)):
                parts = [self._nvfp4_parts(_src(m, p, e), quantize) for p, _ in m.parts]
                w, s, tiles = pack_matrix(m, parts, self.order)
                gss[e] = [g for _, _, g in parts]
                yield tp.name, w
                yield ts.name, s
                yield tt.name, tiles
                release_pages(*(a for p in parts for a in p[:2]))
            if not m.experts and len(m.parts) == 1:
                self.scales[tg.name] = float(gss[0, 0])
            yield tg.name, gss if m.experts else gss[0]

        self.jobs.append((m.base + (" (quantize)" if quantize else ""), tp.nbytes + ts.nbytes, job))

    def bf16_matrix(self, m: Matrix) -> None:
        lead = (m.experts,) if m.experts else ()
        t = self._add(
            m.base + HALF_SUFFIX,
            "f16",
            lead + (m.n * m.k,),
            HALF_LAYOUT,
            logical_shape=[m.n, m.k],
            fusion=m.fusion,
            parts=[list(p) for p in m.parts],
        )

        def job() -> Iterator[tuple[str, np.ndarray]]:
            for e in range(max(m.experts, 1)):
                parts = [self.ck.linear_bf16(_src(m, p, e)) for p, _ in m.parts]
                yield t.name, pack_bf16_linear(parts, m.fusion)
                release_pages(*parts)

        self.jobs.append((t.name, t.nbytes, job))

    def lm_head_nvfp4(self) -> None:
        t = self.ck.spec.target
        n, k = t.vocab_size, t.hidden_size
        m = Matrix("lm_head", "single", (("embed_tokens", n),), k)
        tp, ts, tt, tg = self._matrix_tensors(m, n, k)
        # The layout is step-major ([K/64][N/16][...]): packing the columns of whole 64-input steps gives a
        # contiguous piece of the output, and quantizing by columns (16-input blocks, one global scale) is exact.
        cols = max(TILE_K, self.chunk_cols // TILE_K * TILE_K)
        emb_name = TARGET_PREFIX + "embed_tokens.weight"

        def job() -> Iterator[tuple[str, np.ndarray]]:
            rows = LM_HEAD_ROW_BLOCK
            emb = self.ck.tensor(emb_name)
            # Finite bf16 values order like their bit patterns with the sign cleared: amax without converting.
            amax_bits = np.uint16(0)
            for r in range(0, n, rows):
                amax_bits = max(amax_bits, (emb[r : r + rows] & np.uint16(0x7FFF)).max())
                release_pages(emb[r : r + rows])
            if amax_bits >= 0x7F80:
                raise ArtifactError(f"{self.ck.tensor_file(emb_name)}: {emb_name} holds inf/NaN; cannot quantize it")
            g = global_scale_for(float(bf16_to_f32(np.array([amax_bits], np.uint16))[0]))
            mul = multiplier_of_divisor(g)
            self.scales[tg.name] = float(mul)
            for c in range(0, k, cols):
                width = min(cols, k - c)
                packed = np.empty((n, width // 2), np.uint8)
                scale = np.empty((n, width // GROUP), np.uint8)
                for r in range(0, n, rows):  # row blocks bound the resident pages and fp32 temporaries
                    q = quantize_bf16(emb[r : r + rows, c : c + width], global_scale=g)
                    packed[r : r + rows], scale[r : r + rows] = q.packed, q.scale
                    release_pages(emb[r : r + rows])
                w, s = pack_fp4(packed, scale, self.order)
                yield tp.name, w
                yield ts.name, s
            yield tt.name, L.tile_gscales([(n, float(mul))])
            yield tg.name, np.array([mul], np.float32)

        self.jobs.append(("lm_head (quantize)", tp.nbytes + ts.nbytes, job))

    def drafter(self) -> None:
        d = self.ck.spec.drafter
        h, hd, i = d.hidden_size, d.head_dim, d.intermediate_size
        q, kv = d.num_attention_heads * hd, d.num_key_value_heads * hd
        done: set[str] = set()
        for layer in range(d.num_hidden_layers):
            p = f"layers.{layer}."
            for base, fusion, parts, k in (
                (
                    f"{p}self_attn.qkv_proj",
                    "concat",
                    ((f"{p}self_attn.q_proj", q), (f"{p}self_attn.k_proj", kv), (f"{p}self_attn.v_proj", kv)),
                    h,
                ),
                (f"{p}self_attn.o_proj", "single", ((f"{p}self_attn.o_proj", h),), q),
                (f"{p}mlp.gate_up_proj", "interleave8", ((f"{p}mlp.gate_proj", i), (f"{p}mlp.up_proj", i)), h),
                (f"{p}mlp.down_proj", "single", ((f"{p}mlp.down_proj", h),), i),
            ):
                self._half(base, fusion, parts, k)
                done.update(f"{src}.weight" for src, _ in parts)
        self._half("fc", "single", (("fc", h),), len(d.target_layer_ids) * h)
        done.add("fc.weight")
        for info in drafter_tensors(d):
            if info.name not in done:
                self.raw(info.name, DRAFT_PREFIX + info.name, draft=True)

    def vision(self) -> None:
        """The tower's tensors (one job: vision_arrays rewrites the whole tower, ~1.2 GB on the full model)."""
        from .vision import vision_arrays  # (convert/vision.py imports layouts, which this module imports too)

        dtypes = {"half": "f16", "bf16": "bf16", "f32": "f32"}
        out = [
            self._add(name, dtypes[dt], shape, HALF_LAYOUT if dt == "half" else "raw")
            for name, (shape, dt) in vision_tensors(self.ck.spec).items()
        ]

        def job() -> Iterator[tuple[str, np.ndarray]]:
            arrays = vision_arrays(self.ck.spec, self.ck.tensor, lambda n: bf16_or_f32(self.ck.tensor(n)))
            for t in out:
                yield from chunks(t.name, arrays.pop(t.name))

        self.jobs.append(("vision tower", sum(t.nbytes for t in out), job))

    def _half(self, base: str, fusion: str, parts: tuple[tuple[str, int], ...], k: int) -> None:
        n = sum(r for _, r in parts)
        t = self._add(
            DRAFT_PREFIX + base + ".weight",
            "f16",
            (n * k,),
            HALF_LAYOUT,
            logical_shape=[n, k],
            fusion=fusion,
            parts=[[DRAFT_PREFIX + src, rows] for src, rows in parts],
        )

        cols = max(TILE_K, self.chunk_cols // TILE_K * TILE_K)

        def job() -> Iterator[tuple[str, np.ndarray]]:
            # Column pieces of whole 64-input steps are contiguous in the step-major half layout, so converting
            # and packing them one by one keeps the fp32 temporaries small and equals packing the whole matrix.
            srcs = [self.ck.draft_tensor(src + ".weight") for src, _ in parts]
            for c in range(0, k, cols):
                ws = [L.bf16_to_f16_bits(w[:, c : c + cols]) for w in srcs]
                yield (
                    t.name,
                    L.pack_half_gate_up(*ws)
                    if fusion == "interleave8"
                    else L.pack_half(ws[0] if len(ws) == 1 else np.concatenate(ws)),
                )
                release_pages(*srcs)

        self.jobs.append((t.name, t.nbytes, job))


QUANTIZE = ("none", "nvfp4")


def plan_artifact(
    ckpt: Checkpoint, lm_head: str = "nvfp4", arch: str = DEFAULT_ARCH, chunk_cols: int = 256, quantize: str = "none"
) -> Planner:
    """Every output tensor (in file order) and the jobs that produce them. quantize="nvfp4": every linear the
    checkpoint stores bf16 is quantized to NVFP4 (the artifact is then all-NVFP4); "none" keeps them as shipped."""
    if lm_head not in ("nvfp4", "bf16"):
        raise ArtifactError(f"--lm-head {lm_head!r}: choose nvfp4 or bf16")
    if quantize not in QUANTIZE:
        raise ArtifactError(f"--quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
    spec = ckpt.spec
    pl = Planner(ckpt, lm_head, arch, chunk_cols, ALL_NVFP4 if quantize == "nvfp4" else spec.linear_formats)
    pl.raw(TARGET_PREFIX + "embed_tokens.weight", "embed_tokens.weight")
    for layer in range(spec.target.num_hidden_layers):
        for info in target_layer_tensors(spec.target, layer):
            if info.role == "bf16":
                pl.raw(info.name, info.name[len(TARGET_PREFIX) :])
        for m in target_matrices(spec, layer):
            pl.stored_matrix(m)
    pl.raw(TARGET_PREFIX + "norm.weight", "norm.weight")
    if lm_head == "nvfp4":
        pl.lm_head_nvfp4()
    if spec.drafter is not None:
        pl.drafter()
    if spec.vision is not None:
        pl.vision()
    return pl


def bf16_or_f32(arr: np.ndarray) -> np.ndarray:
    """A checkpoint tensor stored BF16 (uint16 bits) or F32, as float32."""
    return bf16_to_f32(arr) if arr.dtype == np.uint16 else np.asarray(arr, np.float32)
