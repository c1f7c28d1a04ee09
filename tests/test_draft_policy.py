"""The draft policy (runtime/engine/speculation.py): adaptive draft counts, back-off to plain steps when drafts
miss, probes that switch speculation back on, and output identical to plain decoding throughout."""

from __future__ import annotations

import pytest

from test_speculative import ScriptedDrafter, prompt

from thorgen.runtime.backend import GenerationResult, SamplingParams
from thorgen.runtime.engine.sequence import Sequence
from thorgen.runtime.engine.speculation import DraftPlanner
from thorgen.runtime.options import DraftOptions
from thorgen.runtime.reference.backend import ReferenceBackend

FLAT = 2.1  # a DFlash step's cost on the cuda engine, in plain steps, whatever its draft count


def _seq(draft_tokens: int | None = None, max_tokens: int = 10_000) -> Sequence:
    return Sequence("r", [2, 3], SamplingParams(draft_tokens=draft_tokens), max_tokens, speculative=True)


def _run(planner: DraftPlanner, seq: Sequence, steps: int, accepted, batch: int = 1) -> list[int]:
    """Plan and record `steps` steps in a batch of `batch`, step i accepting accepted(i, drafts) drafts: the
    drafts of each step."""
    out = []
    for i in range(steps):
        planner.plan(seq, batch)
        out.append(seq.drafts)
        planner.record(seq, seq.drafts, accepted(i, seq.drafts) if seq.drafts else 0)
    return out


def test_zero_acceptance_switches_off_and_probes_with_growing_waits() -> None:
    options = DraftOptions()
    planner = DraftPlanner(lambda k, b: FLAT, 15, 1 << 20, options)
    drafts = _run(planner, _seq(), 600, lambda i, k: 0)
    first_off = drafts.index(0)
    assert 0 < first_off <= 8  # prior 4 decays below the step's cost within a few steps
    assert all(d == 15 for d in drafts[:first_off])  # a flat cost: the most drafts, while on
    probes = [i for i in range(first_off, len(drafts)) if drafts[i]]
    gaps = [b - a - 1 for a, b in zip([first_off - 1] + probes, probes)]
    assert gaps[0] == options.probe_every
    assert gaps == [min(options.probe_every << n, options.probe_max) for n in range(len(gaps))]
    assert len(probes) <= 6  # 600 steps: plain but for a handful of probes


def test_the_cost_model_is_asked_once_per_draft_count_and_batch() -> None:
    """Planning every sequence of a batch at every step asks the runner's cost model each (drafts, batch) once:
    the model is fixed, and at 16 sequences it was asked ~480 times a step on the host's critical path."""
    asked: list[tuple[int, int]] = []

    def cost(k: int, b: int) -> float:
        asked.append((k, b))
        return 1 + 0.1 * k * b

    planner = DraftPlanner(cost, 15, 1 << 20)
    seqs = [_seq() for _ in range(16)]
    for _ in range(5):
        for seq in seqs:
            planner.plan(seq, len(seqs))
            planner.record(seq, seq.drafts, 1 if seq.drafts else 0)
    assert asked and len(asked) == len(set(asked)) and {b for _, b in asked} == {16}
    assert planner.cost(3, 16) == cost(3, 16)


def test_a_probe_that_lands_switches_speculation_back_on() -> None:
    planner = DraftPlanner(lambda k, b: FLAT, 15, 1 << 20)
    seq = _seq()
    drafts = _run(planner, seq, 60, lambda i, k: 0)
    assert drafts[-1] == 0 and sum(1 for d in drafts if d) < 10
    more = _run(planner, seq, 200, lambda i, k: k)  # every draft lands from now on
    probe = next(i for i, d in enumerate(more) if d)
    assert all(d == 15 for d in more[probe:])  # on again at the first probe, and it stays on


def test_draft_counts_follow_the_estimate_on_a_per_draft_cost() -> None:
    planner = DraftPlanner(lambda k, b: 1.2 + 0.1 * k, 15, 1 << 20)
    seq = _seq()
    up = _run(planner, seq, 20, lambda i, k: k)
    assert up[0] < 15 and up[-1] == 15 and up == sorted(up)  # grows while everything lands
    down = _run(planner, seq, 8, lambda i, k: 1)
    assert down[-1] < 6 and down == sorted(down, reverse=True)  # shrinks to what lands
    capped = _seq(draft_tokens=3)
    assert set(_run(planner, capped, 10, lambda i, k: k)) == {3}  # the request's own cap


def test_fixed_policy_and_the_room_left() -> None:
    fixed = DraftPlanner(lambda k, b: FLAT, 15, 1 << 20, DraftOptions(adaptive=False))
    assert _run(fixed, _seq(), 30, lambda i, k: 0) == [15] * 30
    near_end = _seq(max_tokens=4)
    near_end.output = [5, 6]
    fixed.plan(near_end)
    assert near_end.drafts == 1  # room 2: one draft and the bonus token
    with pytest.raises(ValueError):
        DraftOptions(probe_every=0)


def _stream(backend: ReferenceBackend, ids: list[int], n: int, speculative: bool):
    result = GenerationResult()
    steps = list(backend.generate_stream(ids, n, SamplingParams(), speculative=speculative, result=result))
    return result.token_ids, [s.accepted for s in steps[1:]]


