"""Batched verify on the cuda backend, on the emulated GPU (tests/engine_emulator.py): several running sequences'
draft blocks verified in one batched step (runtime/cuda/spec_batch.py). Greedy and seeded requests of different
lengths and max_tokens served together with speculation decode exactly what they decode without it, token for
token, when drafts land (forced: each request's plain continuation with planted mistakes, so accepted runs, runs
cut by max_tokens and blocks across a KV page boundary occur), with the engine's own drafter, under emulated
acceptance (every verify commits K drafts + 1: the same tokens as each request's one-sequence DFlash steps), across
preemption and an abort, beside a request with a grammar (drafting too, its rows masked; or a plain processed row
where it does not speculate) and beside a request whose grammar fails (its failure stays its own); with the
adaptive draft policy, drafts that miss turn into plain batched steps and probes."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.model_spec.conventions import KV_PAGE, MAX_BATCH  # noqa: E402
from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.options import EngineOptions  # noqa: E402
from thorgen.runtime.engine.speculation import DraftPlanner  # noqa: E402
from thorgen.runtime.options import DraftOptions  # noqa: E402

LANES = 8
GREEDY = SamplingParams()
STOP = frozenset({1})  # (the grammars' end: the tokenizer's eos)
EVERY_STEP = DraftOptions(adaptive=False)  # every step drafts the most it may (the policy: test_draft_policy)

# (step graphs captured on first use, not when a runner is made: these tests read which ran from them)
LAZY = EngineOptions(capture_graphs=False)


def _sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(
        tiny_checkpoint, tmp_path_factory.mktemp("spec_batch"), ctx=256, max_num_seqs=LANES, options=LAZY
    )
    yield b
    b.close()
    dev.set_driver(None)


@pytest.fixture(autouse=True)
def no_forced_drafts(backend):
    yield
    backend.emulate_acceptance(None)  # (also drops the draft hook it set)
    backend.engine.dflash.draft_hook = None


def _requests(n: int) -> dict[str, tuple[list[int], int, SamplingParams]]:
    """n requests of different prompt lengths and max_tokens, every third one seeded."""
    rng = np.random.default_rng(n)
    return {
        f"r{i}": (
            [2] + rng.integers(256, 512, 3 + 9 * i).tolist(),
            6 + 5 * i,
            _sampled(i) if i % 3 == 1 else GREEDY,
        )
        for i in range(n)
    }


class Run(NamedTuple):
    tokens: dict[str, list[int]]
    accepted: dict[str, list[int]]  # each request's accepted drafts of its verify steps
    steps: list[dict]  # per decode step: request -> (its position, the runner's result)
    speculation: dict[str, int]
    preemptions: int
    errors: dict[str, object]


def _serve(
    backend,
    requests: dict,
    speculative: bool,
    drafts: DraftOptions | None = EVERY_STEP,
    lanes: int | None = None,
    kv_tokens: int | None = None,
    plain: frozenset[str] = frozenset(),
    between=None,
    stop_ids: frozenset[int] = frozenset(),
    later: dict | None = None,
) -> Run:
    """The requests queued at once on one engine core (`plain`: requests that never speculate), and `later` once
    the first step has run, to the end; `between(step, core)` runs before each step."""
    runner = backend.runner(lanes or len(requests), kv_tokens)
    core = EngineCore(runner, drafts=drafts)

    def add(batch: dict) -> list:
        return [
            core.add(rid, p, n, sp, stop_ids, speculative=speculative and rid not in plain)
            for rid, (p, n, sp) in batch.items()
        ]

    seqs = add(requests)
    requests = {**requests, **(later or {})}
    steps: list[dict] = []
    decode = runner.decode

    def recording(batch, launched=None):
        res = decode(batch, launched)
        steps.append({s.request_id: (s.num_tokens - 1, r) for s, r in zip(batch, res)})
        return res

    runner.decode = recording
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    accepted: dict[str, list[int]] = {rid: [] for rid in requests}
    errors = {}
    for i in range(2000):
        if not core.unfinished:
            break
        if between is not None:
            between(i, core)
        if i == 1 and later:
            seqs += add(later)
        for o in core.step():
            out[o.request_id] += o.token_ids
            if o.accepted is not None:
                accepted[o.request_id].append(o.accepted)
            if o.error is not None:
                errors[o.request_id] = o.error
    else:
        raise AssertionError("the requests did not finish")
    return Run(out, accepted, steps, dict(core.speculation), sum(s.preemptions for s in seqs), errors)


def _wrong_slot(position: int) -> int:
    """The draft slot _force_plain_drafts plants a wrong token in for a block at `position` (7: none)."""
    return (position * 5) % 8


def _force_plain_drafts(backend, requests: dict, plain: dict[str, list[int]]) -> None:
    """draft_hook: the plain continuation after (position, last token), from every request's plain tokens, with a
    wrong token planted at slot _wrong_slot(position), so acceptance lengths vary; a key two requests share proposes
    the first one's."""
    V = backend.spec.target.vocab_size
    table: dict[tuple[int, int], list[int]] = {}
    for rid, (prompt, _, _) in requests.items():
        full = prompt + plain[rid]
        for i, t in enumerate(full):
            drafts, wrong = (full[i + 1 : i + 16] + [0] * 15)[:15], _wrong_slot(i)
            if wrong < 7:
                drafts[wrong] = (drafts[wrong] + 1) % V  # never the target's token
            table.setdefault((i, t), drafts)
    backend.engine.dflash.draft_hook = lambda start, last: table.get((start, last), [(last + 1) % V] * 15)


