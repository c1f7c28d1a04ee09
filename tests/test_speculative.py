"""Speculative decoding == plain decoding (greedy and seeded sampling), rollback, stops, prefix cache, errors.

Besides the real (random-weight) DFlash drafter, a scripted drafter proposes the target's own plain
continuation with one planted mistake per step, chosen so every acceptance count 0..15 occurs.
"""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec.conventions import KV_PAGE
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.backend import BackendError, GenerationResult, SamplingParams
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.options import DraftOptions
from thorgen.runtime.reference.drafter import DraftContext

SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)


def prompt(n: int, seed: int) -> list[int]:
    """<bos> and n - 1 random text ids (an image or video placeholder id drawn becomes 5: a prompt holding one
    without its media is refused)."""
    rng = np.random.default_rng(seed)
    vision = get_preset("tiny").vision
    media = {vision.image_token_id, vision.video_token_id} if vision is not None else set()
    return [2] + [5 if int(t) in media else int(t) for t in rng.integers(5, 512, n - 1)]


@pytest.fixture(scope="module")
def backend(tiny_ckpt) -> ReferenceBackend:
    return ReferenceBackend(tiny_ckpt, prefix_cache=False)


def fixed(backend: ReferenceBackend) -> ReferenceBackend:
    """`backend` with every speculative step drafting the most it may (no adaptive draft counts)."""
    backend.draft_options = DraftOptions(adaptive=False)
    return backend


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_speculative_equals_plain(tiny_ckpt, backend: ReferenceBackend, sampling: SamplingParams) -> None:
    every_step = fixed(ReferenceBackend(tiny_ckpt, prefix_cache=False))
    for seed, n in ((1, 5), (2, 20), (3, 37)):
        ids = prompt(n, seed)
        plain = backend.generate(ids, 16, sampling)
        spec = every_step.generate(ids, 16, sampling, speculative=True)
        assert spec.token_ids == plain.token_ids
        assert len(plain.token_ids) == 16 and plain.finish_reason == "length"
        # the first token comes from the prefill; a last step with room for one token only is a plain one
        assert 15 - sum(spec.accepted_lengths) in (0, 1)
        assert all(1 <= a <= 16 for a in spec.accepted_lengths)
        adaptive = backend.generate(ids, 16, sampling, speculative=True)  # (random drafts: it backs off)
        assert adaptive.token_ids == plain.token_ids and 0 < sum(adaptive.accepted_lengths) < 15


def test_sampling_is_not_greedy(backend: ReferenceBackend) -> None:
    ids = prompt(9, 4)
    greedy = backend.generate(ids, 16, SamplingParams()).token_ids
    sampled = backend.generate(ids, 16, SamplingParams(temperature=1.5, seed=5)).token_ids
    other_seed = backend.generate(ids, 16, SamplingParams(temperature=1.5, seed=6)).token_ids
    assert sampled != greedy and sampled != other_seed


