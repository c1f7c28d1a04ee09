"""The tap ring on the emulated engine (tests/engine_emulator.py): a lone speculative sequence whose drafts never land
decodes plain decoding's tokens, its plain one-row steps keep their taps, and every probe's catch-up projects them
(no tap prefill runs), launched ahead or not; the drafter context a ring catch-up writes equals, exactly, what the
tap prefill of the same positions writes (the emulated one-row step's taps and a prefill's round at the same
points); the ring serves only the lane that recorded it, and not after that lane is claimed (a tap prefill then).
Sequences that decode together keep their drafter context in their plain batched steps (the taps of a verify step
of no drafts): no catch-up, and the context a tap prefill of the same tokens writes.

The GPU test at the bottom (marked gpu) runs the first two on the device, at the tiny preset:
  python -m pytest tests/test_tap_ring_emulated.py -m gpu -q -rA
There the one-row step's taps (M=1 kernels) and a prefill's (M>=2) accumulate in different orders, so the drafter
context rows agree within DRAFT_CONTEXT_TOL (not measured on a GPU yet: the test prints what it finds), and a token
may differ from plain decoding's only at a near-tie (TIE_TOL, as tests/test_engine_speculative_emulated.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.cuda.runner import CudaRunner  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.engine.sequence import Sequence  # noqa: E402

# (the synthetic drafter's drafts never land after this prompt: test_engine_speculative_emulated's random41)
PROMPT = [2] + np.random.default_rng(3).integers(256, 512, 40).tolist()
TOKENS = 80  # after ~5 DFlash steps, probes after 16 and 32 plain steps
DRAFT_CONTEXT_TOL = 5e-2  # GPU only: rel L2 of a catch-up's drafter K/V rows, ring vs tap prefill
TIE_TOL = 1e-2  # GPU only: logit gap at a token that differs from plain decoding's


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("tap_ring"), ctx=1024, max_num_seqs=2)
    fake = dev.driver()
    assert b.engine.speculative, b.engine.spec_missing
    yield b
    dev.set_driver(fake)  # (the GPU test below installs the real driver)
    b.close()
    dev.set_driver(None)


def counted_prefills(runner) -> list[int]:
    """The positions each catch-up tap prefill of `runner` started from, as they run (the prompt's prefill chunks
    go through the runner's own prefill, not this one)."""
    calls: list[int] = []
    prefill = runner.spec.prefill

    def counted(*args, **kwargs):
        calls.append(kwargs["begin"])
        return prefill(*args, **kwargs)

    runner.spec.prefill = counted
    return calls


def drafter_rows(engine, lane: int, start: int, end: int) -> list[np.ndarray]:
    """The bytes of each drafter layer's K and V rows of positions start..end-1 in `lane`."""
    kv, out = engine.kv, []
    engine.stream.synchronize()
    for l in kv.plan.drafter():
        for buf in (kv.k(l.layer, l.model), kv.v(l.layer, l.model)):
            rows = buf.download().reshape(kv.plan.lanes_of(l), l.slots, l.row_bytes)[lane]
            out.append(np.stack([rows[l.slot(p)] for p in range(start, end)]))
    return out


def decode(runner, prompt: list[int], n: int, speculative: bool = True) -> tuple[list[int], dict]:
    """One greedy request alone through an engine core on `runner`: its tokens and the core's speculation totals."""
    core = EngineCore(runner)
    core.add("r", prompt, n, SamplingParams(), speculative=speculative)
    toks: list[int] = []
    while core.unfinished:
        toks += [t for o in core.step() for t in o.token_ids]
    return toks, core.health()["speculation"]


@pytest.mark.parametrize("ahead", [True, False])
def test_probes_catch_up_from_the_ring(backend, ahead):
    engine = backend.engine
    plain = backend.generate(PROMPT, TOKENS, SamplingParams()).token_ids
    runner = CudaRunner(engine, 1, launch_ahead=ahead)
    prefills, projected = counted_prefills(runner), engine.dflash.ring.projected
    toks, spec = decode(runner, PROMPT, TOKENS)
    assert toks == plain
    assert spec["speculative_steps"] > 0 and spec["accepted_tokens"] == 0
    assert runner.caught_up_tokens >= 16 + 32 and prefills == []  # (two probes caught up, from the ring)
    assert engine.dflash.ring.projected - projected == runner.caught_up_tokens
    # (launched ahead, the plain steps with taps ran so too)
    assert runner.ahead_steps > 32 if ahead else runner.ahead_steps == 0


def compare_catch_ups(runner, compare) -> list[tuple[int, int]]:
    """Make each catch-up of `runner` that projects the ring run, right after, the tap prefill of the same
    positions (the catch-up without the ring) over them: compare(rows the ring wrote, rows the prefill wrote), each
    a list of drafter K/V row arrays. Returns the (start, end) of those catch-ups as they run."""
    engine, spec, compared = runner.engine, runner.spec, []
    catch_up, ring = spec.catch_up, runner.engine.dflash.ring

    def checked(seq, lane, pos):
        start, projected = spec.lanes[lane].draft_upto, ring.projected
        ok = catch_up(seq, lane, pos)
        if ring.projected > projected:
            rows = drafter_rows(engine, lane, start, pos)
            spec.prefill(seq.tokens[:pos], seq.sampling.greedy, taps=True, begin=start, lane=lane)
            compare(rows, drafter_rows(engine, lane, start, pos))
            compared.append((start, pos))
        return ok

    spec.catch_up = checked
    return compared


def test_a_ring_catch_up_writes_what_a_tap_prefill_writes(backend):
    """At each probe, the drafter context rows the ring's projection wrote, then the tap prefill of the same
    positions run over them (the catch-up without the ring): the same bytes."""
    runner = CudaRunner(backend.engine, 1)

    def same(ring: list, prefilled: list) -> None:
        assert len(ring) == len(prefilled) and all(np.array_equal(a, b) for a, b in zip(ring, prefilled))

    compared = compare_catch_ups(runner, same)
    prefills = counted_prefills(runner)
    decode(runner, PROMPT, TOKENS)
    assert len(compared) >= 2 and prefills == [start for start, _ in compared]  # (only the comparisons' prefills)


def test_the_ring_serves_only_the_lane_that_recorded_it(backend):
    """Two lanes hold the same prompt and 10 plain steps, lane 0's with their taps kept: lane 1's catch-up runs a
    tap prefill, lane 0's projects the ring; once lane 0 is claimed (another sequence) or written by a copy, the
    ring no longer serves it."""
    engine = backend.engine
    runner = CudaRunner(engine, 2)
    spec, ring = runner.spec, engine.dflash.ring
    prefills = counted_prefills(runner)
    P, end = len(PROMPT), len(PROMPT) + 10
    seqs = []
    for lane in (0, 1):
        spec.claim(lane, 0)  # (admitted: the KV manager's ClaimLane)
        seq = Sequence(f"s{lane}", PROMPT, SamplingParams(), 64, speculative=True)
        seq.output.append(engine.prefill(PROMPT, taps=True, lane=lane))
        spec.lanes[lane].drafted(0, P, taps=True)
        for pos in range(P, end):
            row = spec.tap_row(seq, lane, pos, True) if lane == 0 else None
            seq.output.append(
                engine.steps.wait(engine.steps.launch_one(pos, token=seq.output[-1], lane=lane, tap_row=row))[0]
            )
            spec.lanes[lane].drafted(pos, pos + 1, taps=False)
        seqs.append(seq)
    assert seqs[0].tokens == seqs[1].tokens and ring.book.holds(0, P, end)

    assert spec.catch_up(seqs[1], 1, end) and prefills == [P]  # lane 1: not the ring's
    projected = ring.projected
    assert spec.catch_up(seqs[0], 0, end) and prefills == [P] and ring.projected == projected + 10

    spec.lanes[0].draft_upto = P  # (as before its catch-up)
    spec.claim(0, end)  # another sequence holds lane 0 now, with the same first `end` positions
    assert not ring.book.holds(0, P, end)
    assert spec.catch_up(seqs[0], 0, end) and prefills == [P, P] and ring.projected == projected + 10

    assert spec.tap_row(seqs[0], 0, end, True) is not None and ring.book.holds(0, end, end + 1)
    spec.copied(1, 0, P, drafter=True)  # a prefix copied into lane 0
    assert not ring.book.holds(0, end, end + 1)


def test_batched_plain_steps_keep_the_drafter_context(backend):
    """Two speculative sequences whose drafts never land decode together: their plain batched steps run with the
    taps, so no probe needs a catch-up (no tap prefill, nothing projected), the drafter context each probe finds
    equals, byte for byte, what a tap prefill of the same tokens from position 0 writes, and the tokens are plain
    decoding's."""
    engine = backend.engine
    prompts = [PROMPT, [2] + np.random.default_rng(9).integers(256, 512, 40).tolist()]  # (no shared page)
    plain = [backend.generate(p, TOKENS, SamplingParams()).token_ids for p in prompts]
    runner = CudaRunner(engine, 2)
    spec, projected = runner.spec, engine.dflash.ring.projected
    prefills, probes = counted_prefills(runner), []
    ready = spec.ready

    def kept(seq, lane, pos, rows=False):
        # (a probe after plain batched steps: the drafter context they left)
        start = len(seq.prompt)
        if rows and spec.lanes[lane].draft_upto == pos and pos - start > 16:
            probes.append((seq.tokens[:pos], start, drafter_rows(engine, lane, start, pos)))
        return ready(seq, lane, pos, rows)

    spec.ready = kept
    core = EngineCore(runner)
    for i, p in enumerate(prompts):
        core.add(f"r{i}", p, TOKENS, SamplingParams(), speculative=True)
    out: dict[str, list[int]] = {"r0": [], "r1": []}
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
    assert [out["r0"], out["r1"]] == plain
    assert runner.caught_up_tokens == 0 and prefills == [] and engine.dflash.ring.projected == projected
    assert len(probes) >= 2
    for tokens, start, rows in probes:
        spec.claim(0, 0)
        engine.prefill(tokens, taps=True, lane=0)
        again = drafter_rows(engine, 0, start, len(tokens))
        assert all(np.array_equal(a, b) for a, b in zip(rows, again))


@pytest.mark.gpu
def test_gpu_probes_catch_up_from_the_ring(request):
    """On the device: drafts that never land (each draft token 0), probes whose catch-ups project the ring (no tap
    prefill), plain decoding's tokens but at a near-tie, and each ring catch-up's drafter context within
    DRAFT_CONTEXT_TOL of the tap prefill's."""
    from thorgen.model_spec.nvfp4 import bf16_to_f32
    from thorgen.runtime.cuda import device as D
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.ops import softcap

    D.set_driver(None)  # the real cuda-python driver, never the emulator the tests above install
    tiny_checkpoint, kernels = request.getfixturevalue("built")  # (conftest: skips without a GPU or nvcc)
    backend = open_backend(tiny_checkpoint, ctx=4096, kernels_dir=kernels)
    try:
        engine = backend.engine
        assert backend.features.speculative, engine.spec_missing
        plain = backend.generate(PROMPT, TOKENS, SamplingParams()).token_ids
        engine.dflash.draft_hook = lambda start, last: [0] * 15
        runner = CudaRunner(engine, 1)
        worst: list[float] = []

        def close(ring: list, prefilled: list) -> None:
            a = np.concatenate([bf16_to_f32(r.view(np.uint16)).ravel() for r in ring]).astype(np.float64)
            b = np.concatenate([bf16_to_f32(r.view(np.uint16)).ravel() for r in prefilled]).astype(np.float64)
            worst.append(float(np.linalg.norm(a - b) / np.linalg.norm(b)))

        compared = compare_catch_ups(runner, close)
        prefills = counted_prefills(runner)
        toks, _ = decode(runner, PROMPT, TOKENS)
        print(f"drafter context, ring vs tap prefill: rel L2 {worst} over catch-ups {compared}")
        assert len(compared) >= 2 and prefills == [start for start, _ in compared]
        assert max(worst) <= DRAFT_CONTEXT_TOL
        if toks != plain:  # (greedy: only at a near-tie, from the plain engine's logits)
            i = next(k for k, (a, b) in enumerate(zip(toks, plain)) if a != b)
            engine.prefill(PROMPT + plain[:i], greedy=True)
            z = softcap(engine.logits().astype(np.float64), backend.spec.target.final_logit_softcapping)
            assert abs(z[toks[i]] - z[plain[i]]) <= TIE_TOL, f"token {i} differs from plain decoding's, not at a tie"
    finally:
        backend.close()
