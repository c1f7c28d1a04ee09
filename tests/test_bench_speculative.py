"""`thorgen bench --speculative [--emulate-acceptance K]` (runtime/bench/speculative.py) on the CPU: with emulated
acceptance every verify step commits exactly K + 1 tokens, on the reference backend through the CLI and on the
emulated cuda engine (tests/engine_emulator.py), whose DFlash steps also record their draft / verify event times
and get per-kernel tables; without a drafter the option is a clear error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))

from thorgen.runtime.bench.cli import bench  # noqa: E402
from thorgen.runtime.bench.timing import synthetic_prompt  # noqa: E402


@pytest.mark.parametrize("k", [0, 3])
def test_emulated_acceptance_on_the_reference_backend(tiny_checkpoint, tmp_path, k):
    out = tmp_path / "spec.json"
    r = CliRunner().invoke(
        bench,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-len",
            "8",
            "--gen",
            "25",
            "--runs",
            "1",
            "--speculative",
            "--emulate-acceptance",
            str(k),
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    s = report["speculative"]
    assert s["emulated_acceptance"] == k == report["emulated_acceptance"] and "not the model's" in s["note"]
    # 24 tokens after the first: steps of k + 1, the last one cut at max_tokens
    assert report["tau"] == pytest.approx((24 / -(-24 // (k + 1))), rel=0.2) and report["spec_tok_s"] > 0
    assert "EMULATED acceptance" in r.output


def test_emulated_acceptance_commits_k_plus_one_on_the_cuda_engine(tiny_checkpoint, tmp_path):
    import engine_emulator as EE

    pytest.importorskip("thorgen.codegen.plan")
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.backend import GenerationResult, SamplingParams
    from thorgen.runtime.bench.speculative import measure_speculative

    b = EE.open_emulated(tiny_checkpoint, tmp_path, ctx=512)
    try:
        prompt = synthetic_prompt(b.spec, 20)
        b.engine.dflash.emulate_acceptance = 5
        res = GenerationResult()
        for _ in b.generate_stream(prompt, 1 + 6 * 4, SamplingParams(), speculative=True, result=res):
            pass
        assert res.accepted_lengths == [6] * 4
        b.engine.dflash.emulate_acceptance = None
        report: dict = {}
        measure_speculative(b, report, prompt, 13, 1, 2)
        assert report["tau"] == 3 and report["verify_step_ms"] is not None and report["draft_step_ms"] is not None
        assert report["verify_step_kernels"] and report["draft_step_kernels"]
        assert b.engine.dflash.emulate_acceptance is None and b.engine.dflash.timing is None  # left as it was
        assert b.engine.dflash.draft_hook is None
        # while it runs, the drafts are 15 distinct tokens a step (a verify routed like text), others a step later
        from thorgen.runtime.bench.speculative import _emulate

        _emulate(b, 2, timing=True)
        drafts = [[int(t) for t in b.engine.dflash.draft_hook(p, 0)] for p in (20, 21)]
        _emulate(b, None, timing=False)
        vocab = b.spec.target.vocab_size
        assert all(len(set(d)) == 15 and all(0 <= t < vocab for t in d) for d in drafts) and drafts[0] != drafts[1]
        assert b.engine.dflash.draft_hook is None
    finally:
        b.close()
        dev.set_driver(None)


def test_speculative_without_a_drafter_is_a_clear_error(tiny_checkpoint, tmp_path):
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(tiny_checkpoint, plain, ignore=shutil.ignore_patterns("dflash"))
    r = CliRunner().invoke(
        bench,
        [
            "--model",
            str(plain),
            "--backend",
            "reference",
            "--prompt-len",
            "8",
            "--gen",
            "8",
            "--runs",
            "1",
            "--speculative",
        ],
    )
    assert r.exit_code != 0 and "DFlash drafter" in r.output
    r = CliRunner().invoke(bench, ["--model", str(plain), "--backend", "reference", "--emulate-acceptance", "2"])
    assert r.exit_code != 0 and "--emulate-acceptance goes with --speculative" in r.output