class ScriptedDrafter:
    """Proposes the known continuation `full[start+1:]`, corrupting draft index plan[k] at its k-th call."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, full: list[int], plan: list[int], block_size: int, vocab: int) -> None:
        self.full, self.plan, self.block_size, self.vocab = full, list(plan), block_size, vocab
        self.calls = 0

    def new_context(self) -> DraftContext:
        return DraftContext(None, 0)

    def propose(self, ctx: DraftContext, last_token: int, start: int) -> list[int]:
        assert self.full[start] == last_token  # the loop feeds the committed token at its position
        drafts = list(self.full[start + 1 : start + self.block_size])
        drafts += [0] * (self.block_size - 1 - len(drafts))
        bad = self.plan[self.calls] if self.calls < len(self.plan) else self.block_size - 1
        if bad < self.block_size - 1:
            drafts[bad] = (drafts[bad] + 1) % self.vocab  # a wrong token: exactly `bad` drafts get accepted
        self.calls += 1
        return drafts


@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_scripted_drafter_covers_every_acceptance_count(
    tiny_ckpt, backend: ReferenceBackend, sampling: SamplingParams
) -> None:
    ids = prompt(12, 7)
    plan = [15, 0, 7, 3, 14, 1, 9, 5, 12, 2, 11, 6, 13, 4, 10, 8]
    n_new = 1 + sum(a + 1 for a in plan)
    plain = backend.generate(ids, n_new, sampling).token_ids
    drafter = ScriptedDrafter(ids + plain, plan, 16, tiny_ckpt.spec.target.vocab_size)
    spec_backend = fixed(ReferenceBackend(tiny_ckpt, drafter=drafter, prefix_cache=False))
    result = GenerationResult()
    steps = list(spec_backend.generate_stream(ids, n_new, sampling, speculative=True, result=result))
    assert [t for s in steps for t in s.token_ids] == result.token_ids == plain
    accepted = [s.accepted for s in steps[1:]]
    assert accepted == plan
    assert sorted(accepted) == list(range(16))
    assert result.accepted_lengths == [a + 1 for a in plan]


def test_stop_and_max_tokens_truncate_mid_block(tiny_ckpt, backend: ReferenceBackend) -> None:
    ids = prompt(10, 8)
    plain = backend.generate(ids, 40, SamplingParams()).token_ids
    full = ids + plain
    all_right = fixed(ReferenceBackend(tiny_ckpt, drafter=ScriptedDrafter(full, [15] * 8, 16, 512), prefix_cache=False))
    # max_tokens inside the second block: 1 (prefill) + 16 (15 drafts + bonus) + 4
    r = all_right.generate(ids, 21, SamplingParams(), speculative=True)
    assert r.token_ids == plain[:21] and r.finish_reason == "length"
    assert r.accepted_lengths == [16, 4]
    # a stop id inside a fully accepted block ends the output right after it
    k = next(i for i in range(5, 30) if plain[i] not in plain[:i])
    stop = frozenset({plain[k]})
    want = backend.generate(ids, 40, SamplingParams(), stop_ids=stop)
    assert want.token_ids == plain[: k + 1] and want.finish_reason == "stop"
    all_right = fixed(ReferenceBackend(tiny_ckpt, drafter=ScriptedDrafter(full, [15] * 8, 16, 512), prefix_cache=False))
    got = all_right.generate(ids, 40, SamplingParams(), stop_ids=stop, speculative=True)
    assert got.token_ids == want.token_ids and got.finish_reason == "stop"


def _served(
    core: EngineCore, rid: str, ids: list[int], n: int, sampling: SamplingParams, speculative: bool = False
) -> GenerationResult:
    """One request through a long-lived engine core (a server's): its result."""
    core.add(rid, ids, n, sampling, speculative=speculative)
    while core.unfinished:
        for out in core.step():
            if out.finished:
                return out.result
    raise AssertionError("the request did not finish")


def test_prefix_cache_reuse_gives_identical_output(tiny_ckpt, backend: ReferenceBackend) -> None:
    """Requests through one engine core reuse the K/V earlier ones left, in whole pages of KV_PAGE positions (the
    KV manager's rule for every backend), and get the tokens a full prefill gives."""
    core = EngineCore(ReferenceBackend(tiny_ckpt).runner(2))
    a = prompt(40, 9)
    first = _served(core, "first", a, 8, SamplingParams())
    assert first.cached_prompt_tokens == 0 and first.prompt_tokens == 40
    again = _served(core, "again", a, 8, SamplingParams(), speculative=True)
    assert again.cached_prompt_tokens == 32  # the pages before the last prompt token, which always runs again
    assert again.token_ids == first.token_ids
    # a follow-up turn that extends prompt + answer reuses the whole pages the first state covered (47 positions)
    b = a + first.token_ids + [300, 301]
    follow = _served(core, "follow", b, 8, SAMPLED, speculative=True)
    assert follow.cached_prompt_tokens == (40 + 8 - 1) // KV_PAGE * KV_PAGE
    assert follow.token_ids == backend.generate(b, 8, SAMPLED).token_ids
    # a diverging prompt reuses only the whole pages of the common prefix (36 tokens)
    c = a[:36] + [7, 8, 9]
    div = _served(core, "div", c, 6, SamplingParams())
    assert div.cached_prompt_tokens == 32
    assert div.token_ids == backend.generate(c, 6, SamplingParams()).token_ids
    assert first.prefill_s > 0 and first.decode_s > 0


def test_cancel_and_bad_requests(tiny_ckpt) -> None:
    b = ReferenceBackend(tiny_ckpt, max_context=64, prefix_cache=False)
    calls = []
    r = b.generate(prompt(6, 10), 30, SamplingParams(), cancelled=lambda: len(calls.append(1) or calls) > 3)
    # polled before every engine step, the prefill included: three steps ran (prefill + 2 decodes)
    assert r.finish_reason == "cancelled" and len(r.token_ids) == 3 and len(calls) == 4
    for bad in ([], [5, 512], [-1], prompt(64, 11)):
        with pytest.raises(BackendError):
            b.generate(bad, 4, SamplingParams())
    with pytest.raises(BackendError):
        b.generate([2, 5], 0, SamplingParams())
    # the context limit ends generation with "length"
    r = b.generate(prompt(60, 12), 30, SamplingParams(), speculative=True)
    assert len(r.token_ids) == 4 and r.finish_reason == "length"


def test_draft_tokens_caps_each_step(tiny_ckpt, backend: ReferenceBackend) -> None:
    """SamplingParams.draft_tokens = 3 with a drafter that is always right: every verify step commits 3 drafts +
    the bonus token, and the output is still plain decoding's; a cap above the drafter's block is refused."""
    from thorgen.runtime.backend import BackendError

    ids = prompt(10, 9)
    plain = backend.generate(ids, 30, SamplingParams()).token_ids
    all_right = fixed(
        ReferenceBackend(tiny_ckpt, drafter=ScriptedDrafter(ids + plain, [15] * 12, 16, 512), prefix_cache=False)
    )
    r = all_right.generate(ids, 29, SamplingParams(draft_tokens=3), speculative=True)
    assert r.token_ids == plain[:29] and r.accepted_lengths == [4] * 7
    with pytest.raises(BackendError, match="draft_tokens 16: the drafter proposes at most 15"):
        all_right.generate(ids, 8, SamplingParams(draft_tokens=16), speculative=True)
