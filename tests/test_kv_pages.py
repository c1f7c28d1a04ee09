"""The paged layers' page pool and prefix cache (runtime/engine/kv_pages.py), on the CPU: reference counts,
registration of full pages only, lookups by the whole token prefix, and least-recently-released eviction."""

from __future__ import annotations

import gc
import random
import tracemalloc

import pytest

from thorgen.runtime.backend import BackendError
from thorgen.model_spec.conventions import KV_PAGE
from thorgen.runtime.backend import image_key
from thorgen.runtime.engine.kv_pages import KEY_BYTES, PagePool, SeqPages, page_keys

P = 4  # positions a page (small, so that a few tokens make several pages)


def test_keys_depend_on_every_earlier_token():
    a = list(page_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, P))
    b = list(page_keys([9, 2, 3, 4, 5, 6, 7, 8], 2, P))
    assert a[1] != b[1]  # the same tokens in page 1, after a different page 0
    assert list(page_keys([1, 2, 3, 4, 5, 6, 7, 9], 2, P))[0] == a[0]  # page 0 does not see later tokens
    assert list(page_keys([1, 2, 3, 4, 5, 6, 7, 8], 2, P, first=1, chain=a[0])) == a[1:]  # resumed from a key
    image = image_key("cafe", 0)  # an image placeholder's negative id keys like any other
    assert list(page_keys([image, 2, 3, 4], 1, P)) != list(page_keys([image - 1, 2, 3, 4], 1, P))


def _finish_requests(pool: PagePool, rng: random.Random, requests: int, pages_each: int) -> None:
    """`requests` requests of distinct tokens, `pages_each` full pages each: each takes, registers and releases."""
    for _ in range(requests):
        tokens = [rng.randrange(1_000, 262_144) for _ in range(pages_each * KV_PAGE)]  # (ids above the small ints)
        s = SeqPages()
        s.grow(pool, len(tokens))
        s.register(pool, tokens, len(tokens))
        s.release(pool)


def test_a_cached_page_keeps_a_small_key_and_none_of_its_tokens():
    """A finished request's pages stay registered until their pages are reused, which on a large pool is many
    thousands of requests later: what each keeps on the host is its key alone, not its tokens' int objects, and
    the pool reports those bytes (index_bytes, a cache in the server's /health) within a quarter of what they take."""
    pages, per_seq = 2_000, 20
    pool = PagePool(pages, KV_PAGE)
    empty = pool.index_bytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _finish_requests(pool, random.Random(0), pages // per_seq, per_seq)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(pool.by_key) == len(pool.cached) == pages  # every page cached
    assert kept / pages < 256, f"{kept / pages:.0f} host bytes a cached page"  # (a tuple of its ids: ~865)
    assert 0.75 * kept < pool.index_bytes - empty < 1.25 * kept, (pool.index_bytes - empty, kept)
    key = pool.key_of[0]
    assert isinstance(key, bytes) and len(key) == KEY_BYTES and not gc.get_referents(key)


def test_the_prefix_index_stops_growing_once_the_pool_is_full():
    """Every request leaves its pages indexed, so the index grows with each one until every page is cached; from
    then on each new page evicts one: its length stays the pool's, and its bytes, once the first evictions have
    grown the maps' tables (deleted slots), stay where they are."""
    pages, per_seq = 512, 8
    pool = PagePool(pages, KV_PAGE)
    rng = random.Random(1)
    _finish_requests(pool, rng, pages // per_seq, per_seq)
    full = pool.index_bytes
    assert len(pool.by_key) == pages and pool.evicted == 0
    _finish_requests(pool, rng, 2 * pages // per_seq, per_seq)
    churned = pool.index_bytes
    _finish_requests(pool, rng, 4 * pages // per_seq, per_seq)
    assert len(pool.by_key) == len(pool.cached) == pages and pool.evicted == 6 * pages
    assert pool.index_bytes == churned < 2 * full


def test_take_hold_drop_and_the_free_count():
    pool = PagePool(3, P)
    s = SeqPages()
    first, new = s.grow(pool, 9)  # 9 positions: 3 pages
    assert (first, new, pool.free) == (0, [0, 1, 2], 0)
    with pytest.raises(BackendError, match="all 3 pages are held"):
        pool.take()
    assert s.grow(pool, 12) == (3, [])  # already covered
    s.release(pool)
    assert pool.free == 3 and pool.cached == {}  # unregistered pages come back empty


def test_only_full_final_pages_are_registered_and_matched():
    pool, s, toks = PagePool(8, P), SeqPages(), list(range(100, 111))  # 11 tokens
    s.grow(pool, len(toks))
    s.register(pool, toks, 10)  # positions 0..9 final: pages 0 and 1 (page 2 is partial)
    assert pool.matched(toks, len(toks)) == s.pages[:2]
    assert pool.matched(toks, 7) == s.pages[:1]  # a limit inside page 1: only page 0 serves
    assert pool.matched([100, 101, 102, 999] + toks[4:], 11) == []  # page 0 differs: nothing after it matches
    other = SeqPages()
    other.share(pool, pool.matched(toks, 11))
    assert pool.refs[s.pages[0]] == 2 and other.registered == 2
    full, partial = s.pages[:2], s.pages[2]
    s.release(pool)
    assert pool.refs[full[0]] == 1 and partial in pool.empty  # still held by `other`; the partial page is nobody's
    other.release(pool)
    assert list(pool.cached) == full and pool.matched(toks, 11) == full  # free, and still a cache hit


def test_eviction_takes_the_least_recently_released_page():
    pool = PagePool(2, P)
    a, b = SeqPages(), SeqPages()
    ta, tb = [1, 2, 3, 4], [5, 6, 7, 8]
    for s, t in ((a, ta), (b, tb)):
        s.grow(pool, P)
        s.register(pool, t, P)
    pa, pb = a.pages[0], b.pages[0]
    a.release(pool)
    b.release(pool)  # a's page was released first
    assert pool.free == 2 and pool.matched(ta, P) == [pa]
    assert pool.take() == pa and pool.evicted == 1
    assert pool.matched(ta, P) == [] and pool.matched(tb, P) == [pb]  # b's page is still cached
    pool.hold(pb)  # a hit takes it out of the free list
    assert pool.free == 0
