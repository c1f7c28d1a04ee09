"""Runtime stage: GPU KV cache planning (sizes per layer, bf16 or fp8 e4m3, pages and rings) and allocation.

Layout (the kernels' convention, copied into the kernel manifest as `conventions`): per layer a K cache and a V
cache, each `[slot][kv_head][head_dim]`. The target's full-attention layers are paged: one pool of `pages` pages of
KV_PAGE positions that every sequence draws from (slot = page table[lane][pos / KV_PAGE] * KV_PAGE + pos % KV_PAGE;
the engine owns the page table, the engine core's KV manager (runtime/engine/kv_manager.py) the pages), so a long
context costs only what it uses and a shared prefix is held once. Sliding layers are rings (slot = position % slots)
of `window + max_step_tokens` slots: one forward step (a prefill chunk of up to max_step_tokens, or a 16-token
verify block) writes all its keys before its queries read the `window - 1` older keys they still need, so the ring
holds both; a plain 1024-slot ring would let a chunk overwrite keys its own first queries read. Full k_eq_v layers
still store V separately (V = v_norm(k) is not K). The DFlash drafter's context cache is planned too when asked
(always bf16: the drafter is precision-sensitive). Lanes: the target's rings hold `lanes` sequences, each layer's
lanes one after another (`lane = [slot][kv_head] [head_dim]`, `k_bytes` apart), so a batched decode step reads and
writes every sequence in the same launches; for a paged layer a lane is a row of the page table. The drafter context
has a lane per sequence too (its layers are linear or rings, never paged): the draft state follows its sequence, so
a speculative sequence keeps its context through batched steps and across requests (the prefix cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...model_spec.conventions import KV_PAGE, max_step_tokens  # (a manifest's conventions win over the defaults)
from ...model_spec.conventions import ring_slots as default_ring_slots
from ...model_spec.types import ModelSpec
from ..backend import BackendError
from ..engine.kv_manager import KVGeometry
from ..options import DEFAULT_CTX
from .device import check, driver
from .memory import Arena, ArenaPlan, DeviceBuffer

KV_DTYPES = {"bf16": ("bf16", 2), "fp8": ("fp8e4m3", 1), "fp8e4m3": ("fp8e4m3", 1), "e4m3": ("fp8e4m3", 1)}


def kv_dtype(name: str) -> tuple[str, int]:
    """(canonical kernel dtype name, bytes per element) for a --kv-dtype value."""
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise BackendError(f"--kv-dtype {name!r} is not supported (bf16, fp8)") from None


@dataclass(frozen=True)
class LayerKV:
    model: str  # "target" or "drafter"
    layer: int
    ring: bool  # True: slot = pos % slots (sliding window); False: slot = pos
    slots: int
    kv_heads: int
    head_dim: int
    dtype: str
    elem_bytes: int
    window: int | None = None  # a sliding layer's window (keys a query sees); None: full attention
    paged: bool = False  # True: `slots` are the pool's pages x KV_PAGE, shared by all lanes through the page table

    @property
    def row_bytes(self) -> int:
        """Bytes of one position of K (or V): kv_heads * head_dim elements."""
        return self.kv_heads * self.head_dim * self.elem_bytes

    @property
    def k_bytes(self) -> int:
        return self.slots * self.row_bytes

    @property
    def nbytes(self) -> int:
        return 2 * self.k_bytes  # K and V

    def slot(self, pos: int) -> int:
        """The slot of `pos` in a ring or linear cache (a paged one maps it through the page table)."""
        return pos % self.slots if self.ring else pos


@dataclass(frozen=True)
class KVPlan:
    ctx: int
    dtype: str
    layers: tuple[LayerKV, ...]
    lanes: int = 1  # sequences the target's caches hold (each of up to `ctx` tokens)
    pages: int = 0  # pages of KV_PAGE positions in the paged layers' pool (0: no paged layer)

    def lanes_of(self, l: LayerKV) -> int:
        return 1 if l.paged else self.lanes

    @property
    def nbytes(self) -> int:
        return sum(l.nbytes * self.lanes_of(l) for l in self.layers)

    @property
    def lane_nbytes(self) -> int:
        """Bytes one more lane costs (the target's rings and the drafter context of one sequence)."""
        return sum(l.nbytes for l in self.layers if not l.paged)

    @property
    def page_nbytes(self) -> int:
        """Bytes one more page costs (K and V of KV_PAGE positions in every paged layer)."""
        return sum(2 * KV_PAGE * l.row_bytes for l in self.layers if l.paged)

    @property
    def seq_pages(self) -> int:
        """Pages of one sequence at the full context (0 without paged layers)."""
        return -(-self.ctx // KV_PAGE) if any(l.paged for l in self.layers) else 0

    def target(self) -> list[LayerKV]:
        return [l for l in self.layers if l.model == "target"]

    def drafter(self) -> list[LayerKV]:
        return [l for l in self.layers if l.model == "drafter"]

    def geometry(self, lanes: int | None = None, tokens: int | None = None) -> KVGeometry:
        """The cache as the engine core's KV manager sees it: `lanes` (a runner's, at most the plan's) and the
        pages of `tokens` positions (at most the pool's)."""
        rings = tuple((l.window, l.slots) for l in self.layers if l.ring and l.window is not None)
        pages = self.pages if tokens is None else min(self.pages, -(-tokens // KV_PAGE))
        return KVGeometry(min(lanes or self.lanes, self.lanes), self.ctx, pages, rings, KV_PAGE)

    def summary(self) -> str:
        t = sum(l.nbytes * self.lanes_of(l) for l in self.target())
        d = sum(l.nbytes * self.lanes_of(l) for l in self.drafter())
        pages = f", {self.pages} pages of {KV_PAGE} positions" if self.pages else ""
        return (
            f"KV cache ctx {self.ctx} {self.dtype} x {self.lanes} sequence(s){pages}: target {t / 2**30:.2f} GiB"
            + (f", drafter {d / 2**30:.2f} GiB" if d else "")
            + f", total {self.nbytes / 2**30:.2f} GiB"
        )


def ring_slots(window: int, conventions: dict | None = None) -> int:
    """Slots of a sliding layer's ring: the manifest's value when given, else the conventions' rule with the
    manifest's (or the default) max step tokens."""
    conv = conventions or {}
    table = conv.get("ring_slots") or {}
    if str(window) in table:
        return int(table[str(window)])
    return default_ring_slots(window, max_step_tokens(conv))


def plan_kv(
    spec: ModelSpec,
    ctx: int = DEFAULT_CTX,
    dtype: str = "bf16",
    drafter: bool = False,
    conventions: dict | None = None,
    lanes: int = 1,
    pages: int | None = None,
) -> KVPlan:
    """Per-layer KV sizes for `lanes` sequences of up to `ctx` tokens whose paged layers share `pages` pages
    (default: every lane's full context); pure arithmetic, BackendError for an invalid ctx."""
    t = spec.target
    if lanes < 1:
        raise BackendError(f"a KV cache of {lanes} sequences: at least 1 is needed")
    if ctx < 1:
        raise BackendError(f"--ctx {ctx} must be at least 1")
    if ctx > t.max_position_embeddings:
        raise BackendError(f"--ctx {ctx} exceeds the model's max_position_embeddings ({t.max_position_embeddings})")
    name, size = kv_dtype(dtype)
    layers = []
    seq_pages = -(-ctx // KV_PAGE)
    pages = lanes * seq_pages if pages is None else pages
    if pages < 0:
        raise BackendError(f"a KV page pool of {pages} pages")
    for l in range(t.num_hidden_layers):
        window = t.layer_window(l)
        if window is None:  # full attention: the paged pool
            layers.append(
                LayerKV(
                    "target",
                    l,
                    False,
                    pages * KV_PAGE,
                    t.layer_kv_heads(l),
                    t.layer_head_dim(l),
                    name,
                    size,
                    None,
                    paged=True,
                )
            )
            continue
        ring = ring_slots(window, conventions) < ctx
        slots = ring_slots(window, conventions) if ring else ctx
        layers.append(LayerKV("target", l, ring, slots, t.layer_kv_heads(l), t.layer_head_dim(l), name, size, window))
    if drafter:
        d = spec.drafter
        if d is None:
            raise BackendError(f"model {spec.name} has no drafter; cannot plan a drafter KV cache")
        for l in range(d.num_hidden_layers):
            window = d.layer_window(l)
            ring = window is not None and ring_slots(window, conventions) < ctx
            slots = ring_slots(window, conventions) if ring else ctx  # type: ignore[arg-type]
            layers.append(LayerKV("drafter", l, ring, slots, d.num_key_value_heads, d.head_dim, "bf16", 2, window))
    return KVPlan(ctx, name, tuple(layers), lanes, pages if any(l.paged for l in layers) else 0)


def fit_kv(
    one: KVPlan, max_num_seqs: int, available: int, kv_cache_gib: float | None = None, headroom: float = 0.9
) -> tuple[int, int]:
    """(lanes, pages) of the KV cache in `--kv-cache-gib`, or by default `headroom` of the `available` bytes
    beside the weights (`one`: a plan of one lane). Lanes are `max_num_seqs`, or fewer when their rings and one
    full-context sequence's pages do not fit; the pages fill the rest, up to every lane's full context.
    BackendError, naming the numbers, when --kv-cache-gib exceeds what is available or holds no sequence."""
    gib_ = 2.0**30
    if kv_cache_gib is not None:
        if kv_cache_gib <= 0:
            raise BackendError(f"--kv-cache-gib {kv_cache_gib} must be positive")
        if kv_cache_gib * gib_ > available:
            raise BackendError(
                f"--kv-cache-gib {kv_cache_gib} exceeds the {available / gib_:.2f} GiB free on the "
                "GPU beside the weights; lower it (or leave it out: the default fits)"
            )
        budget = kv_cache_gib * gib_
    else:
        budget = available * headroom
    lane, page, full = one.lane_nbytes, one.page_nbytes, one.seq_pages
    seq = lane + full * page  # one more sequence at the full context
    lanes = min(max_num_seqs, int((budget - full * page) // lane) if lane else max_num_seqs)
    if lanes < 1 or budget < seq:
        where = (
            f"--kv-cache-gib {kv_cache_gib}"
            if kv_cache_gib is not None
            else f"the {budget / gib_:.2f} GiB free beside the weights"
        )
        raise BackendError(
            f"one sequence's KV cache at --ctx {one.ctx} ({seq / gib_:.2f} GiB) does not "
            f"fit {where}; lower --ctx or free GPU memory"
        )
    pages = min(lanes * full, int((budget - lanes * lane) // page)) if page else 0
    return lanes, pages


def check_context(prompt_len: int, ctx: int) -> None:
    """BackendError when a prompt cannot fit the KV cache (it needs room for at least one generated token)."""
    if prompt_len < 1:
        raise BackendError("the prompt is empty: at least one token (e.g. <bos>) is needed")
    if prompt_len >= ctx:
        raise BackendError(
            f"the prompt has {prompt_len} tokens but the context (--ctx) holds {ctx}; "
            f"shorten the prompt or raise --ctx above {prompt_len}"
        )


class KVCache:
    """The planned caches in one device allocation; `k(model, layer)` / `v(model, layer)` are buffer views."""

    def __init__(self, device, plan: KVPlan) -> None:  # device: runtime.cuda.device.Device
        self.plan = plan
        arena = ArenaPlan("KV cache")
        for l in plan.layers:
            n = plan.lanes_of(l)
            shape = (n, l.slots, l.kv_heads, l.head_dim)
            arena.add(f"{l.model}.{l.layer}.k", n * l.k_bytes, l.dtype, shape)
            arena.add(f"{l.model}.{l.layer}.v", n * l.k_bytes, l.dtype, shape)
        self.arena = Arena(device, arena)

    def k(self, layer: int, model: str = "target") -> DeviceBuffer:
        return self.arena[f"{model}.{layer}.k"]

    def v(self, layer: int, model: str = "target") -> DeviceBuffer:
        return self.arena[f"{model}.{layer}.v"]

    def copy_prefix(self, src: int, dst: int, n: int, stream, drafter: bool = False) -> int:
        """Stream-ordered copy of the target's K/V for positions [0, n) from lane `src` to lane `dst` (a ring
        layer: its whole ring, whose slots hold those positions' last `window`; paged layers share pages through
        the page table instead), and with `drafter` the drafter context's too; returns the bytes copied. The
        caller checks that `src` still holds them (KVPlan.prefix_intact)."""
        copied = 0
        for l in self.plan.layers:
            if l.paged or (l.model == "drafter" and not drafter):
                continue
            nbytes = l.k_bytes if l.ring else n * l.row_bytes
            for buf in (self.k(l.layer, l.model), self.v(l.layer, l.model)):
                check(
                    driver().cuMemcpyDtoDAsync(
                        buf.ptr + dst * l.k_bytes, buf.ptr + src * l.k_bytes, nbytes, stream.handle
                    ),
                    "KV prefix copy between lanes",
                )
                copied += nbytes
        return copied

    def zero(self) -> None:
        self.arena.buffer.zero()

    def free(self) -> None:
        self.arena.free()
