"""CPU tests of batched decoding on the cuda backend, on the emulated engine (tests/engine_emulator.py): one KV
lane per sequence, batched decode graphs per bucket (padding rows repeat row 0), per-row sampling parameters,
and a prefix cache per lane. A request's tokens must not depend on what else runs: each one served beside others
equals the same request served alone, greedy and seeded."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.options import EngineOptions  # noqa: E402
from thorgen.runtime.cuda.kv_cache import fit_kv, plan_kv  # noqa: E402
from thorgen.runtime.cuda.runner import CudaRunner  # noqa: E402

LANES = 3
GREEDY = SamplingParams()

# (step graphs captured on first use, not when a runner is made: these tests read which ran from them)
LAZY = EngineOptions(capture_graphs=False)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("batched"), ctx=512, max_num_seqs=LANES, options=LAZY)
    yield b
    b.close()
    dev.set_driver(None)


def _serve(core: EngineCore, requests: dict[str, tuple[list[int], int, SamplingParams]]) -> dict[str, list[int]]:
    """Run the requests together (all queued at once) to the end; each request's tokens."""
    for rid, (prompt, n, sp) in requests.items():
        core.add(rid, prompt, n, sp)
    out = {rid: [] for rid in requests}
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
    return out


def _requests() -> dict[str, tuple[list[int], int, SamplingParams]]:
    seeded = [SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=s) for s in (3, 4)]
    return {
        "a": ([2] + list(range(300, 312)), 5, GREEDY),  # lengths differ: rows at different positions,
        "b": ([2, 500, 501], 6, seeded[0]),  # ending at different steps (the bucket shrinks, 3 -> pad 4)
        "c": ([2, 90, 91, 92, 93], 3, seeded[1]),
        "d": ([2, 100], 4, GREEDY),
    }  # the fourth waits for a lane


def test_batched_decode_equals_each_request_alone(backend):
    engine = backend.engine
    engine.launches.graphs = {k: g for k, g in engine.launches.graphs.items() if not k.startswith("batch")}
    together = _serve(EngineCore(backend.runner(LANES)), _requests())
    buckets = sorted(k for k in engine.launches.graphs if k.startswith("batch"))
    assert any(k.startswith("batch4_sample") for k in buckets), buckets  # 3 running (+1 padding row), 2 seeded
    assert any(k.startswith("batch2") for k in buckets), buckets  # then two
    for rid, (prompt, n, sp) in _requests().items():
        alone = _serve(EngineCore(backend.runner(1)), {rid: (prompt, n, sp)})[rid]
        assert together[rid] == alone, f"request {rid}: batched {together[rid]} != alone {alone}"
        assert len(alone) == n


def test_steps_launched_ahead_equal_steps_launched_when_scheduled(backend):
    """The runner launches batched step n + 1 before it reads step n's tokens (input tokens carried on the device).
    With arrivals between steps, a stop id, an abort and the batch shrinking to one row, every request's tokens
    equal those of the same run with each step launched only when scheduled, and each request alone."""
    hot = SamplingParams(temperature=1.5, seed=5)  # (the tiny model's greedy tokens repeat)
    alone_c = _serve(EngineCore(backend.runner(1)), {"c": ([2, 90, 91, 92, 93], 8, hot)})["c"]
    stop_at = next(i for i, t in enumerate(alone_c) if i >= 2 and t not in alone_c[:i])  # (a first occurrence)
    stop = alone_c[stop_at]

    def run(ahead: bool) -> tuple[dict[str, list[int]], int]:
        runner = CudaRunner(backend.engine, LANES, launch_ahead=ahead)
        core, out = EngineCore(runner), {}
        reqs = _requests()
        for rid in "ab":
            core.add(rid, *reqs[rid])
        core.add("c", [2, 90, 91, 92, 93], 8, hot, frozenset({stop}))
        for step in range(200):
            if step == 2:
                core.add("late", [2, 77, 78], 7, SamplingParams(temperature=0.7, seed=9))
            if step == 3:
                core.add("gone", [2, 55], 9, GREEDY)
            if step == 6:
                core.abort("gone")
            if not core.unfinished:
                break
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.token_ids)
        return out, runner.ahead_steps

    ahead, launched_ahead = run(True)
    plain, none_ahead = run(False)
    assert launched_ahead > 3 and none_ahead == 0
    assert ahead == plain
    assert ahead["c"] == alone_c[: stop_at + 1]
    for rid, (prompt, n, sp) in {
        "a": _requests()["a"],
        "late": ([2, 77, 78], 7, SamplingParams(temperature=0.7, seed=9)),
    }.items():
        assert ahead[rid] == _serve(EngineCore(backend.runner(1)), {rid: (prompt, n, sp)})[rid]


