"""Speculative decoding under logits processing on the reference backend: grammars (JSON schema, regex, choice, a
grammar a token opens mid-answer), penalties and min_tokens. Greedy and seeded output equal plain decoding's
token for token, whether the drafts land (a drafter that knows the continuation, with planted mistakes) or not
(the random DFlash drafter), drafts the grammar refuses are cut before the verify, and sampled tokens under a
grammar follow the masked distribution (chi-square over many seeds)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from test_speculative import ScriptedDrafter, prompt

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.engine.sequence import Sequence
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.reference.drafter import DraftContext

llguidance = pytest.importorskip("llguidance")

from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer  # noqa: E402

STOP = frozenset({1})
GREEDY, SAMPLED = SamplingParams(), SamplingParams(temperature=1.0, seed=5)
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}, "name": {"type": "string"}},
    "required": ["ok", "n", "name"],
    "additionalProperties": False,
}
PLAN = [15, 3, 0, 7, 1, 15, 2]  # the landing drafter's planted mistakes, step by step (15: none)


@pytest.fixture(scope="module")
def backend(tiny_ckpt) -> ReferenceBackend:
    return ReferenceBackend(tiny_ckpt, prefix_cache=False)


@pytest.fixture(scope="module")
def lltok(tiny_checkpoint, tiny_ckpt):
    return tokenizer(str(tiny_checkpoint / "tokenizer.json"), tiny_ckpt.spec.target.vocab_size, tuple(STOP))


def _mid_answer(backend) -> tuple[list[int], list[int], int]:
    """(a prompt, its greedy free answer, a token that answer first takes at index 3 or later)."""
    for seed in range(31, 80):
        ids = prompt(9, seed)
        free = backend.generate(ids, 12, GREEDY, STOP).token_ids
        new = [t for i, t in enumerate(free) if i >= 3 and t not in free[:i] and t not in STOP]
        if new:
            return ids, free, new[0]
    raise AssertionError("no prompt's greedy answer takes a new token after its third")


def _grammars(lltok, backend) -> dict[str, Grammar]:
    return {
        "json": Grammar(json_grammar(SCHEMA, lltok), lltok),
        "regex": Grammar(llguidance.LLMatcher.grammar_from_regex(r"(x|y|zz)[0-9]{2,6}(ok|no)"), lltok),
        "choice": Grammar(llguidance.LLMatcher.grammar_from_lark('start: "alpha" | "beta" | "gamma delta"'), lltok),
        # free text until the model's own token opens the grammar mid-answer (a tool call under tool_choice auto)
        "opened": Grammar(json_grammar(None, lltok), lltok, trigger=_mid_answer(backend)[2]),
    }


def _cases(lltok, backend) -> list[tuple[str, SamplingParams]]:
    out = []
    for name, g in _grammars(lltok, backend).items():
        out += [(f"{name}-greedy", replace(GREEDY, grammar=g)), (f"{name}-sampled", replace(SAMPLED, grammar=g))]
    out.append(("penalties", replace(SAMPLED, presence_penalty=1.5, repetition_penalty=1.3, min_tokens=6)))
    out.append(("min_tokens", replace(GREEDY, min_tokens=20)))
    return out


def _landing(tiny_ckpt, ids: list[int], plain: list[int]) -> tuple[ReferenceBackend, ScriptedDrafter]:
    drafter = ScriptedDrafter(ids + plain, PLAN, 16, tiny_ckpt.spec.target.vocab_size)
    return ReferenceBackend(tiny_ckpt, drafter=drafter, prefix_cache=False), drafter


def test_speculation_under_processing_equals_plain(tiny_ckpt, backend, lltok) -> None:
    ids = _mid_answer(backend)[0]
    for name, sampling in _cases(lltok, backend):
        plain = backend.generate(ids, 40, sampling, STOP)
        spec_backend, drafter = _landing(tiny_ckpt, ids, plain.token_ids)
        landed = spec_backend.generate(ids, 40, sampling, STOP, speculative=True)
        assert landed.token_ids == plain.token_ids, name
        assert landed.finish_reason == plain.finish_reason, name
        if len(plain.token_ids) > 8:  # drafts landed: verify steps committed several tokens
            assert max(landed.accepted_lengths) > 2, (name, landed.accepted_lengths)
        assert drafter.calls == len(landed.accepted_lengths)
        random = backend.generate(ids, 40, sampling, STOP, speculative=True)  # the random DFlash drafter
        assert random.token_ids == plain.token_ids, name


def test_the_opened_grammar_constrains_only_after_its_token(backend, lltok) -> None:
    ids, free, _ = _mid_answer(backend)
    g = _grammars(lltok, backend)["opened"]
    at = free.index(g.trigger)
    opened = backend.generate(ids, 12, replace(GREEDY, grammar=g), STOP, speculative=True).token_ids
    assert opened[: at + 1] == free[: at + 1] and opened[at + 1 :] != free[at + 1 :]
    m = g.matcher()
    assert m.allowed(512) is None and m.valid_prefix(free[:at]) == at  # free text: every draft may land


class Guessing:
    """Proposes `guess` for every slot: its drafts land only where the sampled token happens to be it."""

    tap_layers: tuple[int, ...] = ()
    block_size = 16

    def __init__(self, guess: int) -> None:
        self.guess = guess

    def new_context(self) -> DraftContext:
        return DraftContext(None, 0)

    def propose(self, ctx: DraftContext, last_token: int, start: int) -> list[int]:
        return [self.guess] * (self.block_size - 1)


def test_refused_drafts_are_cut_before_the_verify(tiny_ckpt, lltok) -> None:
    g = Grammar(llguidance.LLMatcher.grammar_from_regex(r"[0-9]{8}"), lltok)
    letter = int(np.flatnonzero(~g.matcher().allowed(512))[300])  # a token the grammar never takes
    seq = Sequence("s", [2, 3], replace(GREEDY, grammar=g), 20, STOP)
    seq.prepare(512)
    assert seq.allowed_prefix([letter] * 5) == 0
    digit = int(np.flatnonzero(g.matcher().allowed(512))[0])
    assert 1 <= seq.allowed_prefix([digit] * 9 + [letter]) <= 9
    eager = Sequence("e", [2, 3], replace(GREEDY, min_tokens=4), 20, STOP)
    eager.output = [7, 8]
    # output indexes 2 and 3 may not be a stop id (min_tokens 4), index 4 may
    assert eager.allowed_prefix([1]) == 0 and eager.allowed_prefix([9, 1, 9]) == 1
    assert eager.allowed_prefix([9, 9, 1]) == 3
    spec = ReferenceBackend(tiny_ckpt, drafter=Guessing(letter), prefix_cache=False)
    rows = []
    verify = spec.decoder._forward

    def counted(state, ids, last_only, images=()):
        rows.append(len(ids))
        return verify(state, ids, last_only, images)

    spec.decoder._forward = counted
    result = spec.generate(prompt(7, 3), 8, replace(GREEDY, grammar=g), STOP, speculative=True)
    assert result.accepted_lengths and set(rows[1:]) == {1}  # the prefill, then one-row verify blocks


def _next_probs(backend, ids: list[int], prefix: list[int], g: Grammar) -> np.ndarray:
    """The sampling distribution (temperature 1, the grammar's mask) of the token after ids + prefix."""
    m = g.matcher()
    for t in prefix:
        m.accept(t)
    rows: list[np.ndarray] = []
    backend.decoder.prefill(backend.decoder.new_state(), ids + prefix, SAMPLED, None, score=rows.append)
    row = rows[0][-1]
    z = np.where(m.allowed(row.shape[0]), row.astype(np.float64), -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def test_sampled_tokens_follow_the_masked_distribution(tiny_ckpt, backend, lltok) -> None:
    """Three sampled tokens under a grammar, over many seeds, with a drafter whose drafts land by chance: the joint
    counts match p(t0) p(t1 | t0) p(t2 | t0, t1) of the target's masked softmax (chi-square, cells pooled to an
    expected count of at least 5)."""
    stats = pytest.importorskip("scipy.stats")
    g = Grammar(llguidance.LLMatcher.grammar_from_regex(r"[xy]{3}"), lltok)
    ids = [2, 300, 301, 302]
    first = g.matcher().allowed(512)
    spec = ReferenceBackend(tiny_ckpt, drafter=Guessing(int(np.flatnonzero(first)[-1])), prefix_cache=False)
    seeds = 400
    counts: dict[tuple[int, ...], int] = {}
    landed = 0
    for seed in range(seeds):
        r = spec.generate(ids, 3, replace(SAMPLED, seed=seed, grammar=g), STOP, speculative=True)
        key = tuple(r.token_ids[:3])
        counts[key] = counts.get(key, 0) + 1
        landed += sum(a - 1 for a in r.accepted_lengths)
    assert 0 < landed < seeds  # drafts were accepted, and rejected: the acceptance rule is exercised
    expected: dict[tuple[int, ...], float] = {}
    p0 = _next_probs(backend, ids, [], g)
    for t0 in np.flatnonzero(p0):
        p1 = _next_probs(backend, ids, [int(t0)], g)
        for t1 in np.flatnonzero(p1):
            p2 = _next_probs(backend, ids, [int(t0), int(t1)], g)
            for t2 in np.flatnonzero(p2):
                expected[(int(t0), int(t1), int(t2))] = seeds * p0[t0] * p1[t1] * p2[t2]
    assert set(counts) <= set(expected)
    observed, want, pool_o, pool_e = [], [], 0.0, 0.0
    for key, e in sorted(expected.items(), key=lambda kv: kv[1]):
        pool_o, pool_e = pool_o + counts.get(key, 0), pool_e + e
        if pool_e >= 5:
            observed.append(pool_o)
            want.append(pool_e)
            pool_o = pool_e = 0.0
    want[-1] += pool_e
    observed[-1] += pool_o
    assert len(observed) >= 4
    assert stats.chisquare(observed, want).pvalue > 1e-3


def test_valid_prefix_walks_a_copy_as_accept_would(backend, lltok) -> None:
    """Matcher.valid_prefix on token runs built from the masks (a valid run, then a refused token): the count of
    the valid run, through a trigger that opens the grammar and a grammar that completes, and the matcher itself
    unchanged by the walk."""
    rng = np.random.default_rng(0)
    g = _grammars(lltok, backend)["opened"]
    for trial in range(20):
        m, walker = g.matcher(), g.matcher()
        run: list[int] = []
        refused = None
        for _ in range(int(rng.integers(1, 25))):
            mask = walker.allowed(512)
            if mask is not None and rng.random() < 0.3 and (~mask).any():
                refused = int(rng.choice(np.flatnonzero(~mask)))
                break
            pick = g.trigger if mask is None and rng.random() < 0.2 else None
            if pick is None:
                pick = int(rng.choice(np.flatnonzero(mask))) if mask is not None else int(rng.integers(5, 512))
            walker.accept(pick)
            run.append(pick)
        before = m.allowed(512)
        tokens = run + ([refused] if refused is not None else [])
        assert m.valid_prefix(tokens) == len(run), trial
        after = m.allowed(512)
        assert (before is None and after is None) or np.array_equal(before, after)
