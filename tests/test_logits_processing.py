"""Engine tests (reference backend, tiny checkpoint): logprobs against the model's own softmax (plain and
speculative), penalties and logit_bias against an independent NumPy reference, grammar-constrained JSON from
random weights, and the cuda runner's refusal of all of them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from thorgen.runtime.backend import BackendError, SamplingParams
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.reference.sampling import sample
from thorgen.runtime.engine.sequence import Sequence

CTX = 128
PROMPT = [2] + [110 + (11 * i) % 300 for i in range(9)]


@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    return ReferenceBackend(tiny_ckpt, max_context=CTX, prefix_cache=False)


def _run(backend, sampling: SamplingParams, n: int, speculative: bool = False, prompt=PROMPT):
    core = EngineCore(backend.runner(2))
    core.add("r", prompt, n, sampling, speculative=speculative)
    tokens, logprobs = [], []
    while core.unfinished:
        for out in core.step():
            tokens += out.token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.token_ids)
                logprobs += out.logprobs
    return tokens, logprobs


def _logits(backend, tokens: list[int]) -> np.ndarray:
    """Softcapped logits at every position of one fresh whole-sequence forward."""
    return backend.target.forward(tokens, backend.target.new_cache()).logits.astype(np.float64)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    m = row.max()
    return row - m - np.log(np.sum(np.exp(row - m)))


@pytest.mark.parametrize("sampling", [SamplingParams(logprobs=5), SamplingParams(temperature=1.0, seed=7, logprobs=3)])
def test_logprobs_are_the_models_softmax(backend, sampling):
    tokens, logprobs = _run(backend, sampling, 8)
    plain, none = _run(backend, SamplingParams(temperature=sampling.temperature, seed=sampling.seed), 8)
    assert tokens == plain and none == []  # asking for logprobs changes nothing; not asking returns none
    assert len(logprobs) == len(tokens) == 8
    rows = _logits(backend, PROMPT + tokens)[len(PROMPT) - 1 :]
    for i, (tok, (lp, top)) in enumerate(zip(tokens, logprobs)):
        ref = _log_softmax(rows[i])
        assert lp == pytest.approx(ref[tok], abs=1e-4)
        want = np.argsort(-ref, kind="stable")[: sampling.logprobs]
        assert [t for t, _ in top] == [int(t) for t in want]
        assert [v for _, v in top] == pytest.approx([ref[t] for t in want], abs=1e-4)
        if sampling.greedy:
            assert top[0][0] == tok


def test_logprobs_with_speculation_match_plain(backend):
    assert backend.drafter is not None
    sampling = SamplingParams(logprobs=2)
    plain, lp_plain = _run(backend, sampling, 12)
    spec, lp_spec = _run(backend, sampling, 12, speculative=True)
    assert spec == plain
    for (a, ta), (b, tb) in zip(lp_plain, lp_spec):
        assert a == pytest.approx(b, abs=1e-4) and [t for t, _ in ta] == [t for t, _ in tb]


def _reference(backend, sampling: SamplingParams, n: int) -> list[int]:
    """Token by token from whole-sequence forwards, with vLLM's penalty formulas written out here."""
    out: list[int] = []
    for _ in range(n):
        row = _logits(backend, PROMPT + out)[-1]
        if sampling.repetition_penalty != 1.0:
            for t in set(PROMPT + out):
                row[t] = row[t] / sampling.repetition_penalty if row[t] > 0 else row[t] * sampling.repetition_penalty
        for t in set(out):
            row[t] -= sampling.frequency_penalty * out.count(t) + sampling.presence_penalty
        for t, b in sampling.logit_bias:
            row[t] += b
        out.append(sample(row, sampling, len(PROMPT) + len(out)))
    return out


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(repetition_penalty=1.8),
        SamplingParams(frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(temperature=0.8, seed=3, presence_penalty=-1.0, frequency_penalty=2.0, repetition_penalty=0.7),
        SamplingParams(temperature=1.0, seed=5, logit_bias=((200, 3.0), (131, -100.0))),
    ],
)
def test_penalties_and_bias_match_numpy(backend, sampling):
    tokens, _ = _run(backend, sampling, 10, speculative=True)  # speculation is skipped for processed requests
    assert tokens == _reference(backend, sampling, 10)


def test_penalties_change_the_output(backend):
    plain, _ = _run(backend, SamplingParams(), 10)
    assert len(set(plain)) < 10  # the tiny model repeats itself greedily ...
    penalised, _ = _run(backend, SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), 10)
    assert penalised != plain
    forced, _ = _run(backend, SamplingParams(logit_bias=((333, 100.0),)), 4)
    assert forced == [333] * 4


