"""DFlash speculative decoding on the CUDA engine: on the emulated GPU (tests/engine_emulator.py: the real engine,
graphs and staging over NumPy kernel models) speculative output must equal the same engine's plain output token
for token, greedy and seeded; forced drafts (the plain continuation with planted mistakes) make every acceptance
length 1..16 occur, so long acceptances and rollbacks (rejected target rows, stale drafter context rows) are
exercised; the engine's drafter itself is checked against the NumPy DFlash reference on its own context taps.

The GPU test at the bottom (marked gpu) runs the same equalities on the real device:
  python -m pytest tests/test_engine_speculative_emulated.py -m gpu -q -rA
There the verify step (M=16 kernels) and plain decode (M=1 kernels) accumulate in different orders, so a token may
differ: greedy only at a near-tie (at the first difference the plain engine's own logits must show a tie, TIE_TOL
as in tests/test_runtime_gpu.py); sampled, the small logit differences can also move a Gumbel draw (on the tiny
model's near-uniform routers they can flip an expert: measured on `one_token`, token 56), so at the first
difference each path's token must be the reference sampler's exact draw from that path's own logits, and at most
one prompt may differ. The comparison of that prompt stops there.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.options import DraftOptions  # noqa: E402

GEN = 24
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=7)
DRAFT_LOGITS_TOL = 1e-2  # engine drafter vs float32 reference, rel L2 per row (measured 7.5e-4: fp16 weights, bf16 K/V)
TIE_TOL = 1e-2  # GPU test only (see the docstring)


@pytest.fixture(scope="module")
def emu(tiny_checkpoint, tmp_path_factory):
    """open_(ctx, manifest_edit=None) -> (backend, driver), cached; the tiny checkpoint repacked once."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.convert.repack import repack

    ck = Checkpoint.open(tiny_checkpoint)
    root = tmp_path_factory.mktemp("spec_emulated")
    weights = repack(tiny_checkpoint, root / "weights")
    made: dict = {}

    def open_(ctx: int = 1024, drop: str | None = None):
        from thorgen.runtime.cuda.backend import open_backend

        key = (ctx, drop)
        if key not in made:
            kernels = EE.write_fake_manifest(ck.spec, root / f"kernels_{drop}")
            if drop:  # a manifest lacking some kernels (e.g. the drafter's GEMMs)
                m = json.loads((kernels / "manifest.json").read_text())
                m["kernels"] = {k: v for k, v in m["kernels"].items() if not k.startswith(drop)}
                (kernels / "manifest.json").write_text(json.dumps(m))
            drv = EE.install(kernels)
            made[key] = (open_backend(tiny_checkpoint, ctx=ctx, weights_dir=weights, kernels_dir=kernels), drv)
            # every step drafts the most it may: these tests check the DFlash steps (the policy: test_draft_policy)
            made[key][0].draft_options = DraftOptions(adaptive=False)
        dev.set_driver(made[key][1])
        if made[key][0].engine.dflash is not None:  # (None: the drafter's kernels were dropped)
            made[key][0].engine.dflash.draft_hook = None
        return made[key]

    yield open_, ck
    for b, drv in made.values():
        dev.set_driver(drv)
        b.close()
    dev.set_driver(None)


def _shared() -> Path | None:
    """<repo>/../shared when present (the prompt suite part is then included), else None."""
    p = Path(__file__).resolve().parent.parent.parent / "shared"
    return p if (p / "seed_data" / "prompt_suite.json").is_file() else None


def _prompts(ck, shared: Path | None) -> list[tuple[str, list[int]]]:
    rng = np.random.default_rng(3)
    out = [("random41", [2] + rng.integers(256, 512, 40).tolist()), ("one_token", [2])]
    if shared is not None:
        import prompt_suite as PS

        suite = PS.suite_prompts(ck.model_dir, shared, filler_repeats=1)
        out += [(pid, ids) for pid, ids in suite[:3]]
    return out


