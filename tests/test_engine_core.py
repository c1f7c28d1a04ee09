"""Engine-core tests on the reference backend (tiny checkpoint): continuous batching gives every request the
tokens it gets alone (greedy and seeded, plain and speculative), prefill chunks interleave with decode steps,
preemption by recompute resumes to the same tokens, KV exhaustion is a clear error, and aborts work in every
phase (queued, mid-prefill, mid-decode)."""

from __future__ import annotations

import pytest

from thorgen.runtime.backend import BackendError, GenerationResult, SamplingParams
from thorgen.runtime.options import DraftOptions
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.reference.backend import ReferenceBackend

CTX = 160
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def backend(tiny_ckpt):
    return ReferenceBackend(tiny_ckpt, max_context=CTX, prefix_cache=False)


def _prompt(n: int, salt: int) -> list[int]:
    return [2] + [110 + (salt * 37 + 11 * i) % 400 for i in range(n - 1)]  # ordinary ids of the tiny vocab (512)


def _alone(backend, prompt, n, sampling, speculative=False) -> list[int]:
    r = GenerationResult()
    for _ in backend.generate_stream(prompt, n, sampling, speculative=speculative, result=r):
        pass
    return r.token_ids


class Recording:
    """Wraps a runner; records what every step ran (prefill chunks and decode batch sizes)."""

    def __init__(self, runner) -> None:
        self.inner, self.steps = runner, []
        for name in (
            "max_context",
            "max_num_seqs",
            "kv_geometry",
            "verify_block",
            "lookahead",
            "prefill_chunk",
            "chunks_in_pieces",
            "caught_up_tokens",
            "speculative_cost",
            "check",
            "media_ready",
            "draft_context",
            "apply",
            "release",
        ):
            setattr(self, name, getattr(runner, name))

    def prefill(self, seq, start, end, sample, launched=None, beside=False):
        self.steps.append(("prefill", seq.request_id, start, end))
        return self.inner.prefill(seq, start, end, sample, launched, beside)

    def decode(self, seqs, launched=None):
        self.steps.append(("decode", len(seqs)))
        return self.inner.decode(seqs, launched)


def _run(core: EngineCore, limit: int = 2000) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(limit):
        if not core.unfinished:
            return outs
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    raise AssertionError("the engine core did not finish")


def _tokens(outs) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_equals_alone_with_interleaved_prefill(backend, sampling):
    reqs = {f"r{i}": (_prompt(n, i), g) for i, (n, g) in enumerate([(40, 12), (7, 20), (90, 6), (23, 15)])}
    runner = Recording(backend.runner(max_num_seqs=4))
    runner.prefill_chunk = 16
    core = EngineCore(runner, max_step_tokens=20)
    for rid, (prompt, n) in reqs.items():
        core.add(rid, prompt, n, sampling)
    outs = _run(core)
    for rid, (prompt, n) in reqs.items():
        assert _tokens(outs[rid]) == _alone(backend, prompt, n, sampling), rid
        assert outs[rid][-1].finished and outs[rid][-1].result.finish_reason == "length"
    # a step that decodes some sequences while others prefill (chunked: no chunk over 16 tokens)
    kinds = [s[0] for s in runner.steps]
    assert any(a == "decode" and b == "prefill" for a, b in zip(kinds, kinds[1:]))
    assert max(s[3] - s[2] for s in runner.steps if s[0] == "prefill") <= 16
    assert max(s[1] for s in runner.steps if s[0] == "decode") >= 2


def test_default_budget_prefills_a_whole_chunk_beside_every_decode(backend):
    """The default step budget (a chunked runner) holds one whole prefill chunk beside every running sequence's
    decode: a prompt of one chunk's length, arriving while the others decode, runs as one prefill, not as the
    chunk minus the decodes plus a remainder forward."""
    runner = Recording(backend.runner(max_num_seqs=4))
    runner.prefill_chunk = 16
    core = EngineCore(runner)
    assert core.scheduler.max_step_tokens == 16 + 4 * runner.verify_block
    for i in range(3):
        core.add(f"d{i}", _prompt(6, 90 + i), 12, GREEDY)
    for _ in range(4):
        core.step()
    core.add("late", _prompt(16, 95), 4, GREEDY)
    outs = _run(core)
    late = [s for s in runner.steps if s[0] == "prefill" and s[1] == "late"]
    assert [(s[2], s[3]) for s in late] == [(0, 16)], late
    assert _tokens(outs["late"]) == _alone(backend, _prompt(16, 95), 4, GREEDY)


