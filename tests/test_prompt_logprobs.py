"""Prompt logprobs (SamplingParams.prompt_logprobs: completions' `echo`, lm-eval's loglikelihood) through the engine
core on the reference backend: every prompt token after the first gets the log-softmax of the softcapped logits
that predict it (the model's own distribution, one full forward as the oracle), across prefill chunks and
interleaved decodes; a prefix-cache hit does not skip them; the generated tokens are unchanged. The cuda runner's
form of the same is in tests/test_cuda_logits_emulated.py."""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.runtime.backend import GenerationResult, SamplingParams
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.reference.logits import log_softmax

CTX = 160
LP_TOL = 1e-9  # the same float64 log-softmax of the same logits: only summation order may differ


@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    return ReferenceBackend(tiny_ckpt, max_context=CTX, prefix_cache=True)


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [110 + (salt * 37 + 11 * i) % 400 for i in range(n - 1)]


def _oracle(backend, prompt: list[int]) -> np.ndarray:
    """log-softmax rows [P, V] of one whole-prompt forward (row i predicts token i+1)."""
    m = backend.target
    logits = m.forward(prompt, m.new_cache(), last_only=False).logits
    return np.stack([log_softmax(r) for r in logits])


def _check(backend, prompt, entries, top):
    lp = _oracle(backend, prompt)
    assert len(entries) == len(prompt) and entries[0] is None
    for i, (value, alts) in enumerate(entries[1:], start=1):
        assert abs(value - lp[i - 1, prompt[i]]) <= LP_TOL, (i, value, lp[i - 1, prompt[i]])
        want = np.argsort(-lp[i - 1], kind="stable")[:top]
        assert [t for t, _ in alts] == want.tolist(), i
        assert np.allclose([v for _, v in alts], lp[i - 1, want], atol=LP_TOL)


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_logprobs_match_one_full_forward(backend, top):
    prompt = _prompt(37, 1)
    plain = backend.generate(prompt, 4, SamplingParams())
    got = backend.generate(prompt, 4, SamplingParams(prompt_logprobs=top))
    assert got.token_ids == plain.token_ids
    _check(backend, prompt, got.prompt_logprobs, top)


def test_prompt_logprobs_across_chunks_beside_decodes_and_after_a_cache_hit(backend):
    """Small prefill chunks interleaved with another sequence's decode steps; then the same prompt again, which
    the prefix cache holds (it must still be scored, and report no cached tokens)."""
    runner = backend.runner(max_num_seqs=2)
    runner.prefill_chunk = 16
    core = EngineCore(runner, max_step_tokens=24)
    other, prompt = _prompt(20, 2), _prompt(61, 3)
    core.add("other", other, 30, SamplingParams())
    core.add("scored", prompt, 3, SamplingParams(prompt_logprobs=2))
    firsts, results = {}, {}
    while core.unfinished:
        for out in core.step():
            if out.finished:
                results[out.request_id] = out.result
            elif out.request_id not in firsts:
                firsts[out.request_id] = out
    assert firsts["other"].prompt_logprobs is None
    _check(backend, prompt, firsts["scored"].prompt_logprobs, 2)
    again = GenerationResult()
    for _ in backend.generate_stream(prompt, 3, SamplingParams(prompt_logprobs=2), result=again):
        pass
    assert again.cached_prompt_tokens == 0 and again.token_ids == results["scored"].token_ids
    _check(backend, prompt, again.prompt_logprobs, 2)


def test_bad_prompt_logprobs():
    with pytest.raises(ValueError, match="prompt logprobs 21"):
        SamplingParams(prompt_logprobs=21)