def _check_lengths(res, first_from_prefill: bool = True) -> None:
    acc = res.accepted_lengths
    assert acc and all(1 <= a <= 16 for a in acc), acc
    # every step drafts (DraftOptions(adaptive=False)) but a last one with room for one token only, a plain one
    assert len(res.token_ids) - sum(acc) - (1 if first_from_prefill else 0) in (0, 1)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculative_equals_plain(emu, mode):
    """The real (random) drafter: whatever it proposes, every committed token is the plain engine's token."""
    open_, ck = emu
    backend, _ = open_()
    params = SamplingParams() if mode == "greedy" else SAMPLED
    for pid, ids in _prompts(ck, _shared()):
        plain = backend.generate(ids, GEN, params).token_ids
        res = backend.generate(ids, GEN, params, speculative=True)
        assert res.token_ids == plain, f"{pid}: speculative {res.token_ids} != plain {plain}"
        _check_lengths(res)


def _forced_hook(
    backend, prompt_len: int, plain: list[int], schedule: list[int], log: list, check=None, strict: bool = True
):
    """draft_hook: the plain continuation after `last` with a wrong token planted at slot schedule[step]
    (15: none), so the step must accept exactly schedule[step] drafts."""
    V = backend.spec.target.vocab_size

    def hook(start: int, last: int) -> list[int]:
        if check is not None:
            check(start, last)
        i = start - prompt_len  # plain[i] is the token at position start (== last)
        assert plain[i] == last or not strict, f"step at {start}: last token {last}, plain decoding has {plain[i]}"
        drafts = (plain[i + 1 : i + 16] + [0] * 15)[:15]
        j = schedule[len(log) % len(schedule)]
        if j < 15:
            drafts[j] = (drafts[j] + 1) % V  # never the target's token
        log.append(j)
        return drafts

    return hook


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_forced_drafts_every_acceptance_length(emu, mode):
    """Every acceptance length 1..16 occurs, exactly as planted; output still equals plain decoding."""
    open_, ck = emu
    backend, _ = open_()
    params = SamplingParams() if mode == "greedy" else SAMPLED
    ids = [2] + np.random.default_rng(11 if mode == "greedy" else 12).integers(256, 512, 30).tolist()
    schedule = np.random.default_rng(5).permutation(16).tolist()
    n = 1 + sum(j + 1 for j in schedule)  # prefill token + one full pass over the schedule
    plain = backend.generate(ids, n + 16, params).token_ids
    log: list[int] = []
    backend.engine.dflash.draft_hook = _forced_hook(backend, len(ids), plain, schedule, log)
    res = backend.generate(ids, n, params, speculative=True)
    assert res.token_ids == plain[:n]
    assert res.accepted_lengths == [j + 1 for j in log]
    assert sorted(res.accepted_lengths) == list(range(1, 17))
    _check_lengths(res)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_steps_launched_ahead_at_the_devices_acceptance(emu, mode):
    """Each DFlash step is launched before the step before it is read, at the block the device's acceptance
    (draft.accept) picks. Tokens and acceptance lengths equal those of steps launched when scheduled: for the real
    drafter, emulated acceptance of K drafts with the bench's forced drafts (its hook sees the same block starts), a
    request's draft cap, a stop id and the context's end."""
    from thorgen.runtime.cuda.profile import distinct_tokens

    open_, ck = emu
    backend, _ = open_(ctx=160)
    params = SamplingParams() if mode == "greedy" else SAMPLED
    ids = [2] + np.random.default_rng(14).integers(256, 512, 30).tolist()
    free = backend.generate(ids, 40, params).token_ids
    stop = next(t for i, t in enumerate(free) if i >= 20 and t not in free[:i])
    capped = replace(params, draft_tokens=5)
    reqs = [(ids, 40, params), (ids, 200, capped), (ids[:5], 30, params)]  # (the second runs to the context's end)
    V = backend.spec.target.vocab_size

    def runs(ahead: bool, k: int | None) -> tuple:
        seen: list = []  # the block starts the bench's draft hook is called with (emulated acceptance only)
        if k is not None:  # as `thorgen bench --emulate-acceptance` does: 15 distinct drafts from the block start
            backend.engine.dflash.draft_hook = lambda start, last: (
                seen.append(start) or distinct_tokens(15, V, start + 1)
            )
        out, used = EE.run_requests(backend, ahead, reqs, speculative=True, stop_ids=frozenset({stop}))
        backend.engine.dflash.draft_hook = None
        return out, seen, used

    try:
        for k in (None, 0, 6, 15):
            backend.engine.dflash.emulate_acceptance = k
            ahead, seen_ahead, used = runs(True, k)
            plain, seen_plain, none = runs(False, k)
            assert ahead == plain, f"K={k}"
            # the same blocks, and at most one more a request: a step launched ahead that its request never needed
            it = iter(seen_ahead)
            assert all(any(a == b for a in it) for b in seen_plain), (seen_ahead, seen_plain)
            assert len(seen_ahead) - len(seen_plain) <= len(reqs), (seen_ahead, seen_plain)
            assert none == 0 and used > 0, (k, used)
            if k is None:  # (then most steps commit one token: all but a request's first and last few go ahead)
                assert ahead[0][0] == free[: free.index(stop) + 1]
                assert used >= sum(len(a) for _, a, _ in ahead) - 3 * 4, used
            else:
                for (_, acc, _), cap in zip(ahead, (15, 5, 15)):
                    assert acc[:-1] == [min(k, cap) + 1] * (len(acc) - 1), (k, acc)
    finally:
        backend.engine.dflash.emulate_acceptance, backend.engine.dflash.draft_hook = None, None


