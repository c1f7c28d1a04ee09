"""Codegen stage: the attention family — decode / verify (split-K flash-decoding + combine) and prefill, for the
target's sliding and full layers (bf16 and fp8 e4m3 KV caches) and the DFlash drafter's hybrid-mask layers.

One template (attn_fwd.cu.j2 over thorgen/attention.cuh) serves all: a block holds R = 16*MT query rows = QB
queries x all G query heads of one KV head (GQA: each K/V tile is read once for its G heads), warps split the head
dim (64 columns each), K/V tiles of TK keys are double-buffered through shared memory, softmax is online in fp32.
  attn_dec__...  m <= 16 queries (consecutive, or rowwise: one per sequence), NSPLIT key splits (grid z) so short
                 batches still fill the SMs. Given `counters` (u32 [cnt_words], zeroed by the runtime once, left zeroed)
                 the last split block of each (query block, KV head) merges the splits in the same launch
                 (thorgen/attn_split.cuh; two levels of NSUB subgroups when a group's partials are large): the decode
                 step (m = 1) uses that. With counters null the partials stay in the workspace and attn_comb__ merges
                 them, one block per (query, head) row: faster for m = 16 (verify, drafter block), where one block per
                 group would read megabytes.
  attn_pre__...  prefill chunks (m <= MAX_STEP_TOKENS), NSPLIT = 1, causal + window skip work per query block.
Cache conventions (families/__init__.py): [slot][Hkv][D], sliding rings of ring_slots(window) slots, the target's
full layers paged (page > 0: pages of KV_PAGE positions, the page table `pages` of `pitch` entries a sequence).
"""

from __future__ import annotations

import math
from functools import cache

from ...model_spec.conventions import VERIFY_ROWS as VERIFY_M
from ...model_spec.types import ModelSpec
from ..arch import ArchSpec
from ...model_spec.bench_args import Buf, Scalar
from ..kernel_spec import BenchCase, KernelSpec, make_params
from . import KV_DTYPES, KV_PAGE, MAX_STEP_TOKENS, page_pitch, ring_slots
from ._util import require

TK = 32
# Key tiles a split part holds at least, for one query (a decode step, a batched step's row: the same partition in
# both, for batch invariance). A batched step pays a part's fixed cost (partial write, state restart, merge) per part,
# the one-query decode gains blocks from small parts; the full layers' parts (head dim 512, 8 query heads a KV head)
# cost the most. Measured on the H200 (docs/benchmarks/NOTES.md).
TPP_SLIDING, TPP_FULL = 2, 4
FWD_ARGS = ("q", "kc", "vc", "positions", "m", "out", "ws", "counters", "lanes", "lane_bytes", "pages", "rowwise")
COMBINE_ARGS = ("ws", "m", "out")
KV_ENUM = {"bf16": "KV_BF16", "fp8e4m3": "KV_FP8"}


def attn_smem(d: int, mt: int, tk: int, kv: str) -> int:
    """Must equal thorgen::AttnSmem<...>::BYTES (the template static_asserts it)."""
    nw, r, tp = d // 64, 16 * mt, d + 8
    tile = tk * tp * 2
    fp8 = kv == "fp8e4m3"
    return (
        (1 if fp8 else 2) * 2 * tile
        + (2 * 2 * tk * (d + 16) if fp8 else 0)
        + nw * r * (tk + 8) * 4
        + r * (tk + 8) * 2
        + 3 * r * 4
    )


