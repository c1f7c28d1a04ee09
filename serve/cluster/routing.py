"""Serve stage: prefix-affinity routing of engine requests across Ray Serve replicas (a custom `RequestRouter`).

Policy, per request (the prompt token ids are the request's first argument, its image spans the sixth):
1. Hash the prompt (image placeholders as ids of their image's hash) in fixed blocks of `block_tokens` ids, each
   hash chained over all blocks before it, so that one hash names one whole prefix.
2. Look the hashes up in a bounded LRU index of which replica last served each prefix. The replica with the
   longest match (at least `min_match_blocks` blocks) holds that prefix in its cache.
3. Send the request there if its queue (Serve's count of requests ongoing at that replica) is at most
   `max_imbalance` above the least-loaded candidate's; otherwise, or without a match, take two random candidates
   (power of two choices) and prefer the shorter queue, then the replica holding fewer cached prefixes (so that
   new, unrelated conversations spread out instead of piling onto one replica).
Serve then sends the request to the first ranked replica that accepts it (below `max_ongoing_requests`).
"""

from __future__ import annotations

import importlib
import random
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ...runtime.backend import key_tokens

# Routing decisions of this process's routers ("affinity" or "balance"), read by the ingress's /metrics.
DECISIONS: Counter = Counter()


def decisions() -> Counter:
    """This process's DECISIONS. Serve pickles a router's module by value, so every router instance has private
    copies of this module's globals: count in the module as imported (by the ingress) instead."""
    return importlib.import_module(__name__).DECISIONS


def block_hashes(ids: Sequence[int], block: int) -> list[int]:
    """One hash per full block; hash i identifies the prefix ids[:block * (i + 1)]. Python hashes ints and tuples
    of ints identically in every process (no hash randomization), and the index lives in one process anyway."""
    out, h = [], 0
    for start in range(0, len(ids) - block + 1, block):
        h = hash((h, tuple(ids[start : start + block])))
        out.append(h)
    return out


class PrefixIndex:
    """Which replica last served each prefix block, bounded to `capacity` blocks (least recently used go first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[int, Hashable] = OrderedDict()
        self.held: Counter = Counter()  # blocks attributed to each replica

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, hashes: Sequence[int], live: set) -> tuple[Hashable | None, int]:
        """(replica, depth in blocks) of the longest remembered prefix whose replica is in `live`."""
        best, depth = None, 0
        for i, h in enumerate(hashes):
            owner = self._owner.get(h)
            if owner is None:  # the chain breaks: nobody served a longer prefix
                break
            if owner in live:
                best, depth = owner, i + 1
        return best, depth

    def record(self, hashes: Sequence[int], replica: Hashable) -> None:
        for h in hashes:
            old = self._owner.pop(h, None)
            if old is not None:
                self.held[old] -= 1
            self._owner[h] = replica
            self.held[replica] += 1
        while len(self._owner) > self.capacity:
            _, old = self._owner.popitem(last=False)
            self.held[old] -= 1

    def forget(self, replica: Hashable) -> None:
        """A replica is gone: its cache went with it."""
        for h in [h for h, owner in self._owner.items() if owner == replica]:
            del self._owner[h]
        self.held.pop(replica, None)


def rank(
    candidates: Sequence[Any],
    key: Callable[[Any], Hashable],
    load: Callable[[Any], int],
    hashes: Sequence[int],
    index: PrefixIndex,
    min_match_blocks: int,
    max_imbalance: int,
    rng: random.Random,
) -> tuple[list[list[Any]], str]:
    """The policy above, on any replica objects: (ranked replicas, "affinity" | "balance")."""
    if not candidates:
        return [], "balance"
    by_key = {key(r): r for r in candidates}
    loads = {k: load(r) for k, r in by_key.items()}
    owner, depth = index.match(hashes, set(by_key))
    pair = rng.sample(list(by_key), min(2, len(by_key)))
    pair.sort(key=lambda k: (loads[k], index.held[k]))
    if owner is not None and depth >= min_match_blocks and loads[owner] <= min(loads.values()) + max_imbalance:
        return [[by_key[owner]]] + [[by_key[k]] for k in pair if k != owner], "affinity"
    return [[by_key[k]] for k in pair], "balance"


def prompt_ids_of(request: PendingRequest | None) -> Sequence[int]:
    """The ids that key a request's prefix: its prompt, each image placeholder replaced by an id of its image's
    content hash (runtime.backend.key_tokens, as the engines' prefix caches key it), so that a prefix holding one
    image is never taken for the same prefix holding another."""
    if request is None:
        return ()
    if request.args:
        ids, images = request.args[0], request.args[5] if len(request.args) > 5 else ()
    else:
        ids, images = request.kwargs.get("prompt_ids", ()), request.kwargs.get("images", ())
    return key_tokens(ids, images) if images else ids


class PrefixAffinityRouter(RequestRouter):
    """Ray Serve's extension point: `choose_replicas` ranks candidates, Serve probes and sends."""

    def initialize_state(
        self,
        block_tokens: int = 16,
        min_match_blocks: int = 1,
        max_imbalance: int = 2,
        capacity_blocks: int = 200_000,
        seed: int | None = None,
    ) -> None:
        self.block_tokens, self.min_match_blocks, self.max_imbalance = block_tokens, min_match_blocks, max_imbalance
        self.index = PrefixIndex(capacity_blocks)
        self.rng = random.Random(seed)
        self._decided: dict[str, str] = {}  # internal request id -> decision, counted once the request is sent

    def _load(self, replica: RunningReplica) -> int:
        # None: no fresh entry; Serve probes the replica while sending, so an unknown load does not overfill it
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hashes = block_hashes(prompt_ids_of(pending_request), self.block_tokens)
        ranked, decision = rank(
            candidate_replicas,
            lambda r: r.replica_id.unique_id,
            self._load,
            hashes,
            self.index,
            self.min_match_blocks,
            self.max_imbalance,
            self.rng,
        )
        if pending_request is not None:  # choose_replicas reruns while no ranked replica accepts: count on send
            if len(self._decided) > 4096:  # requests cancelled before being sent leave entries behind
                self._decided.clear()
            self._decided[pending_request.metadata.internal_request_id] = decision
        return ranked

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.index.record(block_hashes(prompt_ids_of(pending_request), self.block_tokens), replica_id.unique_id)
        decisions()[self._decided.pop(pending_request.metadata.internal_request_id, "balance")] += 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = {r.unique_id for r in self.curr_replicas} - {r.replica_id.unique_id for r in replicas}
        super().update_replicas(replicas)
        for replica in gone:
            self.index.forget(replica)