def test_draft_tokens_caps_the_accepted_drafts(emu):
    """A request's draft_tokens = 5 on the cuda backend: with every draft right, each step commits 5 + 1."""
    open_, ck = emu
    backend, _ = open_()
    ids = [2] + np.random.default_rng(13).integers(256, 512, 30).tolist()
    plain = backend.generate(ids, 40, SamplingParams()).token_ids
    log: list[int] = []
    backend.engine.dflash.draft_hook = _forced_hook(backend, len(ids), plain, [15], log)
    res = backend.generate(ids, 25, SamplingParams(draft_tokens=5), speculative=True)
    assert res.token_ids == plain[:25] and res.accepted_lengths == [6] * 4
    _check_lengths(res)


def test_engine_drafter_matches_reference(emu):
    """The device drafter (context K/V from the taps, hybrid masks, block K/V, shared lm_head) against the NumPy
    DFlash reference fed the engine's own taps of the committed positions, over steps with rollbacks."""
    from thorgen.runtime.reference.backend import ReferenceBackend
    from thorgen.runtime.reference.ops import softcap

    open_, ck = emu
    backend, drv = open_()
    ref = ReferenceBackend(ck, max_context=1024, prefix_cache=False).drafter
    d, H = backend.spec.drafter, backend.spec.target.hidden_size
    width = len(d.target_layer_ids) * H
    taps: dict[int, np.ndarray] = {}  # position -> f16 tap row of the latest forward that covered it
    e = backend.engine
    from thorgen.model_spec.nvfp4 import dequantize_nvfp4_mul
    from artifact_readback import unpack_linear

    lm_head = dequantize_nvfp4_mul(*unpack_linear(e.art, "embed_tokens")).astype(np.float64)

    def after(name, entry, a):
        if entry["template"].startswith("ffn_tail") and a["tap"]:
            pos = drv.view(e.buffers.A("positions").address, np.int32, a["T"]).copy()
            rows = drv.view(e.buffers.A("taps").address, np.float16, (a["T"], width))
            for r, p in enumerate(pos):
                taps[int(p)] = rows[r].astype(np.float32)

    drv.emu.after = after
    checked = []

    def check(start: int, last: int) -> None:
        ctx = ref.new_context()
        ctx.append(np.stack([taps[p] for p in range(start)]))
        # the reference's final hidden states through the engine's own NVFP4 lm_head (the reference's bf16 tied
        # head alone differs by ~9% from NVFP4); the engine feeds the lm_head f16 activations
        h = ref.block_hidden(ctx, [last] + [d.mask_token_id] * 15, start)[1:]
        want = softcap(h.astype(np.float16).astype(np.float64) @ lm_head.T, d.final_logit_softcapping)
        got = softcap(
            drv.view(e.buffers.A("logits").address, np.float32, (15, backend.spec.target.vocab_size)).astype(
                np.float64
            ),
            d.final_logit_softcapping,
        )
        err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        assert err.max() <= DRAFT_LOGITS_TOL, f"drafter at {start}: rel errors {np.round(err, 4)}"
        drafts = drv.view(e.buffers.A("ids", 1).address, np.int32, 15)
        top2 = -np.sort(-want, axis=1)[:, :2]
        clear = top2[:, 0] - top2[:, 1] > 0.05
        assert (drafts[clear] == want.argmax(1)[clear]).all(), f"drafter argmax at {start}"
        checked.append(start)

    try:
        ids = [2] + np.random.default_rng(4).integers(256, 512, 45).tolist()
        plain = backend.generate(ids, 40, SAMPLED).token_ids
        log: list[int] = []
        e.dflash.draft_hook = _forced_hook(backend, len(ids), plain, [3, 15, 0, 9, 1], log, check)
        res = backend.generate(ids, 32, SAMPLED, speculative=True)
    finally:
        drv.emu.after = None
    assert res.token_ids == plain[:32]
    assert len(checked) == len(res.accepted_lengths) >= 4