def test_logit_bias_clamped_and_checked(backend):
    assert SamplingParams(logit_bias=((5, 1e9), (1, -1e9))).logit_bias == ((1, -100.0), (5, 100.0))
    core = EngineCore(backend.runner(1))
    with pytest.raises(BackendError, match="logit_bias token ids"):
        core.add("x", PROMPT, 2, SamplingParams(logit_bias=((10**6, 1.0),)))
    with pytest.raises(ValueError, match="top logprobs"):
        SamplingParams(logprobs=21)


def test_grammar_makes_random_weights_write_json(backend, tiny_checkpoint):
    pytest.importorskip("llguidance")
    from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer
    from thorgen.runtime.text.tokenizer import Tokenizer

    tok_path = tiny_checkpoint / "tokenizer.json"
    vocab = backend.spec.target.vocab_size
    lltok = tokenizer(str(tok_path), vocab, (1,))
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    grammar = Grammar(json_grammar(schema, lltok), lltok)
    with pytest.raises(ValueError, match="schema is invalid"):
        json_grammar({"type": "object", "properties": {"a": {"type": "no-such-type"}}}, lltok)
    tokenizer = Tokenizer.from_file(tok_path)
    for seed in range(3):
        core = EngineCore(backend.runner(1))
        core.add("g", PROMPT, 60, SamplingParams(temperature=1.0, seed=seed, grammar=grammar), frozenset({1}))
        tokens, reason = [], None
        while core.unfinished:
            for out in core.step():
                tokens += out.token_ids
                reason = out.result.finish_reason if out.finished else reason
        assert reason == "stop" and tokens[-1] == 1
        value = json.loads(tokenizer.decode(tokens[:-1]))
        assert isinstance(value["ok"], bool) and value["n"] in (1, 2, 3) and set(value) == {"ok", "n"}


def test_cuda_engine_checks_extended_sampling():
    """Without the lm_logits kernels the cuda engine refuses processing / logprobs, naming them; with them it
    still refuses what the device lists cannot hold (logit_bias ids outside the vocabulary, > 300 entries)."""
    from thorgen.runtime.cuda.engine import MAX_LOGIT_BIAS, Engine

    def engine(missing):
        return SimpleNamespace(
            speculative=True, ext_missing=missing, spec=SimpleNamespace(target=SimpleNamespace(vocab_size=512))
        )

    old = engine(["logits processing (lm_process.cu.j2 with {'V': 512})"])
    Engine.check_request(old, Sequence("a", [2, 3], SamplingParams(temperature=1.0), 4))
    for sampling, name in [
        (SamplingParams(logprobs=0), "logprobs"),
        (SamplingParams(presence_penalty=0.5), "presence_penalty"),
        (SamplingParams(logit_bias=((3, 1.0),)), "logit_bias"),
    ]:
        with pytest.raises(BackendError, match=f"{name}.* needs kernels this build lacks .*lm_process"):
            Engine.check_request(old, Sequence("a", [2, 3], sampling, 4))
    new = engine([])
    Engine.check_request(new, Sequence("a", [2, 3], SamplingParams(logit_bias=((3, 1.0),), logprobs=2), 4))
    with pytest.raises(BackendError, match="outside the vocabulary"):
        Engine.check_request(new, Sequence("a", [2, 3], SamplingParams(logit_bias=((600, 1.0),)), 4))
    many = tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))
    with pytest.raises(BackendError, match=f"at most {MAX_LOGIT_BIAS}"):
        Engine.check_request(new, Sequence("a", [2, 3], SamplingParams(logit_bias=many), 4))


def test_grammar_starts_after_the_thought_channel(backend, tiny_checkpoint):
    pytest.importorskip("llguidance")
    from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer

    lltok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), backend.spec.target.vocab_size, (1,))
    grammar = Grammar(json_grammar(None, lltok), lltok, thought=(100, 101))
    m = grammar.matcher()
    first = m.allowed(512)
    assert first[100] and not first[101] and first.sum() < 100  # the channel may open; else JSON must start
    m.accept(100)
    assert m.allowed(512) is None  # inside the thought: unconstrained
    m.accept(300)
    m.accept(101)
    after = m.allowed(512)
    assert not after[100] and after.sum() < 100
    direct = grammar.matcher()
    brace = int(np.flatnonzero(direct.allowed(512) & ~np.eye(512, dtype=bool)[100])[0])
    direct.accept(brace)  # a first token that is not the channel opener starts the grammar at once
    assert not direct.allowed(512)[100]