def test_a_chunk_in_pieces_goes_alone_beside_decodes(backend):
    """A chunk the runner cuts into pieces beside decodes (chunks_in_pieces: here the "p" sequences') runs in a step
    that decodes with no other chunk, however much budget is left (a second chunk would be a whole forward more for
    the decoders to wait for); other sequences' chunks still share a step with each other, and prompts that arrive
    with nothing decoding share one too."""
    runner = Recording(backend.runner(max_num_seqs=6))
    runner.chunks_in_pieces = lambda seq: seq.request_id.startswith("p")
    core = EngineCore(runner)
    together = {f"t{i}": _prompt(6, 30 + i) for i in range(2)}
    for rid, prompt in together.items():
        core.add(rid, prompt, 12, GREEDY)
    first = {o.request_id: o for o in core.step()}
    assert [s[1] for s in runner.steps if s[0] == "prefill"] == ["t0", "t1"]
    late = {"p0": _prompt(5, 40), "w0": _prompt(5, 41), "w1": _prompt(5, 42), "p1": _prompt(5, 43)}
    for rid, prompt in late.items():
        core.add(rid, prompt, 4, GREEDY)
    runner.steps.clear()
    outs = _run(core)
    per_step, chunks = [], []
    for kind, *rest in runner.steps:
        if kind == "prefill":
            chunks.append(rest[0])
        else:
            per_step.append(chunks)
            chunks = []
    assert [c for c in per_step if c] == [["p0"], ["w0", "w1"], ["p1"]], runner.steps
    for rid, prompt in {**together, **late}.items():
        n = 12 if rid in together else 4
        assert _tokens([first[rid], *outs[rid]] if rid in first else outs[rid]) == _alone(backend, prompt, n, GREEDY)


def test_a_steps_later_chunks_are_whole(backend):
    """After a step's first prefill chunk, the leftover budget does not start the next prompt with a few rows (each
    chunk is a forward of its own): three one-chunk prompts arriving together run as three whole chunks."""
    runner = Recording(backend.runner(max_num_seqs=4))
    runner.prefill_chunk = 16
    core = EngineCore(runner, max_step_tokens=20)
    prompts = {f"w{i}": _prompt(16, 60 + i) for i in range(3)}
    for rid, prompt in prompts.items():
        core.add(rid, prompt, 3, GREEDY)
    outs = _run(core)
    chunks = [(s[1], s[2], s[3]) for s in runner.steps if s[0] == "prefill"]
    assert chunks == [(rid, 0, 16) for rid in prompts], chunks
    for rid, prompt in prompts.items():
        assert _tokens(outs[rid]) == _alone(backend, prompt, 3, GREEDY), rid


def test_speculative_batched_equals_plain(backend):
    prompts = {f"s{i}": _prompt(n, 40 + i) for i, n in enumerate((12, 30, 5))}
    core = EngineCore(backend.runner(max_num_seqs=3), drafts=DraftOptions(adaptive=False))
    for rid, p in prompts.items():
        core.add(rid, p, 24, GREEDY, speculative=True)
    outs = _run(core)
    for rid, p in prompts.items():
        assert _tokens(outs[rid]) == _alone(backend, p, 24, GREEDY), rid
        # every step drafts but a last one with room for one token only (then the finished output)
        assert all(o.accepted is not None for o in outs[rid][1:-2])


def test_preemption_resumes_to_the_same_tokens(backend):
    """A KV budget for about two sequences forces the later ones out and back in (recompute)."""
    reqs = {f"p{i}": _prompt(30 + 5 * i, 70 + i) for i in range(4)}
    core = EngineCore(backend.runner(max_num_seqs=4, kv_tokens=112), max_step_tokens=64)
    seqs = {rid: core.add(rid, p, 24, SEEDED) for rid, p in reqs.items()}
    outs = _run(core)
    assert sum(s.preemptions for s in seqs.values()) > 0
    for rid, p in reqs.items():
        assert _tokens(outs[rid]) == _alone(backend, p, 24, SEEDED), rid


