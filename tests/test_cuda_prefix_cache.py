"""CPU tests of the cuda backend's prefix cache, on the emulated engine (tests/engine_emulator.py): a
chat's next turn prefills only its new tokens and gets exactly the tokens a full prefill gives; the reuse is
refused where a ring no longer holds what the new positions need, or a speculative request would lack the
drafter context (tests/test_drafter_lanes_emulated.py: a lane's drafter context)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.cuda.kv_cache import plan_kv  # noqa: E402

SEEDED = SamplingParams(temperature=1.0, seed=9)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("prefix"), ctx=1024, max_num_seqs=2)
    yield b
    b.close()
    dev.set_driver(None)


def _run(core: EngineCore, rid: str, prompt: list[int], n: int, speculative: bool = False):
    core.add(rid, prompt, n, SEEDED, speculative=speculative)
    tokens, result = [], None
    while core.unfinished:
        for out in core.step():
            tokens += out.token_ids
            result = out.result or result
    return tokens, result


def test_next_turn_reuses_the_cache_and_equals_a_full_prefill(backend):
    core = EngineCore(backend.runner())
    first = [2] + list(range(300, 330))
    a, ra = _run(core, "a", first, 8)
    assert ra.cached_prompt_tokens == 0
    turn2 = first + a + [107, 105, 250, 251, 107]
    hit, rh = _run(core, "b", turn2, 8)
    # all but the last answer token had K/V; the paged layers share whole pages
    assert rh.cached_prompt_tokens == (len(first) + len(a) - 1) // 16 * 16 > 0
    miss, rm = _run(EngineCore(backend.runner()), "c", turn2, 8)  # a new runner knows no cached prefix
    assert rm.cached_prompt_tokens == 0 and hit == miss
    other, ro = _run(core, "d", [2, 400, 401], 4)  # shares only <bos>: nothing worth reusing, and it is correct
    assert ro.cached_prompt_tokens == 0 and other == _run(EngineCore(backend.runner()), "e", [2, 400, 401], 4)[0]


def test_speculative_request_needs_the_drafter_context(backend):
    core = EngineCore(backend.runner())
    first = [2] + list(range(310, 330))
    a, _ = _run(core, "plain", first, 6)
    _, r = _run(core, "spec", first + a + [107], 6, speculative=True)
    assert r.cached_prompt_tokens == 0  # the plain run built no drafter context
    a2, _ = _run(core, "spec2", first, 6, speculative=True)
    _, r2 = _run(core, "spec3", first + a2 + [107], 6, speculative=True)
    assert r2.cached_prompt_tokens > 0


def test_prefix_intact_follows_the_rings(backend):
    plan = plan_kv(backend.spec, 4096, "bf16", drafter=True)  # past the rings' slots
    rings = [l for l in plan.layers if l.ring]
    assert rings, "the tiny preset has sliding layers"
    margin = min(l.slots - l.window for l in rings)
    geometry = plan.geometry()
    assert geometry.prefix_intact(100, 100 + margin - 1) and not geometry.prefix_intact(100, 100 + margin)


def test_a_running_lane_shares_its_prefix_by_copy(backend):
    """Two requests with one long system prompt, the second admitted while the first still runs: the second's
    prompt K/V comes from the first's lane (copied, not prefilled again), and both get exactly the tokens they get
    alone. A speculative request does not copy from a plain one's lane (it holds no drafter context for it)."""
    shared = [2] + [110 + (13 * i) % 380 for i in range(60)]
    prompts = {"a": shared + [107, 300, 301], "b": shared + [107, 400, 401, 402]}
    alone = {rid: _run(EngineCore(backend.runner(2)), rid, p, 10)[0] for rid, p in prompts.items()}

    def together(speculative: bool):
        runner = backend.runner(2)
        core = EngineCore(runner)
        core.add("a", prompts["a"], 10, SEEDED)
        out, results = {"a": [], "b": []}, {}
        for step in range(100):
            if step == 3:  # "a" decodes in its lane now
                core.add("b", prompts["b"], 10, SEEDED, speculative=speculative)
            for o in core.step():
                out[o.request_id] += o.token_ids
                if o.result is not None:
                    results[o.request_id] = o.result
            if not core.unfinished:
                return out, results, core.kv.copied_tokens
        raise AssertionError("did not finish")

    out, results, copied = together(False)
    assert out == alone
    assert results["b"].cached_prompt_tokens == (len(shared) + 1) // 16 * 16 == copied
    out, results, copied = together(True)
    assert copied == 0 and results["b"].cached_prompt_tokens == 0 and out == alone


