"""Speculative decoding under a grammar that masks tokens on the cuda backend, on the emulated GPU
(tests/engine_emulator.py): a request with a JSON schema, a forced tool call with bounds and a pattern, a guided
regex, or a tool call the model opens mid-answer drafts in batched verify steps (a batch of one when alone), its
drafts cut at the first one its grammar refuses and every row masked as plain decoding masks that position. Greedy
and seeded output equal plain decoding's token for token, alone and 2-4 together with mixed grammars, whether the
forced drafts land (each request's plain continuation with planted mistakes) or the grammar refuses them."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
llguidance = pytest.importorskip("llguidance")

from test_engine_batched_speculative_emulated import GREEDY, STOP, _force_plain_drafts, _sampled, _serve  # noqa: E402

from thorgen.runtime.cuda import spec_batch  # noqa: E402
from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer  # noqa: E402
from thorgen.serve.tool_grammar import tool_call_lark  # noqa: E402

LANES = 4
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}, "name": {"type": "string"}},
    "required": ["ok", "n", "name"],
    "additionalProperties": False,
}
TOOL = {
    "type": "object",
    "required": ["count", "code"],
    "properties": {
        "count": {"type": "integer", "minimum": 3, "maximum": 900},
        "code": {"type": "string", "pattern": "^[a-z]{2}-[0-9]{2,4}$"},
    },
}


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("spec_grammar"), ctx=256, max_num_seqs=LANES)
    yield b
    b.close()
    dev.set_driver(None)


@pytest.fixture(autouse=True)
def no_forced_drafts(backend):
    yield
    backend.engine.dflash.draft_hook = None


@pytest.fixture(scope="module")
def grammars(backend, tiny_checkpoint, tiny_ckpt):
    """grammars(name, prompt index, sampling) -> its Grammar; "opened": any JSON once a token that the request's
    own free answer takes (new, at its 3rd token or later) opens it, as a tool call under tool_choice auto."""
    tok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), tiny_ckpt.spec.target.vocab_size, tuple(STOP))
    tools = [{"type": "function", "function": {"name": "act", "parameters": TOOL}}]
    fixed = {
        "json": Grammar(json_grammar(SCHEMA, tok), tok),
        "tool": Grammar(llguidance.LLMatcher.grammar_from_lark(tool_call_lark(tools, "named", "act", 52, 49)), tok),
        "regex": Grammar(llguidance.LLMatcher.grammar_from_regex(r"(x|y|zz)[0-9]{2,6}(ok|no)"), tok),
    }

    def of(name: str, i: int, sampling) -> Grammar:
        if name != "opened":
            return fixed[name]
        free = _serve(backend, {"f": _prompt(i, sampling)}, speculative=False).tokens["f"]
        opener = next(t for j, t in enumerate(free) if j >= 2 and t not in free[:j])
        return Grammar(json_grammar(None, tok), tok, trigger=opener)

    return of


def _prompt(i: int, sampling, n: int = 40) -> tuple[list[int], int, object]:
    rng = np.random.default_rng(100 + i)
    return [2] + rng.integers(256, 512, 4 + 7 * i).tolist(), n, sampling


def _walks(monkeypatch) -> list[tuple[int, int]]:
    """Every grammar walk of a batched verify: (drafts given, drafts kept)."""
    seen: list[tuple[int, int]] = []
    walk = spec_batch.walk

    def recording(seq, drafts, vocab):
        run = walk(seq, drafts, vocab)
        seen.append((len(drafts), len(run.drafts)))
        return run

    monkeypatch.setattr(spec_batch, "walk", recording)
    return seen


def _check_landed(backend, requests: dict, monkeypatch) -> None:
    plain = _serve(backend, requests, speculative=False, stop_ids=STOP)
    assert not plain.errors
    _force_plain_drafts(backend, requests, plain.tokens)
    walks = _walks(monkeypatch)
    run = _serve(backend, requests, speculative=True, stop_ids=STOP)
    assert run.tokens == plain.tokens and not run.errors
    spec = run.speculation
    assert spec["speculative_steps"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert walks and any(kept for _, kept in walks)
    for rid in requests:  # every request committed several tokens in one of its steps
        assert max(run.accepted[rid], default=0) >= 2, (rid, run.accepted[rid])


@pytest.mark.parametrize("name", ["json", "tool", "regex", "opened"])
@pytest.mark.parametrize("seeded", [False, True])
def test_alone_under_a_grammar_equals_plain(backend, grammars, monkeypatch, name, seeded):
    sampling = _sampled(3) if seeded else GREEDY
    sampling = replace(sampling, grammar=grammars(name, 1, sampling))
    _check_landed(backend, {name: _prompt(1, sampling)}, monkeypatch)


def test_mixed_grammars_together_equal_plain(backend, grammars, monkeypatch):
    """Four requests, each its own grammar, two of them seeded, and then two with a request without one."""
    names = ["json", "tool", "regex", "opened"]
    requests = {}
    for i, n in enumerate(names):
        sampling = _sampled(i) if i % 2 else GREEDY
        requests[n] = _prompt(i, replace(sampling, grammar=grammars(n, i, sampling)), 30 + 4 * i)
    _check_landed(backend, requests, monkeypatch)
    pair = {"tool": requests["tool"], "free": _prompt(5, GREEDY, 20)}
    _check_landed(backend, pair, monkeypatch)


def test_drafts_the_grammar_refuses_are_cut(backend, grammars, monkeypatch):
    """Drafts that are the plain continuation but for one token the grammar refuses there: the walk cuts the
    block before it, it never reaches a verify row, and the output is plain decoding's."""
    V = backend.spec.target.vocab_size
    regex = grammars("regex", 0, GREEDY)
    requests = {"regex": _prompt(2, replace(GREEDY, grammar=regex)), "free": _prompt(4, GREEDY, 16)}
    plain = _serve(backend, requests, speculative=False, stop_ids=STOP).tokens
    prompt = requests["regex"][0]
    full = prompt + plain["regex"]
    m = regex.matcher()
    refused = []  # per output index: a token its mask refuses
    for t in plain["regex"]:
        mask = m.allowed(V)
        refused.append(int(np.flatnonzero(~mask)[-1]))
        m.accept(t)
    table: dict[tuple[int, int], tuple[list[int], int]] = {}
    for i in range(len(prompt) - 1, len(full) - 1):
        drafts = (full[i + 1 : i + 16] + [0] * 15)[:15]
        bad = 2 + i % 3  # a refused token at slot 2..4 (15: none, near the end)
        if i + 1 + bad - len(prompt) < len(refused):
            drafts[bad] = refused[i + 1 + bad - len(prompt)]
        else:
            bad = 15
        table[(i, full[i])] = (drafts, bad)
    _force_plain_drafts(backend, {"free": requests["free"]}, {"free": plain["free"]})
    others, planted = backend.engine.dflash.draft_hook, []

    def hook(start: int, last: int) -> list[int]:
        if (start, last) not in table:
            return others(start, last)
        drafts, bad = table[(start, last)]
        planted.append(bad)
        return drafts

    backend.engine.dflash.draft_hook = hook
    walks = _walks(monkeypatch)
    run = _serve(backend, requests, speculative=True, stop_ids=STOP)
    assert run.tokens == plain and not run.errors
    assert len(walks) == len(planted) and planted.count(15) < len(planted)
    assert all(kept <= bad for (_, kept), bad in zip(walks, planted))  # cut at the refused draft, or before
    assert any(kept >= 2 for _, kept in walks) and run.speculation["accepted_tokens"] > 0