def test_budget_stop_and_context_end(emu):
    """max_tokens cuts a step's commit, a stop id ends it, and near the end of the context (no room for a
    16-row verify) the loop finishes with plain steps: all as plain decoding does."""
    open_, _ = emu
    backend, _ = open_()
    ids = [2] + np.random.default_rng(8).integers(256, 512, 20).tolist()
    plain = backend.generate(ids, 40, SAMPLED).token_ids
    log: list[int] = []
    backend.engine.dflash.draft_hook = _forced_hook(backend, len(ids), plain, [15], log)
    res = backend.generate(ids, 7, SAMPLED, speculative=True)  # one 16-token step cut to the 6 left
    assert res.token_ids == plain[:7] and res.accepted_lengths == [6] and res.finish_reason == "length"
    k = next(i for i in range(2, len(plain)) if plain[i] not in plain[:i])  # a stop id first produced mid-run
    stop = plain[k]
    res = backend.generate(ids, 40, SAMPLED, stop_ids=frozenset({stop}), speculative=True)
    assert res.token_ids == plain[: k + 1] and res.finish_reason == "stop"
    _check_lengths(res)
    # ctx 600 > every ring (528 / 544 slots): the last 15 positions cannot take a verify block
    small, _ = open_(ctx=600)
    ids = [2] + np.random.default_rng(9).integers(256, 512, 569).tolist()
    plain = small.generate(ids, 100, SAMPLED).token_ids
    res = small.generate(ids, 100, SAMPLED, speculative=True)
    assert res.token_ids == plain and res.finish_reason == "length"
    assert len(ids) + len(plain) == 600
    assert res.accepted_lengths and 1 + sum(res.accepted_lengths) < len(res.token_ids)  # verify steps, then plain


def test_missing_drafter_kernels_raise(emu):
    """Without the drafter's kernels plain decoding still runs and speculative names what is missing (the drafter
    programs' kernels the manifest no longer lists)."""
    open_, _ = emu
    backend, _ = open_(drop="bf16_gemm")
    assert backend.generate([2, 300], 2, SamplingParams()).token_ids
    with pytest.raises(BackendError, match=r"kernel bf16_gemm16__\w+ \(step program 'draft\.block'\)"):
        backend.generate([2, 300], 2, SamplingParams(), speculative=True)


# ---- the same on a GPU (skipped without one) -----------------------------------------------------------------------


def _tie(backend, ids: list[int], got: list[int], want: list[int], params: SamplingParams) -> float:
    """Greedy: gap (in logit units) between the two candidates at the first difference, from the plain engine's
    logits."""
    from thorgen.runtime.reference.ops import softcap

    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    backend.engine.prefill(ids + want[:i], greedy=True)
    z = softcap(backend.engine.logits().astype(np.float64), backend.spec.target.final_logit_softcapping)
    return abs(z[got[i]] - z[want[i]])


