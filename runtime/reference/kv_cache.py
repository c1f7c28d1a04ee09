"""Runtime stage (reference backend): a growable per-layer K/V store with truncate (rollback) and copy.

Row p of every layer holds the (already normed and rotated) key and the value of absolute position p, so a
cache of length n covers positions 0..n-1. Sliding layers keep every row too; the window is applied by
the attention mask, which keeps the reference simple and rollback trivial.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, shapes: list[tuple[int, int]], capacity: int = 64) -> None:
        """shapes[l] = (kv_heads, head_dim) of layer l."""
        self.shapes = list(shapes)
        self.length = 0
        cap = max(1, capacity)
        self._k = [np.zeros((cap, h, d), dtype=np.float32) for h, d in self.shapes]
        self._v = [np.zeros((cap, h, d), dtype=np.float32) for h, d in self.shapes]

    @property
    def capacity(self) -> int:
        return self._k[0].shape[0] if self._k else 0

    def _grow(self, need: int) -> None:
        cap = self.capacity
        if need <= cap:
            return
        new = max(need, 2 * cap)
        for store in (self._k, self._v):
            for i, a in enumerate(store):
                b = np.zeros((new,) + a.shape[1:], dtype=np.float32)
                b[: self.length] = a[: self.length]
                store[i] = b

    def write(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store rows for positions start..start+T-1 of one layer (the caller commits the length)."""
        if start > self.length:
            raise ValueError(f"KV write at {start} leaves a gap after length {self.length}")
        end = start + k.shape[0]
        self._grow(end)
        self._k[layer][start:end] = k
        self._v[layer][start:end] = v

    def keys(self, layer: int, end: int) -> np.ndarray:
        return self._k[layer][:end]

    def values(self, layer: int, end: int) -> np.ndarray:
        return self._v[layer][:end]

    def set_length(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"KV length {n} < 0")
        self._grow(n)
        self.length = n

    def truncate(self, n: int) -> None:
        """Roll back to the first n positions (n larger than the length is an error)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a KV cache of length {self.length} to {n}")
        self.length = n

    def copy(self) -> "KVCache":
        out = KVCache(self.shapes, capacity=max(1, self.length))
        for l in range(len(self.shapes)):
            out._k[l][: self.length] = self._k[l][: self.length]
            out._v[l][: self.length] = self._v[l][: self.length]
        out.length = self.length
        return out