def nsub_for(nsplit: int) -> int:
    """Level-1 subgroups of a two-level split merge: about sqrt(nsplit) (a power of two), so that each merging block
    reads ~sqrt(nsplit) parts instead of nsplit; 1 (one level) for few splits."""
    return 1 << ((nsplit.bit_length() - 1) // 2) if nsplit >= 8 else 1


def _mt(g: int, d: int, m: int) -> int:
    """m-tiles per block: 2 (32 rows) when the group is large enough to fill them, else 1."""
    return 2 if g * m >= 32 and d <= 512 else 1


@cache
def attn_kernels(
    role: str,
    *,
    d: int,
    hq: int,
    hkv: int,
    window: int,
    ring: int,
    causal: bool,
    kv: str,
    scale: float,
    nsplit: int,
    arch: ArchSpec,
    page: int = 0,
    pitch: int = 0,
    tpp: int = 1,
    pre_mmax: int = MAX_STEP_TOKENS,
    kv_hi: bool = False,
    blocks: int = 1,
) -> tuple[KernelSpec, KernelSpec]:
    """(decode / verify kernel, prefill kernel of up to `pre_mmax` queries) of one attention shape. `kv_hi`: the
    prefill kernel takes per-query upper key bounds (kv_hi, i32 [m]: an image span's queries see the whole span).
    `blocks` > 1 (a batched draft step): the decode kernel takes up to that many blocks of VERIFY_ROWS queries, each
    its own sequence's (attention.cuh's SEG), with the one-block kernel's tiling and splits (the same bits)."""
    require(d % 64 == 0 and d <= 512, f"attention {role}: head_dim {d} must be a multiple of 64, at most 512")
    require(hq % hkv == 0 and 16 % (hq // hkv) == 0, f"attention {role}: group {hq}/{hkv} must divide 16")
    require(not (page and ring) and bool(page) == bool(pitch), f"attention {role}: a paged cache is not a ring")
    require(not kv_hi or causal, f"attention {role}: per-query key bounds extend a causal mask")
    g = hq // hkv
    out = []
    common = dict(
        d=d,
        hq=hq,
        hkv=hkv,
        window=window,
        ring=ring,
        page=page,
        pitch=pitch,
        causal=causal,
        kv_dtype=kv,
        kv_enum=KV_ENUM[kv],
        scale=float(scale),
        scale_log2=float(scale) * math.log2(math.e),
        tpp=tpp,
    )
    cache = f"ring{ring}" if ring else f"p{page}" if page else "lin"
    mask = ("c" if causal else "b") + (f"w{window}" if window else "")
    for what, mmax, ns in (("dec", VERIFY_M * blocks, nsplit), ("pre", pre_mmax, 1)):
        # 32-key tiles (measured on the H200); where they do not fit (sm_120a: 99 KB per block at head dim 512),
        # one m-tile and 16-key tiles. (Blocks: a segment's tiling.)
        mt, tk = _mt(g, d, VERIFY_M if blocks > 1 and what == "dec" else mmax), TK
        if attn_smem(d, mt, tk, kv) > arch.smem_per_block_max:
            mt = 1
        while attn_smem(d, mt, tk, kv) > arch.smem_per_block_max and tk > 16:
            tk //= 2
        qb = 16 * mt // g
        smem = attn_smem(d, mt, tk, kv)
        require(smem <= arch.smem_per_block_max, f"attention {role}: {smem} B shared memory exceeds {arch.name}")
        name = (
            f"attn_{what}__{role}_d{d}_h{hq}x{hkv}_{mask}_{cache}_{kv}"
            + (f"_s{ns}" if ns > 1 else "")
            + (f"_t{tk}" if tk != TK else "")
            + ("_kvhi" if kv_hi and what == "pre" else "")
            + (f"_x{blocks}" if blocks > 1 and what == "dec" else "")
        )
        gx, nsub = math.ceil(mmax / qb), nsub_for(ns)
        # a batched decode step (rowwise: a block per query) of r rows launches ROWWISE_SPLITS[r - 1] <= ns splits
        seg = dict(seg=VERIFY_M) if blocks > 1 and what == "dec" else {}
        require(not seg or VERIFY_M % qb == 0, f"attention {role}: {qb}-query blocks must divide a {VERIFY_M}-row one")
        rowwise = (
            tuple(_rowwise_splits(r, hkv, ns, smem, arch) for r in range(1, mmax + 1))
            if what == "dec" and not seg
            else ()
        )
        rules = dict(ROW_GRID=(0, 1, qb), ROWWISE_GRID=(0, 1, 1)) | (dict(ROWWISE_SPLITS=rowwise) if rowwise else {})
        require(ns % nsub == 0, f"attention {role}: {nsub} merge subgroups must divide {ns} splits")
        # workspace: the splits' partials (O [D] + (max, sum) per row) then the level-1 merged parts
        # early (decode / verify of the target): cache rows older than the step load before griddepcontrol.wait
        # (no kernel of a target step writes them; the drafter's context rows are written in the step that attends
        # them); prefill chunks keep the plain order (with it and the row skip there, TTFT at 2,048 tokens was 130.5 ms
        # on the H200 against 128.4 without)
        early = role.startswith("tgt_") and what == "dec"
        bounds = dict(kv_hi=True) if kv_hi and what == "pre" else {}
        out.append(
            KernelSpec(
                name,
                "attn_fwd.cu.j2",
                make_params(
                    mt=mt,
                    tk=tk,
                    nsplit=ns,
                    nsub=nsub,
                    mmax=mmax,
                    grid_x=gx,
                    early=early,
                    **rules,
                    ws_floats=((ns + nsub) * mmax * hq * (d + 2)) if ns > 1 else 0,
                    # one merge group per (query block, KV head); rowwise (batched
                    # decode) launches have a block per query, up to mmax of them
                    cnt_words=mmax * hkv * (nsub + 1) if ns > 1 else 0,
                    **common,
                    **bounds,
                    **seg,
                ),
                grid=(gx, hkv, ns),
                block=(32 * (d // 64), 1, 1),
                smem_bytes=smem,
                args=FWD_ARGS + (("kv_hi",) if bounds else ()),
                family="attention",
            )
        )
    return out[0], out[1]


@cache
def attn_combine(dec: KernelSpec) -> KernelSpec:
    """The merge of a split decode kernel's partials for launches of more than one query (a block per query and
    head)."""
    d, hq, ns, mmax = (dec.param(p) for p in ("d", "hq", "nsplit", "mmax"))
    threads = min(d, 256)
    return KernelSpec(
        f"attn_comb__d{d}_h{hq}_s{ns}_m{mmax}",
        "attn_combine.cu.j2",
        make_params(d=d, hq=hq, nsplit=ns, mmax=mmax, threads=threads, ROW_GRID=(0, hq, 1)),
        grid=(mmax * hq, 1, 1),
        block=(threads, 1, 1),
        args=COMBINE_ARGS,
        family="attention",
    )


def _rowwise_splits(rows: int, hkv: int, nsplit: int, smem: int, arch: ArchSpec) -> int:
    """Key splits of a rowwise launch of `rows` queries: the largest power of two (at most nsplit) whose rows x KV
    heads x splits blocks fit the SMs in one wave. Each block's fixed cost (Q load, partial write, merge) is paid
    per split, so once the rows fill the machine, more splits only add blocks: 16 rows over 32 splits measured
    88 us a sliding layer on the H200 (4096 blocks of under one 32-key tile each)."""
    resident = max(1, (arch.smem_per_block_max + 1024) // (smem + 1024))  # blocks an SM holds by shared memory
    ns = 1
    while ns * 2 <= nsplit and rows * hkv * ns * 2 <= arch.sm_count * resident:
        ns *= 2
    return ns


def _nsplit(blocks_per_split: int, arch: ArchSpec, max_tiles: int | None) -> int:
    """Key splits so that one decode step (M = 1) fills every SM, never more than the keys' tiles."""
    ns = max(1, math.ceil(arch.sm_count / max(1, blocks_per_split)))
    ns = 1 << (ns - 1).bit_length()  # power of two
    return min(ns, 64, max_tiles or 64)


@cache
def target_attention(
    spec: ModelSpec, arch: ArchSpec, layer: int, kv: str, prefill: bool, kv_hi: bool = False
) -> KernelSpec:
    """Target layer `layer`'s attention over a `kv` cache: the decode / verify kernel (up to 16 queries, or a batched
    step's rows), or with `prefill` the chunk kernel; `kv_hi` (a sliding layer's chunk holding an image): the chunk
    kernel with per-query upper key bounds."""
    t = spec.target
    d, hkv, window = t.layer_head_dim(layer), t.layer_kv_heads(layer), t.layer_window(layer) or 0
    max_tiles = math.ceil((window + VERIFY_M) / TK) if window else None
    page = 0 if window else KV_PAGE  # the full layers are paged
    dec, pre = attn_kernels(
        "tgt_" + t.layer_types[layer][0],
        d=d,
        hq=t.num_attention_heads,
        hkv=hkv,
        window=window,
        ring=ring_slots(window) if window else 0,
        causal=True,
        kv=kv,
        scale=1.0,
        nsplit=_nsplit(hkv, arch, max_tiles),
        arch=arch,
        page=page,
        pitch=page_pitch(t.max_position_embeddings) if page else 0,
        tpp=TPP_SLIDING if window else TPP_FULL,
        kv_hi=kv_hi,
    )
    return pre if prefill or kv_hi else dec


@cache
def drafter_attention(spec: ModelSpec, arch: ArchSpec, layer: int, blocks: int = 1) -> KernelSpec:
    """Drafter layer `layer`'s attention of the 16-slot block (bf16 cache), or with `blocks` > 1 of up to that
    many sequences' blocks at once (a batched draft step: each its own lane, positions and block mask)."""
    dr = spec.drafter
    window = dr.layer_window(layer) or 0
    dec, _ = attn_kernels(
        "dft_" + dr.layer_types[layer][0],
        d=dr.head_dim,
        hq=dr.num_attention_heads,
        hkv=dr.num_key_value_heads,
        window=window,
        ring=ring_slots(window) if window else 0,
        causal=dr.is_causal(layer),
        kv="bf16",
        scale=dr.head_dim**-0.5,
        nsplit=_nsplit(dr.num_key_value_heads, arch, None),
        arch=arch,
        blocks=blocks,
    )
    return dec


def bench_attention(spec: ModelSpec, arch: ArchSpec) -> list[BenchCase]:
    """Decode (M = 1) and verify (M = 16) at a 4096-token context over the target layers' caches."""
    cases = []
    ctx = 4096
    t = spec.target
    firsts = [t.layer_types.index(kind) for kind in dict.fromkeys(t.layer_types)]
    for k in (target_attention(spec, arch, l, kv, prefill=False) for l in firsts for kv in KV_DTYPES):
        d, hq, hkv, ring = k.param("d"), k.param("hq"), k.param("hkv"), k.param("ring")
        page, pitch = k.param("page"), k.param("pitch")
        eb = 2 if k.param("kv_dtype") == "bf16" else 1
        slots = ring or ctx + VERIFY_M
        # a paged cache: one sequence whose pages are the pool's first ones in order (the identity page table)
        pages = Buf("pages", "i32", pitch, values=tuple(range(pitch))) if page else Buf("pages", "i32", 0)
        window = k.param("window")
        for m in (1, VERIFY_M):
            keys = min(ctx + m, (window + m - 1) if window else ctx + m)
            args = (
                Buf("q", "bf16", m * hq * d),
                Buf("kc", "u8", slots * hkv * d * eb),
                Buf("vc", "u8", slots * hkv * d * eb),
                Buf("positions", "i32", m, ctx, ctx + 1),
                Scalar("m", "i32", m),
                Buf("out", "f16", m * hq * d),
                Buf("ws", "f32", max(1, k.param("ws_floats"))),
                Buf("counters", "u32", max(1, k.param("cnt_words")), 0, 0),
                Buf("lanes", "i32", 0),
                Scalar("lane_bytes", "i64", 0),
                pages,
                Scalar("rowwise", "i32", 0),
            )
            if m > 1:  # the runtime merges 16-query splits with attn_comb (counters null)
                args = tuple(Buf("counters", "u32", 0) if getattr(a, "name", "") == "counters" else a for a in args)
            cases.append(
                BenchCase(
                    k,
                    args,
                    bytes_moved=2 * keys * hkv * d * eb + m * hq * d * 4,
                    note=f"M={m}, ctx {ctx}, " + ("merge fused" if m == 1 else "+attn_comb"),
                )
            )
    return cases
