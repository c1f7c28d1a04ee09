"""A failure in one sequence stays in that sequence: with 8 sequences in flight on the reference backend and on the
cuda backend (CPU emulator), a fault injected into one sequence at each stage (prefill, decode, logits processing,
grammar, speculative verify) finishes it alone with its own error, while the other seven produce exactly what they
produce alone and the engine stays healthy."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from thorgen.runtime.backend import EngineStateLost, SamplingParams, SequenceFailed  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402

N_SEQS, NEW_TOKENS, VICTIM = 8, 5, "r3"


def _requests() -> dict[str, tuple[list[int], SamplingParams]]:
    """8 requests of different lengths, greedy and seeded (every one its own seed: the injections find the victim
    by it)."""
    out = {}
    for i in range(N_SEQS):
        prompt = [2] + [110 + (i * 37 + 11 * j) % 400 for j in range(2 + i % 3)]
        sp = SamplingParams(temperature=0.9, top_k=40, seed=100 + i) if i % 2 else SamplingParams(seed=100 + i)
        out[f"r{i}"] = (prompt, sp)
    return out


VICTIM_SEED = _requests()[VICTIM][1].seed


def _serve(core: EngineCore, requests: dict, speculative: bool = False) -> tuple[dict, dict]:
    """Run `requests` together to the end: (tokens of each request, the error of each that failed)."""
    for rid, (prompt, sp) in requests.items():
        core.add(rid, prompt, NEW_TOKENS, sp, speculative=speculative)
    tokens, errors = {rid: [] for rid in requests}, {}
    for _ in range(500):
        if not core.unfinished:
            return tokens, errors
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.error is not None:
                errors[out.request_id] = out.error
    raise AssertionError("the engine did not finish")


def _check_isolated(runner_for: Callable[[int], object], inject: Callable[[object], None], alone: dict,
                    requests: dict | None = None, speculative: bool = False, request_fault: bool = False) -> None:
    requests = requests or _requests()
    runner = runner_for(N_SEQS)
    before = dict(vars(runner))
    inject(runner)
    core = EngineCore(runner)
    tokens, errors = _serve(core, requests, speculative)
    assert set(errors) == {VICTIM}, errors
    error = errors[VICTIM]
    assert isinstance(error, SequenceFailed) and error.request_id == VICTIM
    assert error.request_fault is request_fault, error
    assert str(error).startswith(f"request {VICTIM}:") and not any(f"r{i}" in str(error).replace(VICTIM, "")
                                                                    for i in range(N_SEQS)), error
    for rid in requests:
        if rid != VICTIM:
            assert tokens[rid] == alone[rid], f"{rid}: {tokens[rid]} beside the fault, {alone[rid]} alone"
    assert core.unfinished == 0 and core.scheduler.pool.used == 0  # the victim's blocks came back too
    # the engine is healthy: the same runner, its fault taken out, serves the victim's plain request as if alone
    vars(runner).clear()
    vars(runner).update(before)
    again, errors = _serve(EngineCore(runner), {VICTIM: _requests()[VICTIM]}, speculative)
    assert errors == {} and again[VICTIM] == alone[VICTIM]


def _alone(runner_for, requests: dict, speculative: bool = False) -> dict:
    return {rid: _serve(EngineCore(runner_for(1)), {rid: req}, speculative)[0][rid] for rid, req in requests.items()}


def _is_victim(sampling: SamplingParams) -> bool:
    return sampling.seed == VICTIM_SEED


def _overflowing(sp: SamplingParams) -> SamplingParams:
    """`sp` with repetition_penalty 1e-300, past SamplingParams' own check (as a request might once have been)."""
    out = replace(sp, repetition_penalty=2.0)
    object.__setattr__(out, "repetition_penalty", 1e-300)
    return out


class FailingGrammar:
    """A grammar that allows every token; its matcher raises at the `at`-th token it is given (in `accept`), or
    when asked for its mask then (`in_mask`)."""

    def __init__(self, at: int, in_mask: bool = False) -> None:
        self.at, self.in_mask = at, in_mask

    def matcher(self) -> "FailingGrammar.Matcher":
        return FailingGrammar.Matcher(self)

    class Matcher:
        def __init__(self, grammar: "FailingGrammar") -> None:
            self.grammar, self.accepted = grammar, 0

        def allowed(self, vocab: int) -> np.ndarray:
            if self.grammar.in_mask and self.accepted == self.grammar.at:
                raise RuntimeError("grammar state corrupted")
            return np.ones(vocab, bool)

        def accept(self, token: int) -> None:
            self.accepted += 1
            if not self.grammar.in_mask and self.accepted == self.grammar.at:
                raise RuntimeError("grammar state corrupted")


def _with_victim(sampling_of: Callable[[SamplingParams], SamplingParams]) -> dict:
    requests = _requests()
    prompt, sp = requests[VICTIM]
    requests[VICTIM] = (prompt, sampling_of(sp))
    return requests


# -- the reference backend ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    from thorgen.runtime.reference.backend import ReferenceBackend

    backend = ReferenceBackend(tiny_ckpt, max_context=128, prefix_slots=0)
    return backend, _alone(backend.runner, _requests())


