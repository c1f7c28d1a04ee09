"""Runtime stage (engine core): the one KV manager of every backend: lanes, the paged layers' pages and their
prefix cache, admission, growth, preemption and release (vLLM v1's KVCacheManager, nano-vllm's BlockManager).

A backend's KV cache (KVGeometry) has `lanes` lanes, one per running sequence (its sliding layers' rings and its
drafter context), and, for the full-attention layers, a pool of pages of `page` positions that every lane reaches
through its page-table row (runtime/engine/kv_pages.py). The scheduler owns the manager, and the manager decides
everything about that memory: which lane a sequence runs in, which cached pages it shares, which pages it takes as
it grows, what a finished sequence leaves cached, and which lane's K/V a new sequence copies. What the device must
do about it travels in the schedule as instructions (ClaimLane, CopyPrefix, MapPages) that the backend's runner executes
before the step; a runner never decides any of it.

Prefix reuse: full pages whose K/V is final are registered under the hash of the tokens up to their end and stay
cached after their holders finish (least recently released evicted first). A lane's rings keep the K/V of the last
sequence that finished in it. A new sequence reuses the longest prefix of its keys (image placeholders keyed by
image: Sequence.prompt_keys) that both the cached pages and a lane's rings hold (`KVGeometry.prefix_intact`), in
whole pages and never ending inside an image. It is admitted to the free lane with the longest usable prefix (else
the one freed longest ago); when another lane (running, or free but not chosen) holds a longer one, the schedule
copies that lane's K/V into its own. A speculative sequence reuses only what the lane's drafter context covers too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Union

from ...model_spec.conventions import KV_PAGE
from ..backend import span_floor
from .kv_pages import PagePool, SeqPages
from .sequence import Sequence


class ClaimLane(NamedTuple):
    """Lane `lane` holds a new sequence whose first `keep` positions are what the lane held (the rest is its
    previous holder's and will be written over)."""

    lane: int
    keep: int


class MapPages(NamedTuple):
    """Page-table row `lane`: entries `first`.. are `pages` (executed before the step that runs their positions)."""

    lane: int
    first: int
    pages: tuple[int, ...]


class CopyPrefix(NamedTuple):
    """Copy lane `src`'s K/V of positions [0, tokens) into lane `dst` (its rings whole: their slots hold those
    positions' last window; the paged layers share pages instead), with `drafter` the drafter context's too."""

    src: int
    dst: int
    tokens: int
    drafter: bool


KVOp = Union[ClaimLane, CopyPrefix, MapPages]


@dataclass(frozen=True)
class KVGeometry:
    """A backend's KV cache as the manager sees it: `lanes` sequences of up to `max_context` positions, `pages`
    pages of `page` positions (0: no paged layer), the (window, slots) of every ring layer, and whether finished
    sequences' K/V may serve later ones (`prefix_cache`)."""

    lanes: int
    max_context: int
    pages: int = 0
    rings: tuple[tuple[int, int], ...] = ()
    page: int = KV_PAGE
    prefix_cache: bool = True

    def prefix_intact(self, n: int, last_written: int) -> bool:
        """Whether the K/V of positions [0, n) can still serve a continuation from position n, when positions up
        to `last_written` were written since: a ring slot keeps a position until one `slots` later is written,
        and the continuation's queries need the `window` positions before n (those that exist)."""
        return all(last_written < max(0, n - window) + slots for window, slots in self.rings)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page)


@dataclass(eq=False)
class Lane:
    """One lane: the sequence running in it, and what it still holds for the next one."""

    seq: Sequence | None = None
    cached: list[int] = field(default_factory=list)  # keys of positions 0.. whose K/V it holds (finished sequence)
    last_written: int = -1  # the highest position granted since they were written (rejected drafts included)
    freed_at: int = 0  # when it was last released (LRU among free lanes)
    granted: int = 0  # positions its running sequence may write (0..granted-1)
    pages: SeqPages = field(default_factory=SeqPages)  # the running sequence's page-table row

    def holds(self) -> list[int]:
        """Keys of the positions whose K/V the lane holds now (a running sequence's committed ones)."""
        return self.cached if self.seq is None else keys_of(self.seq, self.seq.num_cached)


def keys_of(seq: Sequence, upto: int | None = None) -> list[int]:
    """The ids that key K/V (image placeholders by image), prompt then output, the first `upto`."""
    keys = seq.prompt_keys + seq.output if seq.images else seq.tokens
    return keys if upto is None else keys[:upto]