def test_kv_exhaustion_is_a_clear_error(backend):
    core = EngineCore(backend.runner(max_num_seqs=2, kv_tokens=64))
    with pytest.raises(BackendError, match=r"needs 7 KV blocks of 16 tokens, but the whole KV cache holds 4"):
        core.add("big", _prompt(100, 1), 4, GREEDY)
    core.add("grows", _prompt(40, 2), 100, GREEDY)  # fits, then outgrows the whole cache alone
    outs = _run(core)
    final = outs["grows"][-1]
    assert final.finished and final.result.finish_reason == "length" and len(_tokens(outs["grows"])) == 64 - 40 + 1


def test_abort_in_every_phase(backend):
    runner = backend.runner(max_num_seqs=1)
    runner.prefill_chunk = 8
    core = EngineCore(runner, max_step_tokens=8)
    core.add("running", _prompt(20, 3), 50, GREEDY)
    core.add("queued", _prompt(10, 4), 50, GREEDY)
    core.step()  # "running" has prefilled 8 of its 20 prompt tokens
    assert core.abort("queued") and core.abort("running")
    outs = {o.request_id: o for o in core.step()}
    assert {r: o.result.finish_reason for r, o in outs.items()} == {"running": "cancelled", "queued": "cancelled"}
    assert core.unfinished == 0 and core.kv.used_pages == 0
    core.add("decoding", _prompt(6, 5), 50, GREEDY)
    got = []
    while len(got) < 3:
        got += [t for o in core.step() for t in o.token_ids]
    core.abort("decoding")
    (last,) = core.step()
    assert last.finished and last.result.finish_reason == "cancelled" and last.result.token_ids == got
    assert not core.abort("decoding")  # gone


def test_bad_requests(backend):
    core = EngineCore(backend.runner())
    for prompt, n, match in (
        ([], 4, "empty"),
        (_prompt(CTX, 1), 4, "context"),
        ([2, 5], 0, "max_tokens"),
        ([2, 10**7], 4, "vocabulary"),
    ):
        with pytest.raises(BackendError, match=match):
            core.add("x", prompt, n, GREEDY)
    core.add("x", [2, 5], 2, GREEDY)
    with pytest.raises(BackendError, match="already"):
        core.add("x", [2, 5], 2, GREEDY)


def test_launched_hook_runs_once_per_step_before_the_wait(backend):
    """EngineCore.step(launched=...) calls it once per step: inside the runner's first call, once its device
    work is enqueued (the client streams the previous step's tokens there), or at the end of an idle step."""
    log: list[str] = []
    runner = Recording(backend.runner(max_num_seqs=2))
    inner_decode = runner.decode

    def decode(seqs, launched=None):
        out = inner_decode(seqs, launched)
        log.append("decoded")
        return out

    runner.decode = decode
    core = EngineCore(runner)
    core.add("a", _prompt(9, 1), 4, GREEDY)
    while core.unfinished:
        log.append("step")
        core.step(launched=lambda: log.append("launched"))
    steps = "|".join(log).split("step|")[1:]
    assert all(s.count("launched") == 1 for s in steps), log
    assert all(s.index("launched") < s.index("decoded") for s in steps if "decoded" in s), log


def test_resumed_sequence_fully_covered_by_the_prefix_cache(tiny_ckpt):
    """A preempted sequence whose every token is in the prefix cache (the same request ran alone before) resumes
    without a forward and continues to the same tokens (CI once hit a state one token longer than the chunk)."""
    backend = ReferenceBackend(tiny_ckpt, max_context=CTX, prefix_cache=True)
    prompt = _prompt(12, 9)
    core = EngineCore(backend.runner(max_num_seqs=2))
    core.add("alone", prompt, 10, SEEDED)
    alone = _tokens(_run(core)["alone"])
    seq = core.add("resumed", prompt, 10, SEEDED)
    seq.output, seq.preemptions = alone[:4], 1  # as if preempted after 4 tokens: it re-prefills prompt + 3
    outs = _run(core)
    assert seq.output == alone and _tokens(outs["resumed"]) == alone[4:]
