"""CPU tests of the drafter context per sequence on the emulated engine (tests/engine_emulator.py): each KV lane
holds its own sequence's DFlash context, so a speculative sequence resumes speculation once it decodes alone after
batched steps (one tap prefill of the positions it missed), a chat's next turn reuses its drafter context while
another speculative request ran in between, and a prefix copied from a running speculative lane brings the drafter
context along. Each request's tokens equal those it gets alone with plain steps. (Where sequences decode together
these tests keep their steps plain, `batched_verify` off: the plain batched steps a sequence runs while the draft
policy has speculation off for it leave its drafter context behind alike.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.cuda.runner import CudaRunner  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.options import DraftOptions  # noqa: E402

SEEDED = SamplingParams(temperature=1.0, seed=9)
FIXED = DraftOptions(adaptive=False)  # every step drafts the most it may: these tests check the drafter context


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("drafter_lanes"), ctx=1024, max_num_seqs=2)
    assert b.engine.speculative, b.engine.spec_missing
    yield b
    b.close()
    dev.set_driver(None)


def _drive(core: EngineCore, adds: dict[int, list[tuple]], limit: int = 400):
    """Step the core, adding (request id, prompt, max tokens, speculative) at the given step numbers; returns each
    request's tokens and GenerationResult."""
    out, results = {}, {}
    for step in range(limit):
        for rid, prompt, n, spec in adds.get(step, []):
            core.add(rid, prompt, n, SEEDED, speculative=spec)
            out[rid] = []
        for o in core.step():
            out[o.request_id] += o.token_ids
            if o.result is not None:
                results[o.request_id] = o.result
        if not core.unfinished and step >= max(adds):
            return out, results
    raise AssertionError("did not finish")


def _plain(backend, prompt: list[int], n: int) -> list[int]:
    return _drive(EngineCore(backend.runner(1), drafts=FIXED), {0: [("p", prompt, n, False)]})[0]["p"]


def test_a_speculative_sequence_resumes_after_batched_steps(backend):
    """Two speculative requests decode together (plain batched steps); once the short one finishes the long one
    catches its drafter context up and speculates again, with the tokens it gets alone."""
    a, b = [2] + list(range(300, 330)), [2] + list(range(400, 420))
    runner = CudaRunner(backend.engine, 2, batched_verify=False)
    out, results = _drive(EngineCore(runner, drafts=FIXED), {0: [("a", a, 40, True), ("b", b, 6, True)]})
    assert runner.caught_up_tokens > 0
    assert results["a"].accepted_lengths, "no speculative step after the batch"
    assert sum(results["a"].accepted_lengths) < 40 - 1  # the batched steps were plain
    assert out["a"] == _plain(backend, a, 40) and out["b"] == _plain(backend, b, 6)


def test_no_catch_up_when_little_is_left(backend):
    """A sequence with fewer tokens to go than the catch-up is worth goes on with plain steps."""
    a, b = [2] + list(range(300, 330)), [2] + list(range(400, 420))
    runner = CudaRunner(backend.engine, 2, batched_verify=False)
    # "a" misses ~60 positions while "b" runs (60 steps), then has 2 or 3 tokens to go: 60 > 16 * 3
    out, results = _drive(EngineCore(runner, drafts=FIXED), {0: [("a", a, 62, True), ("b", b, 60, True)]})
    assert runner.caught_up_tokens == 0 and not results["a"].accepted_lengths
    assert out["a"] == _plain(backend, a, 62)


def test_each_lane_keeps_its_drafter_context(backend):
    """A speculative chat's next turn reuses its cached prefix, drafter context included, although another
    speculative request ran in the other lane in between; it equals a full prefill."""
    first = [2] + list(range(310, 330))
    core = EngineCore(backend.runner(2), drafts=FIXED)
    got, _ = _drive(core, {0: [("t1", first, 6, True)]})
    _drive(core, {0: [("other", [2] + list(range(450, 470)), 6, True)]})
    turn2 = first + got["t1"] + [107]
    hit, res = _drive(core, {0: [("t2", turn2, 6, True)]})
    assert res["t2"].cached_prompt_tokens > 0 and res["t2"].accepted_lengths
    miss, res_miss = _drive(EngineCore(backend.runner(2), drafts=FIXED), {0: [("t2", turn2, 6, True)]})
    assert res_miss["t2"].cached_prompt_tokens == 0 and hit == miss


def test_a_copied_prefix_brings_the_drafter_context(backend):
    """A speculative request admitted while a speculative one with the same system prompt runs copies its K/V and
    drafter context from that lane, and both get the tokens they get alone."""
    shared = [2] + [110 + (13 * i) % 380 for i in range(60)]
    prompts = {"a": shared + [107, 300, 301], "b": shared + [107, 400, 401, 402]}
    core = EngineCore(backend.runner(2), drafts=FIXED)
    out, results = _drive(core, {0: [("a", prompts["a"], 40, True)], 2: [("b", prompts["b"], 10, True)]})
    assert core.kv.copied_tokens == results["b"].cached_prompt_tokens == (len(shared) + 1) // 16 * 16
    assert out == {rid: _plain(backend, p, n) for (rid, p), n in zip(prompts.items(), (40, 10))}
