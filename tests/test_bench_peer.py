"""CPU test of `thorgen bench --peer hf` on the tiny checkpoint: HF transformers' Gemma4 gets the checkpoint's
weights (runtime/bench/peer.py), decodes the bench's prompt with a static cache, and the report carries the ratios."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.usefixtures("one_torch_thread")
def test_bench_reports_the_peer_and_the_ratios(tiny_checkpoint, tmp_path):
    from thorgen.cli import main

    out = tmp_path / "peer.json"
    r = CliRunner().invoke(
        main,
        [
            "bench",
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-len",
            "16",
            "--gen",
            "6",
            "--runs",
            "1",
            "--peer",
            "hf",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    peer = report["peer"]
    assert peer["cache"] == "static" and peer["device"] == "cpu" and peer["decode_tok_s"] > 0
    assert peer["decode_ratio"] == pytest.approx(report["decode_tok_s"] / peer["decode_tok_s"], rel=1e-2)
    assert "peer" in r.output and "its decode" in r.output


def test_peer_greedy_tokens_equal_the_reference(tiny_checkpoint):
    """The peer runs the same model: its greedy continuation equals the NumPy reference's (float32)."""
    import torch

    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.bench.peer import hf_model
    from thorgen.runtime.reference.backend import ReferenceBackend

    ck = Checkpoint.open(tiny_checkpoint)
    prompt = [2, 300, 301, 302, 303, 304]
    model = hf_model(ck, "float32")
    out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, cache_implementation="static")
    ours = ReferenceBackend(ck, max_context=256).generate(prompt, 8, SamplingParams()).token_ids
    assert out[0, len(prompt) :].tolist() == ours