class _VerifyLog:
    """Wraps the engine's DFlash launch to keep each verify step's start position and its 16 rows of target logits
    (read right after the launch, before a step launched ahead can overwrite them)."""

    def __init__(self, engine) -> None:
        self.engine, self.orig, self.steps = engine, engine.dflash.launch, []
        engine.dflash.launch = self

    def __call__(self, start, *args, **kwargs):
        launch = self.orig(start, *args, **kwargs)
        self.engine.stream.synchronize()
        if start is None:  # launched ahead: its block starts where the step before it accepted up to
            start = self.steps[-1][0] + self.steps[-1][2]
        V = self.engine.spec.target.vocab_size
        rows = self.engine.act["logits"].download(np.float32, (16, V))
        self.steps.append((start, rows, int(launch.slot.record["accepted"])))
        return launch

    def logits_for(self, position: int) -> np.ndarray:
        """The verify row that produced the token at `position` (the last step starting before it)."""
        start, rows, _ = max((s for s in self.steps if s[0] < position), key=lambda s: s[0])
        return rows[position - start - 1]

    def close(self) -> None:
        self.engine.dflash.launch = self.orig


def _sampled_difference(backend, ids, got, want, params, log: _VerifyLog) -> str:
    """Sampled mode, at the first difference: each path's token must be the reference sampler's draw from that
    path's own logits at that position (plain: the M=1 decode step's; speculative: the 16-row verify row's).
    Then the paths differ only because their logits differ (different kernels, different rounding), not because
    the verify loop drew or committed wrongly."""
    from thorgen.runtime.reference.ops import softcap
    from thorgen.runtime.reference.sampling import sample

    cap = backend.spec.target.final_logit_softcapping
    i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
    p = len(ids) + i
    z_ver = log.logits_for(p).astype(np.float64)
    assert got[i] == sample(softcap(z_ver, cap), params, p), f"verify drew token {got[i]} at {p} wrongly"
    again = backend.generate(ids, i + 1, params).token_ids  # the plain path up to the differing token
    assert again == want[: i + 1]
    z_plain = backend.engine.logits().astype(np.float64)
    assert want[i] == sample(softcap(z_plain, cap), params, p), f"plain decode drew token {want[i]} at {p} wrongly"
    rel = np.linalg.norm(z_ver - z_plain) / np.linalg.norm(z_plain)
    return f"token {i}: both draws exact from their own logits (verify vs decode logits rel L2 {rel:.3g})"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_gpu_speculative_equals_plain(request, mode):
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda.backend import open_backend

    from thorgen.runtime.cuda import device as D

    D.set_driver(None)  # the real cuda-python driver, never the emulator the tests above install
    tiny_checkpoint, kernels = request.getfixturevalue("built")  # (conftest: skips without a GPU or nvcc)
    ck = Checkpoint.open(tiny_checkpoint)
    backend = open_backend(tiny_checkpoint, ctx=4096, kernels_dir=kernels)
    params = SamplingParams() if mode == "greedy" else SAMPLED
    shared = _shared()
    try:
        assert backend.features.speculative, backend.engine.spec_missing
        lengths: list[int] = []
        differing = []
        for pid, ids in _prompts(ck, shared):
            plain = backend.generate(ids, 64, params).token_ids
            log = _VerifyLog(backend.engine)
            try:
                res = backend.generate(ids, 64, params, speculative=True)
            finally:
                log.close()
            lengths += res.accepted_lengths
            if res.token_ids != plain:
                differing.append(pid)
                if params.greedy:
                    gap = _tie(backend, ids, res.token_ids, plain, params)
                    assert gap <= TIE_TOL, f"{pid}: speculative differs from plain (gap {gap:.3g}, not a tie)"
                    print(f"{pid}: tie (gap {gap:.3g}) at a difference")
                else:
                    print(f"{pid}: {_sampled_difference(backend, ids, res.token_ids, plain, params, log)}")
                continue
            _check_lengths(res)
        assert len(differing) <= 1, f"speculative departs from plain on {differing}"
        # forced drafts: long acceptances and rollbacks on the device
        ids = [2] + np.random.default_rng(12).integers(256, 512, 30).tolist()
        schedule = np.random.default_rng(5).permutation(16).tolist()
        n = 1 + sum(j + 1 for j in schedule)
        plain = backend.generate(ids, n + 16, params).token_ids
        log: list[int] = []
        backend.engine.dflash.draft_hook = _forced_hook(backend, len(ids), plain, schedule, log, strict=False)
        vlog = _VerifyLog(backend.engine)
        try:
            res = backend.generate(ids, n, params, speculative=True)
        finally:
            vlog.close()
            backend.engine.dflash.draft_hook = None
        if res.token_ids == plain[:n]:
            assert res.accepted_lengths == [j + 1 for j in log]
        elif params.greedy:
            assert _tie(backend, ids, res.token_ids, plain, params) <= TIE_TOL
        else:
            print(f"forced drafts: {_sampled_difference(backend, ids, res.token_ids, plain, params, vlog)}")
        print(f"{mode}: mean acceptance length of the real drafter {np.mean(lengths):.2f} over {len(lengths)} steps")
    finally:
        backend.close()


