"""Several speculative sequences in one engine core (reference backend): 4 and 8 concurrent requests with mixed
grammars and sampling, each drafting what the draft policy gives it, decode exactly what each decodes alone
without speculation, also when a tight KV budget preempts sequences between their verify steps."""

from __future__ import annotations

from dataclasses import replace

import pytest

from test_speculative import prompt

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.reference.drafter import DraftContext

llguidance = pytest.importorskip("llguidance")

from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer  # noqa: E402

STOP = frozenset({1})
GEN = 24


class TableDrafter:
    """Proposes what some request's plain decoding put after (position, token), from a table of every request's
    plain continuation: drafts land for each sequence of a batch (and miss where two requests share a key)."""

    tap_layers: tuple[int, ...] = ()
    block_size = 16

    def __init__(self, vocab: int) -> None:
        self.vocab, self.table, self.calls = vocab, {}, 0

    def learn(self, full: list[int]) -> None:
        for i, t in enumerate(full):
            self.table.setdefault((i, t), (full[i + 1 : i + 16] + [0] * 15)[:15])

    def new_context(self) -> DraftContext:
        return DraftContext(None, 0)

    def propose(self, ctx: DraftContext, last_token: int, start: int) -> list[int]:
        self.calls += 1
        return list(self.table.get((start, last_token), [(last_token + 1) % self.vocab] * 15))


def _requests(tiny_checkpoint, tiny_ckpt, n: int) -> list[tuple[str, list[int], SamplingParams]]:
    tok = tokenizer(str(tiny_checkpoint / "tokenizer.json"), tiny_ckpt.spec.target.vocab_size, tuple(STOP))
    kinds = [
        SamplingParams(),
        SamplingParams(grammar=Grammar(json_grammar(None, tok), tok)),
        SamplingParams(temperature=0.9, seed=3, presence_penalty=1.0),
        SamplingParams(grammar=Grammar(llguidance.LLMatcher.grammar_from_regex(r"[a-z ]{4,40}\."), tok)),
        SamplingParams(temperature=1.0, seed=8, grammar=Grammar(json_grammar(None, tok), tok)),
        SamplingParams(draft_tokens=3),
        SamplingParams(grammar=Grammar(llguidance.LLMatcher.grammar_from_lark('start: "up" | "down"'), tok)),
        SamplingParams(min_tokens=10),
    ]
    return [(f"r{i}", prompt(6 + 5 * i, 50 + i), kinds[i % len(kinds)]) for i in range(n)]


def _alone(backend: ReferenceBackend, ids: list[int], sampling: SamplingParams) -> list[int]:
    return backend.generate(ids, GEN, replace(sampling), STOP).token_ids


@pytest.mark.parametrize("n", [4, 8])
def test_concurrent_speculative_requests_equal_plain_alone(tiny_checkpoint, tiny_ckpt, n) -> None:
    plain_backend = ReferenceBackend(tiny_ckpt, prefix_cache=False)
    requests = _requests(tiny_checkpoint, tiny_ckpt, n)
    want = {rid: _alone(plain_backend, ids, sp) for rid, ids, sp in requests}
    drafter = TableDrafter(tiny_ckpt.spec.target.vocab_size)
    for rid, ids, _ in requests:
        drafter.learn(ids + want[rid])
    for kv_tokens in (None, 16 * 7):  # then a budget that preempts sequences between their verify steps
        core = EngineCore(ReferenceBackend(tiny_ckpt, drafter=drafter, prefix_cache=False).runner(n, kv_tokens))
        seqs = {rid: core.add(rid, ids, GEN, sp, STOP, speculative=True) for rid, ids, sp in requests}
        got: dict[str, list[int]] = {rid: [] for rid in seqs}
        accepted: list[int] = []
        for _ in range(4000):
            if not core.unfinished:
                break
            for out in core.step():
                got[out.request_id] += out.token_ids
                accepted += [out.accepted] if out.accepted else []
        assert got == want
        assert max(accepted) >= 4  # drafts landed, in batches of several sequences
        if kv_tokens is not None:
            assert sum(s.preemptions for s in seqs.values()) > 0