def _failing_decoder(runner, method: str, when: Callable[..., bool]) -> None:
    """Make the runner's decoder `method` raise for the victim when `when(*args)` holds."""
    decoder = runner.decoder
    real = getattr(type(decoder), method)

    class Faulty(type(decoder)):
        pass

    def faulty(self, state, *args, **kwargs):
        if when(*args):
            raise RuntimeError("injected fault")
        return real(self, state, *args, **kwargs)
    setattr(Faulty, method, faulty)
    clone = Faulty.__new__(Faulty)
    clone.__dict__.update(decoder.__dict__)
    runner.decoder = clone


def test_reference_prefill_fault(reference):
    backend, alone = reference
    _check_isolated(backend.runner, lambda r: _failing_decoder(
        r, "prefill", lambda ids, sampling, *rest: _is_victim(sampling)), alone)


def test_reference_decode_fault(reference):
    backend, alone = reference
    _check_isolated(backend.runner, lambda r: _failing_decoder(
        r, "step", lambda tok, start, sampling, *rest: _is_victim(sampling) and start >= 5), alone)


def test_reference_logits_processing_overflow_is_the_requests_fault(reference):
    backend, alone = reference
    _check_isolated(backend.runner, lambda r: None, alone, _with_victim(_overflowing), request_fault=True)


@pytest.mark.parametrize("in_mask", [False, True])
def test_reference_grammar_fault(reference, in_mask):
    backend, alone = reference
    _check_isolated(backend.runner, lambda r: None, alone,
                    _with_victim(lambda sp: replace(sp, grammar=FailingGrammar(3, in_mask))))


def test_reference_speculative_verify_fault(reference):
    """Every sequence decodes speculatively (draft + verify); the victim's verify block fails."""
    backend, _ = reference
    alone = _alone(backend.runner, _requests(), speculative=True)
    _check_isolated(backend.runner, lambda r: _failing_decoder(
        r, "step", lambda tok, start, sampling, speculative, *rest: _is_victim(sampling) and speculative
        and start >= 4), alone, speculative=True)


def _failing_decode(runner, error: Callable[[], Exception]) -> None:
    """Make a decode step that holds the victim raise `error()` as a whole (before the runner changes anything),
    from the victim's second decode step on."""
    decode, seen = runner.decode, []

    def faulty(seqs, launched=None):
        if any(s.request_id == VICTIM for s in seqs):
            seen.append(1)
            if len(seen) >= 2:
                raise error()
        return decode(seqs, launched)
    runner.decode = faulty


@pytest.mark.parametrize("named", [True, False])
def test_reference_whole_step_failure_finds_its_culprit(reference, named):
    """A batched step that raises as a whole: run again without the sequence its SequenceFailed names, or (an
    error naming nobody) each sequence alone; the one that fails alone is the culprit."""
    backend, alone = reference
    error = (lambda: SequenceFailed(VICTIM, "injected fault")) if named else (lambda: RuntimeError("injected"))
    _check_isolated(backend.runner, lambda r: _failing_decode(r, error), alone)


def test_a_state_losing_fault_leaves_the_core(reference):
    backend, _ = reference
    runner = backend.runner(N_SEQS)
    _failing_decode(runner, lambda: EngineStateLost("device state unknown"))
    with pytest.raises(EngineStateLost):
        _serve(EngineCore(runner), _requests())


# -- the cuda backend on the CPU emulator ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulated(tiny_checkpoint, tmp_path_factory):
    pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
    import engine_emulator as EE
    from thorgen.runtime.cuda import device as dev

    backend = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("faults"), ctx=128, max_num_seqs=N_SEQS)
    try:
        yield backend, _alone(backend.runner, _requests())
    finally:
        backend.close()
        dev.set_driver(None)


def test_cuda_prefill_fault(emulated):
    backend, alone = emulated

    def inject(runner) -> None:
        prefill = runner.prefill

        def faulty(seq, *args, **kwargs):
            if seq.request_id == VICTIM:
                raise RuntimeError("injected fault")
            return prefill(seq, *args, **kwargs)
        runner.prefill = faulty
    _check_isolated(backend.runner, inject, alone)


@pytest.mark.parametrize("named", [True, False])
def test_cuda_decode_fault(emulated, named):
    backend, alone = emulated
    error = (lambda: SequenceFailed(VICTIM, "injected fault")) if named else (lambda: RuntimeError("injected"))
    _check_isolated(backend.runner, lambda r: _failing_decode(r, error), alone)


def test_cuda_logits_processing_overflow_is_the_requests_fault(emulated):
    """The victim's row of the batched lm_process reports a non-finite value; the other rows commit."""
    backend, alone = emulated
    _check_isolated(backend.runner, lambda r: None, alone, _with_victim(_overflowing), request_fault=True)


@pytest.mark.parametrize("in_mask", [False, True])
def test_cuda_grammar_fault(emulated, in_mask):
    backend, alone = emulated
    _check_isolated(backend.runner, lambda r: None, alone,
                    _with_victim(lambda sp: replace(sp, grammar=FailingGrammar(3, in_mask))))