def test_drafts_that_miss_turn_into_plain_steps_launched_ahead(emu):
    """With the default (adaptive) draft policy, the random drafter's misses switch speculation off after a few
    DFlash steps: the sequence then decodes with plain steps, each launched before the one before it is read (as
    without speculation), and its tokens are plain decoding's."""
    from thorgen.runtime.engine.core import EngineCore

    open_, ck = emu
    backend, _ = open_()
    ids = _prompts(ck, None)[0][1]
    n = 48
    plain = backend.generate(ids, n, SamplingParams()).token_ids
    runner = backend.runner(1)
    core = EngineCore(runner)
    core.add("r", ids, n, SamplingParams(), speculative=True)
    outs = []
    while core.unfinished:
        outs += core.step()
    assert [t for o in outs for t in o.token_ids] == plain
    kinds = [o.accepted is not None for o in outs if o.token_ids][1:]  # (the first token: the prefill's)
    off = kinds.index(False)
    assert 0 < off <= 8 and all(kinds[:off]) and not any(kinds[off : off + DraftOptions().probe_every])
    assert runner.ahead_steps >= DraftOptions().probe_every - 2  # the plain steps ran launched ahead
    spec = core.health()["speculation"]
    assert spec["speculative_steps"] == sum(kinds) and spec["accepted_tokens"] == 0


def test_free_text_before_a_grammar_opens_is_drafted(emu, tiny_checkpoint):
    """A grammar that a token of the answer opens (a tool call under tool_choice auto): the free text before it
    runs DFlash steps with no mask, a verify block is cut right after the opening token (its later rows were
    sampled unmasked), the grammar's tokens are drafted in verify steps of their own (a batch of one, every row
    masked), and the tokens equal plain decoding's."""
    pytest.importorskip("llguidance")
    from thorgen.runtime.engine.core import EngineCore
    from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer

    open_, ck = emu
    backend, _ = open_()
    ids = _prompts(ck, None)[0][1]
    free = backend.generate(ids, GEN, SamplingParams()).token_ids
    at = next(i for i, t in enumerate(free) if i >= 4 and t not in free[:i])
    ll = tokenizer(str(tiny_checkpoint / "tokenizer.json"), ck.spec.target.vocab_size, (1,))
    sp = SamplingParams(grammar=Grammar(json_grammar(None, ll), ll, trigger=free[at]))
    plain = backend.generate(ids, GEN, sp, frozenset({1})).token_ids
    assert plain[: at + 1] == free[: at + 1] and plain[at + 1 :] != free[at + 1 :]
    log: list = []
    backend.engine.dflash.draft_hook = _forced_hook(backend, len(ids), plain + [0] * 16, [15], log)
    core = EngineCore(backend.runner(1), drafts=DraftOptions(adaptive=False))
    core.add("g", ids, GEN, sp, frozenset({1}), speculative=True)
    outs = []
    while core.unfinished:
        outs += core.step()
    backend.engine.dflash.draft_hook = None
    assert [t for o in outs for t in o.token_ids] == plain
    steps = [o for o in outs if o.token_ids]
    ends = np.cumsum([len(o.token_ids) for o in steps])
    opening = int(np.searchsorted(ends, at + 1))  # the step that committed the opening token (output index at)
    assert steps[opening].accepted is not None and ends[opening] == at + 1  # cut right after it
    masked = [o.accepted for o in steps[opening + 1 :] if o.accepted is not None]
    assert masked and max(masked) >= 1  # the grammar's tokens: drafted, and drafts landed
