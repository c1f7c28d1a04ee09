"""Runtime stage (reference backend): a KV lane's decode state, `SeqState`: the tokens whose target K/V (and
drafter taps) it holds, every committed token except the last sampled one, which is fed at the next step."""

from __future__ import annotations

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
