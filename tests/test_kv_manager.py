"""The engine core's KV manager (runtime/engine/kv_manager.py) on its own: property tests of admission, growth,
prefill registration, release and preemption over random traffic against a plain model of the page pool (no
page leaks, reference counts that match the holders, no page written by two sequences, images keyed by
content, hits that never end inside an image), and the instructions it gives the device."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thorgen.runtime.backend import ImageInput, ImageSpan, SamplingParams
from thorgen.runtime.engine.kv_manager import ClaimLane, CopyPrefix, KVGeometry, KVManager, MapPages, keys_of
from thorgen.runtime.engine.kv_pages import page_keys
from thorgen.runtime.engine.sequence import Sequence

P = 16  # positions a page
PROMPTS = (  # prompts that share prefixes, and an image ("A" / "B": same size and place, other content)
    [2] + list(range(100, 140)),
    [2] + list(range(100, 140)) + [7, 8],
    [2] + list(range(100, 120)) + list(range(300, 330)),
    [2] + list(range(400, 470)),
)
IMAGE_AT, IMAGE_TOKENS, IMAGE_ID = 20, 24, 61


def _image(name: str) -> ImageInput:
    return ImageInput(
        np.zeros((IMAGE_TOKENS * 9, 768), np.uint8), np.zeros((IMAGE_TOKENS * 9, 2), np.int32), IMAGE_TOKENS, name
    )


def _sequence(rid: str, kind: int) -> Sequence:
    """Kinds 0..3: text prompts; 4 / 5: one prompt with image A / B (the same placeholder ids)."""
    if kind < len(PROMPTS):
        return Sequence(rid, list(PROMPTS[kind]), SamplingParams(), 64)
    prompt = [2] + list(range(100, 100 + IMAGE_AT - 1)) + [IMAGE_ID] * IMAGE_TOKENS + list(range(500, 530))
    span = ImageSpan(IMAGE_AT, _image("A" if kind == 4 else "B"))
    return Sequence(rid, prompt, SamplingParams(), 64, images=(span,))


def _check(kv: KVManager, running: dict[str, Sequence]) -> None:
    """The invariants, against a model rebuilt from the running sequences."""
    pool = kv.pool
    assert pool is not None
    holders: dict[int, list[Sequence]] = {}
    lanes = set()
    for seq in running.values():
        assert seq.lane is not None and seq.lane not in lanes
        lanes.add(seq.lane)
        lane = kv.lanes[seq.lane]
        assert lane.seq is seq and len(lane.pages.pages) == -(-lane.granted // P)
        for i, p in enumerate(lane.pages.pages):
            holders.setdefault(p, []).append(seq)
            key = pool.key_of[p]
            if key is not None and i < seq.num_cached // P:  # a cached page it reads holds its own tokens
                assert key == list(page_keys(keys_of(seq), i + 1, P))[i]
        for p in lane.pages.pages[seq.num_cached // P :]:  # pages it will write are its alone
            assert pool.refs[p] == 1 and pool.key_of[p] is None
    assert all(pool.refs[p] == len(holders.get(p, [])) for p in range(pool.size))
    free = [p for p in range(pool.size) if pool.refs[p] == 0]
    assert sorted(pool.empty + list(pool.cached)) == free and not set(pool.empty) & set(pool.cached)
    assert all(pool.key_of[p] is not None for p in pool.cached) and all(pool.key_of[p] is None for p in pool.empty)
    assert kv.used_pages == pool.size - len(free)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "prefill", "grow", "finish", "preempt"]), st.integers(0, 5), st.integers(1, 40)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS, st.integers(2, 4), st.integers(8, 24))
def test_random_traffic_keeps_the_pool_consistent(ops, lanes, pages):
    kv = KVManager(KVGeometry(lanes, 256, pages, ((16, 48),), P))
    running: dict[str, Sequence] = {}
    for n, (op, kind, amount) in enumerate(ops):
        seqs = list(running.values())
        if op == "admit":
            seq = _sequence(f"s{n}", kind)
            cached = kv.admit(seq, seq.reuse_limit(), seq.prefill_target + 2)
            if cached is not None:
                seq.admitted(cached)
                assert 0 <= cached <= seq.reuse_limit()
                assert not any(s.offset < cached < s.end for s in seq.images)  # never inside an image
                running[seq.request_id] = seq
        elif seqs and op == "prefill":  # a chunk of the prompt ran
            seq = seqs[kind % len(seqs)]
            seq.num_cached = min(seq.prefill_target, seq.num_cached + amount)
            kv.prefilled(seq, seq.num_cached)
        elif seqs and op == "grow":  # decode steps: grant more positions, as the scheduler does
            seq = seqs[kind % len(seqs)]
            if seq.num_cached >= seq.prefill_target and kv.grow(seq, seq.num_cached + amount):
                seq.output += [9] * min(amount, 2)
                seq.num_cached = seq.num_tokens - 1
        elif seqs and op in ("finish", "preempt"):
            seq = seqs[kind % len(seqs)]
            kv.release(seq, finished=op == "finish")
            del running[seq.request_id]
        kv.take_ops()
        _check(kv, running)
    for seq in list(running.values()):
        kv.release(seq, finished=True)
    assert kv.used_pages == 0 and all(r == 0 for r in kv.pool.refs)  # nothing leaked


def _finished(kv: KVManager, seq: Sequence) -> None:
    """Admit `seq`, prefill its whole prompt, finish it."""
    cached = kv.admit(seq, seq.reuse_limit(), seq.prefill_target + 2)
    assert cached is not None
    seq.admitted(cached)
    seq.num_cached = seq.prefill_target
    kv.prefilled(seq, seq.num_cached)
    kv.release(seq, finished=True)


def test_the_same_image_hits_and_another_never_does():
    kv = KVManager(KVGeometry(2, 256, 32, (), P))
    _finished(kv, _sequence("a", 4))
    same, other = _sequence("same", 4), _sequence("other", 5)
    cached = kv.admit(same, same.reuse_limit(), same.prefill_target + 2)
    assert cached == (same.prefill_target - 1) // P * P
    same.admitted(cached)
    assert kv.admit(other, other.reuse_limit(), other.prefill_target + 2) == IMAGE_AT // P * P  # text before it


def test_a_hit_stops_before_an_image_it_would_cut():
    """A lane (no paged layer: positions one by one) whose cached keys end inside the image serves only the text
    before it."""
    kv = KVManager(KVGeometry(1, 256, 0, ()))
    seq = _sequence("s", 4)
    kv.lanes[0].cached = keys_of(seq)[: IMAGE_AT + 5]
    assert kv.admit(seq, seq.reuse_limit(), seq.prefill_target) == IMAGE_AT


def test_instructions_claim_copy_and_map():
    kv = KVManager(KVGeometry(2, 256, 32, (), P))
    a = _sequence("a", 0)
    assert kv.admit(a, a.reuse_limit(), a.prefill_target + 2) == 0
    a.admitted(0)
    ops = kv.take_ops()
    assert ops[0] == ClaimLane(a.lane, 0) and isinstance(ops[1], MapPages) and ops[1].first == 0
    a.num_cached = a.prefill_target
    kv.prefilled(a, a.num_cached)
    b = _sequence("b", 1)  # a's prompt and more, while a runs: a's lane holds it, copied into b's
    assert kv.admit(b, b.reuse_limit(), b.prefill_target + 2) == 32
    claim, copy, shared, *_ = kv.take_ops()
    assert claim == ClaimLane(b.lane, 0) and copy == CopyPrefix(a.lane, b.lane, 32, False)
    assert shared == MapPages(b.lane, 0, tuple(kv.lanes[a.lane].pages.pages[:2]))
    assert kv.copied_tokens == 32


def test_admission_waits_for_pages_and_lanes():
    kv = KVManager(KVGeometry(1, 256, 4, (), P))
    a, b = _sequence("a", 0), _sequence("b", 3)
    assert kv.admit(a, 0, 41) is not None  # 3 pages
    assert kv.admit(b, 0, 10) is None  # no lane left
    kv.release(a, finished=False)
    assert kv.admit(b, 0, 72) is None and kv.used_pages == 0  # 5 pages of 4: nothing taken
    assert kv.admit(b, 0, 64) is not None and kv.used_pages == 4


def test_rings_bound_what_a_lane_still_holds():
    """A lane whose rings were written far past the prefix no longer serves it."""
    kv = KVManager(KVGeometry(1, 4096, 0, ((16, 48),)))
    seq = _sequence("s", 0)
    kv.lanes[0].cached, kv.lanes[0].last_written = keys_of(seq), 40 - 16 + 48 - 1
    assert kv.admit(seq, seq.reuse_limit(), 60) == 40
    kv.release(seq, finished=False)
    kv.lanes[0].cached, kv.lanes[0].last_written = keys_of(seq), 40 - 16 + 48
    assert kv.admit(seq, seq.reuse_limit(), 60) == 0


@pytest.mark.parametrize("preempt", [False, True])
def test_release_keeps_only_what_finished(preempt):
    kv = KVManager(KVGeometry(1, 256, 8, (), P))
    a = _sequence("a", 0)
    kv.admit(a, 0, 43)
    a.admitted(0)
    a.num_cached = 41
    kv.prefilled(a, 41)
    kv.release(a, finished=not preempt)
    b = _sequence("b", 0)
    assert kv.admit(b, b.reuse_limit(), 43) == (0 if preempt else 32)
