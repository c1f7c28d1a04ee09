"""Runtime stage (reference backend): per-sequence decode state and the LRU prefix cache of such states.

A `SeqState` covers the tokens whose target K/V (and drafter taps) it holds: every committed token except the
last sampled one, which is fed at the next step. The prefix cache keeps up to N finished states; a new
request reuses the longest common prefix of its prompt with any slot, always re-running at least the last
prompt token so the first sampled token has fresh logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .drafter import DraftContext
from .kv_cache import KVCache


@dataclass
class SeqState:
    tokens: list[int]
    kv: KVCache
    draft: DraftContext | None

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        """Roll everything back to the first n covered tokens."""
        del self.tokens[n:]
        self.kv.truncate(n)
        if self.draft is not None:
            self.draft.truncate(min(n, self.draft.length))

    def copy(self) -> "SeqState":
        return SeqState(list(self.tokens), self.kv.copy(), None if self.draft is None else self.draft.copy())


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Up to `slots` states in LRU order (most recent last)."""

    def __init__(self, slots: int = 4) -> None:
        if slots < 0:
            raise ValueError(f"prefix cache slots {slots} must be >= 0")
        self.slots = slots
        self._entries: OrderedDict[int, SeqState] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int]) -> tuple[SeqState | None, int]:
        """A private copy of the best slot truncated to the reusable prefix, and that prefix length."""
        best, best_n = None, 0
        for key, st in self._entries.items():
            n = min(common_prefix(st.tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = key, n
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        state = self._entries[best].copy()
        state.truncate(best_n)
        return state, best_n

    def store(self, state: SeqState) -> None:
        """Keep a finished state (owned by the cache from now on); drop slots it extends; evict the LRU."""
        if self.slots == 0 or state.length == 0:
            return
        for key in [k for k, st in self._entries.items()
                    if st.length <= state.length and state.tokens[: st.length] == st.tokens]:
            del self._entries[key]
        self._entries[self._next] = state
        self._next += 1
        while len(self._entries) > self.slots:
            self._entries.popitem(last=False)