def test_steps_launched_ahead_survive_preemption(tiny_checkpoint, tmp_path):
    """A KV cache of 8 pages (one full context) for 3 sequences that grow to 4 pages each: the scheduler preempts
    (its charge includes the page a step launched ahead may write), the preempted sequence resumes by recompute,
    and every request's tokens equal those with each step launched when scheduled, and alone."""
    from thorgen.runtime.cuda import device as dev

    before = dev._driver  # the module fixture's fake driver, which its backend closes with
    try:
        b = EE.open_emulated(tiny_checkpoint, tmp_path, ctx=128, max_num_seqs=3)
        one = plan_kv(b.spec, 128, "bf16", drafter=b.engine.speculative)
        b.close()
        gib = (3 * one.lane_nbytes + 8 * one.page_nbytes) / 2**30  # (a lane: its rings and drafter context)
        b = EE.open_emulated(tiny_checkpoint, tmp_path / "small", ctx=128, max_num_seqs=3, kv_cache_gib=gib)
        assert (b.engine.lanes, b.engine.kv.plan.pages) == (3, 8)
        reqs = {
            "a": ([2] + list(range(300, 309)), 50, GREEDY),
            "b": ([2] + list(range(500, 508)), 50, SamplingParams(temperature=1.2, seed=7)),
            "c": ([2] + list(range(90, 99)), 50, GREEDY),
        }

        def run(ahead: bool) -> tuple[dict[str, list[int]], int]:
            runner = CudaRunner(b.engine, 3, launch_ahead=ahead)
            core = EngineCore(runner)
            seqs = [core.add(rid, *req) for rid, req in reqs.items()]
            out = {rid: [] for rid in reqs}
            while core.unfinished:
                for o in core.step():
                    out[o.request_id] += o.token_ids
            return out, sum(s.preemptions for s in seqs)

        ahead, preempted = run(True)
        plain, _ = run(False)
        assert preempted > 0 and ahead == plain
        for rid, req in reqs.items():
            assert len(ahead[rid]) == 50
            assert ahead[rid] == _serve(EngineCore(b.runner(1)), {rid: req})[rid]
        b.close()
    finally:
        dev.set_driver(before)


def test_each_lane_keeps_its_own_prefix_cache(backend):
    core = EngineCore(backend.runner(LANES))
    chats = {"x": [2] + list(range(310, 330)), "y": [2] + list(range(410, 433))}  # (past one page of 16)
    first = _serve(core, {rid: (p, 4, GREEDY) for rid, p in chats.items()})
    turn2 = {rid + "2": (chats[rid] + first[rid] + [107, 105], 3, GREEDY) for rid in chats}
    for rid, req in turn2.items():  # both next turns at once: each finds its own conversation in some lane
        core.add(rid, *req)
    out, cached = {rid: [] for rid in turn2}, {}
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
            if o.finished:
                cached[o.request_id] = o.result.cached_prompt_tokens
    for rid in chats:
        # all but the last answer token had K/V, in whole pages
        assert cached[rid + "2"] == (len(chats[rid]) + 4 - 1) // 16 * 16 > 0
        miss = _serve(EngineCore(backend.runner(1)), {"m": turn2[rid + "2"]})["m"]
        assert out[rid + "2"] == miss