def _verified(run: Run) -> list[dict]:
    """Per decode step: request -> (position, drafts verified, tokens the runner committed) of its drafting rows."""
    return [
        {rid: (pos, r[1], len(r[0])) for rid, (pos, r) in step.items() if not isinstance(r, BaseException) and r[1]}
        for step in run.steps
    ]


def _stop_inside_a_run(run: Run, requests: dict) -> frozenset[int]:
    """A stop id that a verify step of `run` commits before the last token of its run, as that request's first
    occurrence of it."""
    for step in run.steps:
        for rid, (pos, res) in step.items():
            done = pos + 1 - len(requests[rid][0])  # the tokens of its output before this step's
            chain, out = res[0], run.tokens[rid]
            for j, t in enumerate(chain[:-1]):
                if t not in out[: done + j]:
                    return frozenset({t})
    raise AssertionError("no verify step committed a first occurrence before the end of its run")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_batched_verify_equals_plain_decoding(backend, n):
    requests = _requests(n)
    free = _serve(backend, requests, speculative=False).tokens
    _force_plain_drafts(backend, requests, free)
    graphs = backend.engine.launches.graphs
    for key in [k for k in graphs if "_taps" in k]:
        del graphs[key]
    run = _serve(backend, requests, speculative=True)
    assert run.tokens == free
    assert all(len(free[rid]) == req[1] for rid, req in requests.items())
    spec = run.speculation
    assert spec["speculative_steps"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    verified = _verified(run)
    assert max(len(v) for v in verified) >= 2  # sequences drafted together
    assert any("_taps" in k for k in graphs)  # ... in batched verify steps
    assert max(a for acc in run.accepted.values() for a in acc) >= 2
    # every step's rows (one a sequence, and its drafts) fit one batched step
    assert all(len(s) + sum(r[1] for _, r in s.values() if isinstance(r, tuple)) <= MAX_BATCH for s in run.steps)
    # a block across a KV page boundary; a request that ends at its max_tokens with an accepted run
    assert any(pos // KV_PAGE != (pos + k) // KV_PAGE for v in verified for pos, k, _ in v.values())
    ends = {rid: max(i for i, v in enumerate(verified) if rid in v) for rid in requests}
    assert any(verified[ends[r]][r][2] >= 2 for r in requests)
    # a stop id inside an accepted run: the runner's tokens past it are dropped, as plain decoding stops there
    stop = _stop_inside_a_run(run, requests)
    plain = _serve(backend, requests, speculative=False, stop_ids=stop).tokens
    _force_plain_drafts(backend, requests, plain)
    run = _serve(backend, requests, speculative=True, stop_ids=stop)
    assert run.tokens == plain
    ran = {rid: 1 + sum(len(s[rid][1][0]) for s in run.steps if rid in s) for rid in requests}
    assert any(ran[rid] > len(plain[rid]) for rid in requests), ran


def _drafter_context(backend, lane: int, start: int, end: int) -> list[np.ndarray]:
    """The drafter cache's K and V rows of positions start..end-1 in `lane`, every layer (bf16 bits)."""
    kv = backend.engine.kv
    out = []
    for layer in kv.plan.drafter():
        assert not layer.ring  # (the context fits: slot = position)
        for buf in (kv.k(layer.layer, "drafter"), kv.v(layer.layer, "drafter")):
            at = lane * layer.k_bytes + start * layer.row_bytes
            out.append(buf.download(np.uint16, ((end - start) * layer.row_bytes // 2,), offset=at))
    return out


def test_engines_own_drafter_in_batched_verify(backend):
    """The real (random) drafter: the taps of the batched verify steps keep each sequence's drafter context current
    (no catch-up prefill runs), holding what its one-sequence DFlash steps put there, and at every position the
    drafts a batched verify checks for a sequence (carried to its rows on the device) are those its one-sequence
    steps check there; every committed token is plain decoding's."""
    requests = {rid: (p, 8, sp) for rid, (p, _, sp) in _requests(3).items()}
    plain = _serve(backend, requests, speculative=False).tokens
    batched: dict[str, dict[int, list[int]]] = {rid: {} for rid in requests}
    lanes: dict[str, int] = {}
    runners = []

    def capture(runner) -> None:
        runners.append(runner)
        verify = runner.batched
        commit = verify._commit

        def recording(seq, step, tokens, inputs):
            r0, k = step.first[seq.request_id], step.verified.get(seq.request_id, 0)
            lanes[seq.request_id] = seq.lane
            batched[seq.request_id][seq.num_tokens - 1] = inputs[r0 + 1 : r0 + 1 + k]
            return commit(seq, step, tokens, inputs)

        verify._commit = recording

    run = _serve(backend, requests, speculative=True, between=lambda i, core: i or capture(core.runner))
    assert run.tokens == plain and run.speculation["speculative_steps"] >= 3 * 6
    assert runners[0].caught_up_tokens == 0
    # every position's context (a plain batched step keeps its taps too)
    end = {rid: runners[0].spec.lanes[lanes[rid]].draft_upto for rid in requests}
    assert all(end[rid] == len(p) + len(plain[rid]) - 1 for rid, (p, _, _) in requests.items()), end
    context = {rid: _drafter_context(backend, lanes[rid], len(p), end[rid]) for rid, (p, _, _) in requests.items()}
    dflash = backend.engine.dflash
    wait = dflash.wait
    for rid, (prompt, n, sp) in requests.items():
        alone: dict[int, list[int]] = {}
        at = [len(prompt)]

        def recording(launch):
            drafts, target, accepted = wait(launch)
            alone[at[0]] = drafts
            at[0] += accepted
            return drafts, target, accepted

        dflash.wait = recording
        try:
            _serve(backend, {rid: (prompt, n, sp)}, speculative=True, lanes=1)
        finally:
            dflash.wait = wait
        for got, want in zip(context[rid], _drafter_context(backend, 0, len(prompt), end[rid])):
            assert np.array_equal(got, want), rid
        assert len(batched[rid]) >= 5 and set(batched[rid]) <= set(alone), rid
        for pos, drafts in batched[rid].items():
            assert drafts == alone[pos][: len(drafts)], (rid, pos)
    assert {t for d in batched.values() for ds in d.values() for t in ds} != {0}  # (the rows' ids until drafts land)


def test_emulated_acceptance_commits_k_drafts_as_each_alone(backend):
    """`emulate_acceptance(K)`: every batched verify commits K drafts + 1, and each request's tokens and accepted
    lengths are those of its one-sequence DFlash steps under the same emulation."""
    k = 2
    backend.emulate_acceptance(k)
    requests = _requests(LANES)
    run = _serve(backend, requests, speculative=True)
    assert max(len(v) for v in _verified(run)) == LANES
    spec = run.speculation
    assert spec["accepted_tokens"] >= k * (spec["speculative_steps"] - LANES)  # (a last step may be cut)
    for rid, req in list(requests.items())[::2]:  # (greedy and seeded ones)
        alone = _serve(backend, {rid: req}, speculative=True)
        assert run.tokens[rid] == alone.tokens[rid], rid
        assert run.accepted[rid] == alone.accepted[rid] and set(alone.accepted[rid][:-1]) == {k}, rid


def test_preemption_and_abort_between_verify_steps(backend):
    """A KV budget that preempts sequences between their verify steps (each resumes by recompute and drafts
    again) and a request aborted mid-run: every other request decodes what it decodes without speculation."""
    requests = _requests(4)
    plain = _serve(backend, requests, speculative=False).tokens
    _force_plain_drafts(backend, requests, plain)
    run = _serve(backend, requests, speculative=True, kv_tokens=KV_PAGE * 11)
    assert run.tokens == plain and run.preemptions > 0
    assert run.speculation["accepted_tokens"] > 0
    gone = "r3"

    def abort(step: int, core) -> None:
        if step == 2:  # (after its prefill and its first verify step)
            core.abort(gone)

    run = _serve(backend, requests, speculative=True, between=abort)
    assert {r: t for r, t in run.tokens.items() if r != gone} == {r: t for r, t in plain.items() if r != gone}
    assert len(run.tokens[gone]) < len(plain[gone])


def test_grammar_request_beside_drafting_ones(backend, tiny_checkpoint, tiny_ckpt):
    """A request with a grammar (masked: the one-sequence DFlash graph would not draft it) drafts in the batched
    verify steps of the others, every one of its rows masked; a grammar that fails at its third token (a request
    that does not speculate: a plain processed row of those steps) fails its request alone."""
    llguidance = pytest.importorskip("llguidance")
    from test_fault_isolation import FailingGrammar
    from thorgen.runtime.text.grammar import Grammar, tokenizer

    tok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), tiny_ckpt.spec.target.vocab_size, (1,))
    regex = Grammar(llguidance.LLMatcher.grammar_from_regex(r"[a-z ]{4,40}\."), tok)
    requests = _requests(4)
    prompt, n, _ = requests["r2"]
    requests["r2"] = (prompt, n, replace(GREEDY, grammar=regex))
    plain = _serve(backend, requests, speculative=False, stop_ids=STOP).tokens
    _force_plain_drafts(backend, requests, plain)
    run = _serve(backend, requests, speculative=True, stop_ids=STOP)
    assert run.tokens == plain
    verified = _verified(run)
    assert any("r2" in v and len(v) >= 2 for v in verified) and max(run.accepted["r2"]) >= 1
    assert any(k.endswith("_taps_ext") for k in backend.engine.launches.graphs)
    # a failing grammar (not speculative: its matcher has no free state) beside the drafting requests
    requests["r2"] = (prompt, n, replace(GREEDY, grammar=FailingGrammar(3)))
    run = _serve(backend, requests, speculative=True, plain=frozenset({"r2"}), stop_ids=STOP)
    assert set(run.errors) == {"r2"} and len(run.tokens["r2"]) == 2  # (the prefill's token, then one more)
    assert {r: t for r, t in run.tokens.items() if r != "r2"} == {r: t for r, t in plain.items() if r != "r2"}


def test_requests_admitted_into_a_crowd_decode_plain(backend):
    """Requests admitted while more want the engine than a batched verify step could give one draft each (17
    queued on 8 lanes) decode plain to their end, their prompts without the DFlash taps; once fewer are left, those
    admitted then draft; every request's tokens are plain decoding's."""
    requests = {rid: (p, 10, sp) for rid, (p, _, sp) in _requests(MAX_BATCH // 2 + 1).items()}
    plain = _serve(backend, requests, speculative=False, lanes=LANES).tokens
    run = _serve(backend, requests, speculative=True, lanes=LANES)
    assert run.tokens == plain
    drafted = {rid for step in _verified(run) for rid in step}
    crowd = {f"r{i}" for i in range(LANES)}  # (admitted while all 17 were there)
    assert drafted and not drafted & crowd, drafted


def test_cost_model_lets_the_policy_draft_per_sequence(backend):
    """speculative_cost for a step of several sequences: finite while a sequence's equal share of the batched
    step's rows holds its drafts, growing with them; at the full model's size (the model fitted to an H100's
    server runs) 4 streams draft 7 each and 8 streams 3 each while their estimate climbs towards 3, 16 streams stay
    plain even with every draft landing (a 32-row verify step measured 0.89x of their plain steps there), and
    none drafts at 32; the draft policy drafts for a sequence whose drafts land and not for one whose drafts
    miss."""
    from thorgen.model_spec.presets import get_preset
    from thorgen.runtime.cuda.spec_batch import batched_verify_cost

    runner = backend.runner(LANES)
    cost = runner.speculative_cost
    assert 1 < cost(1, 4) < cost(4, 4) < cost(7, 4) < float("inf") and cost(8, 4) == cost(4, 8) == float("inf")
    planner = DraftPlanner(cost, 15, 256)
    assert planner.best(estimate=3.0, cap=15, batch=4) == (MAX_BATCH // 4 - 1, True)  # (its share of the rows)
    assert planner.best(estimate=0.0, cap=15, batch=4)[1] is False
    moe = get_preset("gemma-4-26b-a4b").target
    full = DraftPlanner(lambda k, b: batched_verify_cost(k, b, moe.num_experts, moe.top_k_experts), 15, 4096)
    assert full.best(estimate=6.0, cap=15, batch=4) == (7, True)
    assert full.best(estimate=2.5, cap=15, batch=8) == (3, True)
    assert full.best(estimate=15.0, cap=15, batch=16)[1] is False
    assert full.best(estimate=15.0, cap=15, batch=32)[1] is False


def test_free_text_before_a_grammar_opens_is_drafted_in_batched_verify(backend, tiny_checkpoint, tiny_ckpt):
    """A grammar that a token of the answer opens (a tool call under tool_choice auto) leaves the tokens before it
    free: that request drafts in the batched verify steps beside the others until the opening token, its block cut
    right after it (its rows were not masked), then drafts on with every row masked; every request's tokens equal
    plain decoding's."""
    pytest.importorskip("llguidance")
    from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer

    requests = _requests(3)
    free = _serve(backend, requests, speculative=False).tokens["r1"]  # (the seeded one)
    at = next(i for i, t in enumerate(free) if i >= 3 and t not in free[:i])  # (its first occurrence opens it)
    tok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), tiny_ckpt.spec.target.vocab_size, (1,))
    prompt, n, sp = requests["r1"]
    requests["r1"] = (prompt, n + 8, replace(sp, grammar=Grammar(json_grammar(None, tok), tok, trigger=free[at])))
    plain = _serve(backend, requests, speculative=False, stop_ids=STOP).tokens
    assert plain["r1"][: at + 1] == free[: at + 1] and plain["r1"][at + 1 :] != free[at + 1 : len(plain["r1"])]
    _force_plain_drafts(backend, requests, plain)
    run = _serve(backend, requests, speculative=True, stop_ids=STOP)
    assert run.tokens == plain
    opened = len(prompt) + at  # the opening token's position (a step at position p commits p + 1 onwards)
    drafted = [pos for v in _verified(run) for rid, (pos, _, _) in v.items() if rid == "r1"]
    assert drafted and min(drafted) < opened < max(drafted)  # drafts while free, then under the grammar
    # the verify step that committed it stopped there, although its drafts of positions pos + 1..opened (slots
    # 0..opened - pos - 1) were all right: without the grammar it would have committed one more
    pos, (chain, drafts) = next(s["r1"] for s in run.steps if "r1" in s and s["r1"][0] + len(s["r1"][1][0]) == opened)
    assert drafts >= opened - pos and _wrong_slot(pos) >= opened - pos, (pos, chain, drafts)


def test_drafts_that_miss_turn_into_plain_batched_steps_and_probes(backend):
    """The default (adaptive) draft policy with the real (random) drafter beside another sequence: after a few
    batched verify steps whose drafts all miss, speculation is off and the sequences decode in plain batched steps
    launched ahead, with the taps that keep their drafter context current; a probe then verifies in a batch again
    with no catch-up. Every token is plain decoding's."""
    requests = {rid: (p, 60, sp) for rid, (p, _, sp) in _requests(2).items()}
    plain = _serve(backend, requests, speculative=False).tokens
    runners = []
    run = _serve(
        backend, requests, speculative=True, drafts=None, between=lambda i, core: i or runners.append(core.runner)
    )
    assert run.tokens == plain
    runner, verified = runners[0], _verified(run)
    drafting = [i for i, v in enumerate(verified) if v]
    assert len(drafting) >= 3 and max(len(v) for v in verified) == 2  # (both sequences drafted together)
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert max(gaps) >= DraftOptions().probe_every  # a probe after the plain steps
    assert runner.caught_up_tokens == 0 and runner.ahead_steps > DraftOptions().probe_every  # (plain: launched ahead)
    assert run.speculation["accepted_tokens"] == 0 and run.speculation["speculative_steps"] == sum(map(len, verified))