def test_drafts_that_never_land_turn_into_plain_steps(tiny_ckpt) -> None:
    ids, n = prompt(12, 21), 140
    plain = ReferenceBackend(tiny_ckpt, prefix_cache=False).generate(ids, n, SamplingParams()).token_ids
    never = ScriptedDrafter(ids + plain, [0] * 1000, 16, tiny_ckpt.spec.target.vocab_size)  # slot 1 always wrong
    tokens, accepted = _stream(ReferenceBackend(tiny_ckpt, drafter=never, prefix_cache=False), ids, n, True)
    assert tokens == plain
    verify = [i for i, a in enumerate(accepted) if a is not None]
    assert all(accepted[i] == 0 for i in verify)
    off = next(i for i, a in enumerate(accepted) if a is None)
    assert off <= 12 and verify[:off] == list(range(off))  # drafts while on, then off within a few steps
    probes = [i for i in verify if i > off]
    assert probes and probes[0] - off == DraftOptions().probe_every  # one probe after the first wait
    assert never.calls == len(verify)  # a plain step runs no drafter
    assert len(verify) <= off + 3


def test_a_drafter_that_starts_landing_is_used_again(tiny_ckpt) -> None:
    ids, n = prompt(12, 22), 120
    plain = ReferenceBackend(tiny_ckpt, prefix_cache=False).generate(ids, n, SamplingParams()).token_ids
    late = ScriptedDrafter(ids + plain, [0] * 8 + [15] * 100, 16, tiny_ckpt.spec.target.vocab_size)
    tokens, accepted = _stream(ReferenceBackend(tiny_ckpt, drafter=late, prefix_cache=False), ids, n, True)
    assert tokens == plain
    off = accepted.index(None)
    landed = next(i for i, a in enumerate(accepted) if a and i > off)
    assert all(a is not None for a in accepted[landed:])  # speculative again from the probe that landed on
    assert max(a for a in accepted if a is not None) >= 8


def test_no_drafts_where_the_runner_cannot_verify_them_in_a_batch() -> None:
    """A runner whose batched steps are plain ones (the cuda engine's) gets no drafts planned beside other
    sequences: the sequence's probe schedule and estimate wait for a step it decodes alone."""
    planner = DraftPlanner(lambda k, b: FLAT if b == 1 else float("inf"), 15, 1 << 20)
    seq = _seq()
    for _ in range(40):
        planner.plan(seq, batch=3)
        assert seq.drafts == seq.drafts_next == 0
        planner.record(seq, 0, 0)
    assert seq.acceptance.estimate == DraftOptions().prior
    planner.plan(seq, batch=1)
    assert seq.drafts == 15


def test_probes_beside_other_sequences_wait_longer_and_stop_where_drafts_cannot_pay() -> None:
    """A probe makes its whole step a verify step: beside b - 1 other sequences its wait is b times longer, and at
    a batch where even drafts that all land would not beat a plain step it never probes."""
    cost = lambda k, b: 1.0 + 0.25 * k * b  # noqa: E731 (a per-draft cost that grows with the batch)
    planner = DraftPlanner(cost, 15, 1 << 20)
    seq = _seq()
    for _ in range(400):
        planner.plan(seq, batch=2)
        planner.record(seq, seq.drafts, 0)
    assert seq.acceptance is not None and seq.acceptance.probe_wait > DraftOptions().probe_every  # it did probe
    drafts = _run(planner, _seq(), 200, lambda i, k: 0, batch=2)
    probes = [i for i, d in enumerate(drafts) if d]
    assert probes[0] == 0  # untested, it probes at once (at batch 2 the prior alone says no)
    # after a miss the wait doubles, and beside another sequence it is twice the lone sequence's
    assert probes[1] - probes[0] - 1 == 2 * 2 * DraftOptions().probe_every
    crowded = _seq()
    for _ in range(300):  # at 8 sequences 1 + k < 1 + 2k for every k: never worth a probe
        planner.plan(crowded, batch=8)
        assert crowded.drafts == 0
        planner.record(crowded, 0, 0)


def test_a_new_sequence_probes_at_once_where_the_prior_says_no() -> None:
    """At a batch where a verify step costs more than the prior's drafts earn, a sequence that has not verified
    yet probes at its first step (not after `probe_every` times the batch plain steps): drafts that land switch
    speculation on from there; drafts that miss leave it off, with the usual growing waits."""
    # (a batched verify of 4 sequences with 7 drafts each: ~5.2 plain steps of cost, spec_batch's model at the full
    # preset's experts; 1 + prior 4 < 5.2, and one probe whose 7 drafts land lifts the estimate past it)
    planner = DraftPlanner(lambda k, b: FLAT if b == 1 else 5.2, 7, 1 << 20)
    assert not planner.best(DraftOptions().prior, 7, 4)[1] and planner.best(7, 7, 4)[1]
    landing = _seq()
    drafts = _run(planner, landing, 40, lambda i, k: k, batch=4)
    assert all(drafts) and landing.drafts_on
    missing = _seq()
    drafts = _run(planner, missing, 100, lambda i, k: 0, batch=4)
    assert drafts[0] > 0 and not any(drafts[1:]) and not missing.drafts_on