def test_launch_batch_rejects_shared_or_unknown_lanes(backend):
    with pytest.raises(BackendError, match="distinct"):
        EE.batch_step(backend.engine, [(0, 5, 2, None), (0, 6, 2, None)])
    with pytest.raises(BackendError, match="distinct"):
        EE.batch_step(backend.engine, [(LANES, 5, 2, None)])  # (no such lane)


def test_kv_lanes_and_pages_fit_the_budget(backend):
    """Lanes cost their rings, pages the paged layers' K/V: the pages fill what the lanes leave, up to every lane's
    full context, and the lanes shrink only when one full-context sequence would not fit beside them."""
    one = plan_kv(backend.spec, 512, "bf16")
    lane, page, full = one.lane_nbytes, one.page_nbytes, one.seq_pages
    assert lane and page and full == 512 // 16
    seq = lane + full * page  # one sequence at the full context
    assert fit_kv(one, 8, available=100 * seq) == (8, 8 * full)  # room for all: capped at 8 full contexts
    gib = (8 * lane + 3 * full * page + page // 2) / 2**30  # 8 rings and three contexts' pages (and half a page)
    assert fit_kv(one, 8, available=100 * seq, kv_cache_gib=gib) == (8, 3 * full)
    gib = (3 * lane + full * page) / 2**30  # 3 rings and one context: the lanes give way to one full sequence
    assert fit_kv(one, 8, available=100 * seq, kv_cache_gib=gib) == (3, full)
    with pytest.raises(BackendError, match="exceeds"):
        fit_kv(one, 8, available=2 * seq, kv_cache_gib=3 * seq / 2**30)
    with pytest.raises(BackendError, match="does not fit"):
        fit_kv(one, 8, available=100 * seq, kv_cache_gib=0.5 * seq / 2**30)


def test_bench_times_each_bucket(backend):
    """`thorgen bench --batch-sizes`' measurement on the emulated engine: one row per size, the largest's
    kernels, bytes that grow with the rows (more experts touched, more K/V), and from 2 rows the same step with the
    DFlash taps (its graph, with the drafter's context program after the forward)."""
    from thorgen.runtime.bench.batched import measure_batched

    report = {"kv_dtype": "bf16", "lm_head": "nvfp4", "copy_gb_s": 1.0}
    measure_batched(backend, report, [1, 3], position=20, steps=1)
    one, three = report["batched_decode"]
    assert (one["rows"], one["bucket"], three["rows"], three["bucket"]) == (1, 1, 3, 4)
    assert three["bytes"] > one["bytes"] > 0 and three["step_ms"] > 0
    assert (
        "taps_step_ms" not in one
        and three["taps_step_ms"] > 0
        and "batch4_greedy_taps" in backend.engine.launches.graphs
    )
    kernels = {k["kernel"] for k in report["batched_step_kernels"]}
    assert any(k.startswith("attn_dec__") for k in kernels) and report["batched_step_rows"] == 3


def test_more_than_16_rows_run_the_32_row_bucket(tiny_checkpoint, tmp_path):
    """18 sequences: one step runs the 32-row graph (the M = 32 GEMMs and MoE pair; padded rows dropped); each
    request equals itself alone."""
    from thorgen.runtime.cuda import device as dev

    before = dev._driver  # the module fixture's fake driver, which its backend closes with
    b = EE.open_emulated(tiny_checkpoint, tmp_path, ctx=64, max_num_seqs=18, options=LAZY)
    try:
        reqs = {
            f"r{i}": ([2, 10 + i], 2, GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=i)) for i in range(18)
        }
        together = _serve(EngineCore(b.runner(18)), reqs)
        graphs = b.engine.launches.graphs
        assert "batch32_sample" in graphs and not any(k.startswith("batch16") for k in graphs)
        step = b.engine.fwd.ops(32, decode=False, last=True, greedy=False, batched=True)
        kernels = {op.entry.name for op in step}
        assert any(k.startswith("nvfp4_gemm32__") for k in kernels) and any(
            k.startswith("moe_gateup__m32") for k in kernels
        )
        for rid, req in list(reqs.items())[::5]:
            assert together[rid] == _serve(EngineCore(b.runner(1)), {rid: req})[rid]
    finally:
        b.close()
        dev.set_driver(before)