def test_pages_in_any_order_give_the_same_tokens(backend):
    """The paged layers read and write through the page table: a runner handing out its pages in a scrambled
    order (so a sequence's pages are far apart and out of order) gives the tokens the ordered one gives."""
    import random

    prompt = [2] + [120 + (7 * i) % 300 for i in range(70)]  # 71 tokens: five pages, the last partial
    ordered = _run(EngineCore(backend.runner()), "o", prompt, 12)[0]
    core = EngineCore(backend.runner())
    random.Random(3).shuffle(core.kv.pool.empty)
    core.add("s", prompt, 12, SEEDED)
    out, pages = [], None
    while core.unfinished:
        for o in core.step():
            out += o.token_ids
        lane = next((l for l in core.kv.lanes if l.seq is not None and l.seq.request_id == "s"), None)
        pages = list(lane.pages.pages) if lane is not None else pages
    assert out == ordered
    assert pages != sorted(pages) and len(pages) == -(-(71 + 11) // 16)


def test_a_shared_prefix_is_held_once_and_survives_until_evicted(backend):
    """Requests with one system prompt hold its full pages once (referenced by both page-table rows), the pages
    stay cached after both finish, and once evicted the next request prefills it again, with the same tokens."""
    shared = [2] + [50 + (11 * i) % 400 for i in range(40)]  # 41 tokens: two full pages
    core = EngineCore(backend.runner(2))
    pool = core.kv.pool
    core.add("a", shared + [300, 301], 6, SEEDED)
    core.add("b", shared + [302], 6, SEEDED)
    held = None
    while core.unfinished:
        core.step()
        running = [l for l in core.kv.lanes if l.seq is not None]
        if len(running) == 2 and all(len(l.pages.pages) >= 2 for l in running):
            held = [l.pages.pages[:2] for l in running]
    assert held is not None and held[0] == held[1]  # the second request was admitted on the first's pages
    assert all(pool.refs[p] == 0 for p in held[0]) and set(held[0]) <= set(pool.cached)
    again = _run(core, "c", shared + [303], 4)
    assert again[1].cached_prompt_tokens == 32
    taken = [pool.take() for _ in range(pool.free)]  # what new sequences' pages would do
    assert not pool.cached and pool.evicted >= 2
    for p in taken:
        pool.drop(p)
    cold = _run(core, "d", shared + [303], 4)
    assert cold[1].cached_prompt_tokens == 0 and cold[0] == again[0]


def test_a_hit_reaches_past_the_first_prefill_chunk(backend):
    """A cached prompt longer than one prefill chunk (and than the sliding window) is reused up to its last whole
    page before the token that must run, not only up to the first chunk, and gives the tokens of a full prefill."""
    prompt = [2] + [100 + (i * 7) % 400 for i in range(700)]  # 701 tokens: two chunks of 512
    core = EngineCore(backend.runner())
    first, r1 = _run(core, "a", prompt, 6)
    again, r2 = _run(core, "b", prompt, 6)
    assert r1.cached_prompt_tokens == 0 and r2.cached_prompt_tokens == 700 // 16 * 16
    assert again == first == _run(EngineCore(backend.runner()), "c", prompt, 6)[0]