class KVManager:
    """Lanes and pages of one backend's KV cache. `draft_context(lane)`: positions 0.. of a lane whose drafter
    context is current (the runner's record; None: the backend has no drafter context). Instructions for the
    device collect in `ops` until the scheduler takes them into a schedule."""

    def __init__(self, geometry: KVGeometry, draft_context: Callable[[int], int] | None = None) -> None:
        self.geometry = geometry
        self.pool = PagePool(geometry.pages, geometry.page) if geometry.pages else None
        self.lanes = [Lane() for _ in range(geometry.lanes)]
        self.draft_context = draft_context
        self.ops: list[KVOp] = []
        self.copied_tokens = 0  # prefix-cache hits served by copying another lane's K/V
        self._released = 0

    # ---- what the scheduler asks ----------------------------------------------------------------------------
    @property
    def total_pages(self) -> int:
        """Pages in all (without a paged layer: each lane's whole context counted in pages)."""
        g = self.geometry
        return self.pool.size if self.pool else g.lanes * g.pages_for(g.max_context)

    @property
    def used_pages(self) -> int:
        """Pages running sequences hold (without a paged layer: those their grants cover)."""
        if self.pool is not None:
            return self.pool.size - self.pool.free
        return sum(self.geometry.pages_for(lane.granted) for lane in self.lanes if lane.seq is not None)

    def fits(self, tokens: int) -> bool:
        """Whether one sequence of `tokens` positions fits the whole cache."""
        return tokens <= self.geometry.max_context and (
            self.pool is None or self.geometry.pages_for(tokens) <= self.pool.size
        )

    def granted(self, seq: Sequence) -> int:
        return self.lanes[seq.lane].granted if seq.lane is not None else 0

    def take_ops(self) -> tuple[KVOp, ...]:
        ops, self.ops = tuple(self.ops), []
        return ops

    # ---- admission ------------------------------------------------------------------------------------------
    def admit(self, seq: Sequence, limit: int, tokens: int) -> int | None:
        """A lane for `seq` and KV for its first `tokens` positions, reusing the longest usable cached prefix of its
        first `limit` keys: returns how many positions that covers (seq.lane is set), or None when no lane is free
        or the pages do not fit (nothing changed)."""
        free = [i for i, lane in enumerate(self.lanes) if lane.seq is None]
        if not free:
            return None
        want, shared, cap = self._lookup(seq, limit)
        best, best_n, source, source_n = free[0], -1, None, 0
        for i, lane in enumerate(self.lanes):
            n = self._usable(seq, want, cap, lane, i)
            if n > source_n:
                source, source_n = i, n
            if lane.seq is None and (n > best_n or (n == best_n and lane.freed_at < self.lanes[best].freed_at)):
                best, best_n = i, n
        reused = max(best_n, source_n)
        held = shared[: reused // self.geometry.page]
        if not self._room_for(tokens, held):
            return None
        lane = self.lanes[best]
        written = -1  # (nothing written over its cached K/V since)
        self.ops.append(ClaimLane(best, best_n))
        if source_n > best_n:  # another lane holds more of it: copy its K/V here rather than prefill it again
            assert source is not None
            self.ops.append(CopyPrefix(source, best, source_n, seq.speculative))
            written = self.lanes[source].last_written
            self.copied_tokens += source_n
        lane.seq, lane.cached, lane.last_written, lane.granted = seq, [], written, 0
        seq.lane = best
        if held:
            assert self.pool is not None
            lane.pages.share(self.pool, held)
            self.ops.append(MapPages(best, 0, tuple(held)))
        grown = self.grow(seq, tokens)
        assert grown, "admission checked the pages"
        return reused

    def rebind(self, seq: Sequence, limit: int) -> int:
        """Before the first prefill of a sequence admitted in this step runs: reuse more of its prefix where
        prefills that ran earlier in the step (another request with the same system prompt, a sibling choice)
        registered it since, by sharing their pages and copying their lane's K/V into its own. Returns the
        positions its K/V now covers (seq.num_cached)."""
        assert seq.lane is not None, f"{seq.request_id} holds no lane"
        if not self.geometry.prefix_cache or limit <= seq.num_cached:
            return seq.num_cached
        want, shared, cap = self._lookup(seq, limit)
        source, best = None, seq.num_cached
        for i, lane in enumerate(self.lanes):
            n = self._usable(seq, want, cap, lane, i) if i != seq.lane else 0
            if n > best:
                source, best = i, n
        if source is None:
            return seq.num_cached
        lane = self.lanes[seq.lane]
        self.ops.append(CopyPrefix(source, seq.lane, best, seq.speculative))
        self.copied_tokens += best
        lane.last_written = max(lane.last_written, self.lanes[source].last_written)
        if self.pool is not None:
            held = shared[: best // self.geometry.page]
            lane.pages.adopt(self.pool, held)
            self.ops.append(MapPages(seq.lane, 0, tuple(held)))
        seq.num_cached = best
        if seq.preemptions == 0:
            seq.cached_prompt_tokens = best
        return best

    def _lookup(self, seq: Sequence, limit: int) -> tuple[list[int], list[int], int]:
        """(the keys of `seq` up to its prefill target, the cached pages that hold the longest run of their full
        pages within the first `limit`, the most positions a lane may serve along with them)."""
        limit = limit if self.geometry.prefix_cache else 0
        want = keys_of(seq, seq.prefill_target)
        if self.pool is None:
            return want, [], limit
        shared = self.pool.matched(want, limit) if limit > 0 else []
        return want, shared, len(shared) * self.geometry.page

    def _usable(self, seq: Sequence, want: list[int], cap: int, lane: Lane, i: int) -> int:
        """How many of `want`'s leading keys lane i can serve with the cached pages (at most `cap` positions)."""
        have = lane.holds()
        n, top = 0, min(len(have), len(want), cap)
        while n < top and have[n] == want[n]:
            n += 1
        if seq.speculative:  # the drafter context must cover the reused positions too
            n = min(n, self.draft_context(i) if self.draft_context is not None else 0)
        while True:  # whole pages, and never a part of an image (its span runs whole)
            m = span_floor(n - n % self.geometry.page if self.pool is not None else n, seq.images)
            if m == n:
                break
            n = m
        return n if n and self.geometry.prefix_intact(n, lane.last_written) else 0

    def _room_for(self, tokens: int, held: list[int]) -> bool:
        """Whether a sequence sharing the pages `held` can take the rest of `tokens` positions' pages."""
        if self.pool is None:
            return True
        need = self.geometry.pages_for(tokens) - len(held)
        idle = sum(1 for p in held if self.pool.refs[p] == 0)  # cached pages it holds leave the free count
        return need <= self.pool.free - idle

    # ---- growth and release ---------------------------------------------------------------------------------
    def grow(self, seq: Sequence, tokens: int) -> bool:
        """KV for positions [0, tokens) of `seq` (a running sequence); False (nothing taken) if the pages are not
        free. The lane's rings count them as written from now on."""
        assert seq.lane is not None, f"{seq.request_id} holds no lane"
        lane = self.lanes[seq.lane]
        tokens = min(tokens, self.geometry.max_context)
        if tokens <= lane.granted:
            return True
        if self.pool is not None:
            need = self.geometry.pages_for(tokens) - len(lane.pages.pages)
            if need > self.pool.free:
                return False
            first, new = lane.pages.grow(self.pool, tokens)
            if new:
                self.ops.append(MapPages(seq.lane, first, tuple(new)))
        lane.granted = tokens
        lane.last_written = max(lane.last_written, tokens - 1)
        return True

    def prefilled(self, seq: Sequence, end: int) -> None:
        """Positions [0, end) of `seq` hold their final K/V (a prefill chunk ran): its full pages there may serve
        other sequences from now on."""
        if self.pool is not None and self.geometry.prefix_cache and seq.lane is not None:
            self.lanes[seq.lane].pages.register(self.pool, keys_of(seq), end)

    def release(self, seq: Sequence, finished: bool) -> None:
        """`seq` leaves its lane (finished: what its committed tokens wrote stays cached there and in its full
        pages; else, preempted or failed, nothing of it is reused)."""
        if seq.lane is None:
            return
        lane = self.lanes[seq.lane]
        keep = finished and self.geometry.prefix_cache
        lane.seq, lane.granted = None, 0
        lane.cached = keys_of(seq, seq.num_cached) if keep else []
        if self.pool is not None:
            if keep:
                lane.pages.register(self.pool, lane.cached, len(lane.cached))
            lane.pages.release(self.pool)
        self._released += 1
        lane.freed_at = self._released
        seq.lane = None