def test_penalties_min_tokens_and_logprobs_equal_plain(backend):
    """Penalties (each row counts the drafts before it as generated), min_tokens and logprobs under speculation:
    the tokens and each token's logprobs are plain decoding's."""
    from thorgen.runtime.engine.core import EngineCore
    from thorgen.runtime.options import DraftOptions

    sampling = replace(_sampled(4), presence_penalty=1.5, repetition_penalty=1.3, min_tokens=12, logprobs=2)
    requests = {"pen": _prompt(4, sampling, 24), "free": _prompt(2, GREEDY, 20)}
    plain = _serve(backend, requests, speculative=False, stop_ids=STOP)
    _force_plain_drafts(backend, requests, plain.tokens)
    got = {}
    for speculative in (False, True):
        core = EngineCore(backend.runner(2), drafts=DraftOptions(adaptive=False))
        for rid, (p, n, sp) in requests.items():
            core.add(rid, p, n, sp, STOP, speculative=speculative)
        tokens, lps, accepted = [], [], []
        while core.unfinished:
            for o in core.step():
                if o.request_id == "pen":
                    tokens += o.token_ids
                    lps += list(o.logprobs or ())
                    accepted += [] if o.accepted is None else [o.accepted]
        got[speculative] = (tokens, lps, accepted)
    assert got[False][0] == got[True][0] == plain.tokens["pen"]
    assert got[True][1] == got[False][1] and len(got[True][1]) == len(plain.tokens["pen"])
    assert max(got[True][2]) >= 2  # (drafts landed)


def test_walk_masks_each_row_and_leaves_the_matcher(tiny_checkpoint, tiny_ckpt):
    """spec_grammar.walk: row j's mask is the grammar's after drafts 1..j (min_tokens keeps stop ids off where it
    would), the drafts end before the first one a mask refuses and before a stop id, and the sequence's own
    matcher is where it was."""
    from thorgen.runtime.cuda.spec_grammar import walk
    from thorgen.runtime.engine.sequence import Sequence

    V = tiny_ckpt.spec.target.vocab_size
    tok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), V, tuple(STOP))
    g = Grammar(llguidance.LLMatcher.grammar_from_regex(r"[0-9]{3,8}"), tok)
    seq = Sequence("w", [2, 3], replace(GREEDY, grammar=g, min_tokens=4), 20, STOP)
    seq.prepare(V)
    first = seq.allowed(V)
    digits = [int(t) for t in np.flatnonzero(first)[:6]]
    refused = int(np.flatnonzero(~first)[-1])
    run = walk(seq, digits + [refused, digits[0]], V)
    assert run.drafts == digits and len(run.masks) == len(digits) + 1
    m = g.matcher()
    for j, mask in enumerate(run.masks):
        want = m.allowed(V)
        if j < 4:  # (fewer than min_tokens out: no stop id)
            want[list(STOP)] = False
        assert np.array_equal(mask, want), j
        if j < len(digits):
            m.accept(digits[j])
    assert np.array_equal(seq.allowed(V), first)  # (the walk ran on a fork)
    seq.output = [digits[0]] * 4  # (min_tokens met: the grammar may end with a stop id after 3+ digits)
    assert walk(seq, digits[:3] + [1] + digits[:2], V).drafts == digits[:3]  # (nothing past a stop id)
