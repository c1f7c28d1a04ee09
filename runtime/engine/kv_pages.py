"""Runtime stage (engine core): the pages of the paged KV layers (the KV manager's pool): a pool with reference counts,
and a prefix cache of full pages addressed by the hash of the tokens up to their end (vLLM's automatic prefix
caching, at page granularity).

A page holds the K/V of KV_PAGE consecutive positions in every paged layer. A running sequence holds its pages (refs
> 0); a page that nobody holds is free: "empty" if its contents are nobody's, "cached" if it is registered under the
key of the tokens it covers, and then reusable by any sequence whose tokens start the same way, until it is taken
for new contents (least recently released first). Only full pages whose K/V is final are registered: every position
of them is below the sequence's committed length, which later steps never rewrite (a verify block's rejected drafts
lie above it). The key of page i is the 16-byte BLAKE2b digest of (page i-1's key, page i's ids as int64), so it
names the whole prefix up to the page's end. Every page a finished request leaves registered keeps its key on the
host until the page is taken for new contents, which on a large GPU pool (100k+ pages) takes many thousands of
requests. An indexed page costs ~170 host bytes (its digest ~50, its by_key entry ~50, its `cached` entry ~70),
~270 once evictions have grown the maps' tables: bounded by the pool's size (~34 MiB at 131,072 pages), and reported
as a cache (PagePool.index_bytes), since on a pool that has not filled yet it grows with every request.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from typing import Iterator

from ...model_spec.conventions import KV_PAGE
from ..backend import BackendError

Key = bytes  # KEY_BYTES of a digest
KEY_BYTES = 16


def page_keys(tokens: list[int], n_pages: int, page: int = KV_PAGE, first: int = 0, chain: Key = b"") -> Iterator[Key]:
    """Keys of full pages first..n_pages-1 of `tokens` (n_pages * page <= len(tokens); ids are token ids or
    runtime.backend.image_key's negative ones, both within int64); `chain`: the key of page first-1 (b"" before
    page 0)."""
    ids = array("q", tokens[first * page : n_pages * page])
    size, data = ids.itemsize * page, ids.tobytes()
    for start in range(0, len(data), size):
        chain = hashlib.blake2b(chain + data[start : start + size], digest_size=KEY_BYTES).digest()
        yield chain


class PagePool:
    """`pages` physical pages; take / hold / drop move them between running, cached and empty."""

    def __init__(self, pages: int, page: int = KV_PAGE) -> None:
        self.page = page
        self.refs = [0] * pages
        self.key_of: list[Key | None] = [None] * pages
        self.by_key: dict[Key, int] = {}
        self.empty = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first
        self.cached: OrderedDict[int, None] = OrderedDict()  # registered and free, least recently released first
        self.evicted = 0  # cached pages taken for new contents

    @property
    def size(self) -> int:
        return len(self.refs)

    @property
    def free(self) -> int:
        return len(self.empty) + len(self.cached)

    @property
    def index_bytes(self) -> int:
        """Host bytes of the prefix index beyond the pool's fixed lists: the two maps (with their entries) and the
        registered keys. At most ~270 bytes a page, so bounded by the pool's size."""
        keys = len(self.by_key)
        return sys.getsizeof(self.by_key) + sys.getsizeof(self.cached) + keys * (sys.getsizeof(b"") + KEY_BYTES)

    def take(self) -> int:
        """A free page for new contents (an empty one, else the least recently released cached one)."""
        if self.empty:
            p = self.empty.pop()
        elif self.cached:
            p, _ = self.cached.popitem(last=False)
            del self.by_key[self.key_of[p]]  # type: ignore[arg-type]
            self.key_of[p] = None
            self.evicted += 1
        else:  # the scheduler charges every page a sequence can hold, so this is an accounting bug
            raise BackendError(f"KV page pool: all {self.size} pages are held")
        self.refs[p] = 1
        return p

    def hold(self, p: int) -> None:
        if self.refs[p] == 0:
            self.cached.pop(p)
        self.refs[p] += 1

    def drop(self, p: int) -> None:
        self.refs[p] -= 1
        if self.refs[p] == 0:
            if self.key_of[p] is None:
                self.empty.append(p)
            else:
                self.cached[p] = None

    def register(self, p: int, key: Key) -> None:
        """Page p (held, its K/V final) now serves the tokens of `key`; a key already served keeps its page."""
        if self.key_of[p] is None and key not in self.by_key:
            self.by_key[key] = p
            self.key_of[p] = key

    def lookup(self, key: Key) -> int | None:
        return self.by_key.get(key)

    def matched(self, tokens: list[int], limit: int) -> list[int]:
        """The cached or running pages holding the K/V of the longest run of full pages of tokens[:limit]."""
        out = []
        for key in page_keys(tokens, min(limit, len(tokens)) // self.page, self.page):
            p = self.by_key.get(key)
            if p is None:
                break
            out.append(p)
        return out


class SeqPages:
    """One lane's page list: page i holds positions i*page .. (i+1)*page-1 of its sequence."""

    def __init__(self) -> None:
        self.pages: list[int] = []
        self.registered = 0  # leading pages registered in the pool
        self._chain: Key = b""  # the key of the last of them (so registering more hashes only the new pages)

    def grow(self, pool: PagePool, end: int) -> tuple[int, list[int]]:
        """Take pages until positions 0..end-1 are covered; returns (index of the first new page, the new pages)."""
        first, need = len(self.pages), -(-end // pool.page)
        new = [pool.take() for _ in range(first, need)]
        self.pages += new
        return first, new

    def share(self, pool: PagePool, pages: list[int]) -> None:
        """Start from another sequence's (or the cache's) pages for a prefix (the list must be empty)."""
        assert not self.pages, "share() starts a sequence"
        for p in pages:
            pool.hold(p)
        self.pages = list(pages)
        self.registered = len(pages)  # they are registered already
        self._chain = pool.key_of[pages[-1]] or b"" if pages else b""

    def adopt(self, pool: PagePool, pages: list[int]) -> None:
        """Hold the cached `pages` for the leading positions instead of the pages held there (the sequence's own,
        nothing written in them yet), which go back to the pool."""
        for i, p in enumerate(pages):
            if self.pages[i] != p:
                pool.hold(p)
                pool.drop(self.pages[i])
                self.pages[i] = p
        if len(pages) > self.registered:
            self.registered = len(pages)
            self._chain = pool.key_of[pages[-1]] or b""

    def register(self, pool: PagePool, tokens: list[int], upto: int) -> None:
        """Register the full pages below position `upto` (their K/V final) under their tokens' keys."""
        n = min(upto, len(tokens)) // pool.page
        for i, key in enumerate(page_keys(tokens, n, pool.page, self.registered, self._chain), self.registered):
            pool.register(self.pages[i], key)
            self._chain = key
        self.registered = max(self.registered, n)

    def release(self, pool: PagePool) -> None:
        for p in self.pages:
            pool.drop(p)
        self.pages, self.registered, self._chain = [], 0, b""
