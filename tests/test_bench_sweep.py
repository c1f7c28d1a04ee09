"""Runtime tests: `thorgen bench sweep` on the reference backend (tiny checkpoint): one row per prompt length,
prefill tok/s consistent with the TTFT, and a clear error for a KV dtype the backend cannot run."""

from __future__ import annotations

import json

from click.testing import CliRunner

from thorgen.runtime.bench.sweep import sweep


def test_sweep_rows(tiny_checkpoint, tmp_path):
    out = tmp_path / "sweep.json"
    r = CliRunner().invoke(
        sweep,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-lens",
            "8,40",
            "--kv-dtypes",
            "bf16",
            "--gen",
            "3",
            "--runs",
            "1",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 0, r.output
    rows = json.loads(out.read_text())["rows"]
    assert [(x["kv_dtype"], x["prompt_len"]) for x in rows] == [("bf16", 8), ("bf16", 40)]
    for x in rows:
        assert x["ttft_ms"] > 0 and x["decode_tok_s"] > 0
        assert abs(x["prefill_tok_s"] - x["prompt_len"] / (x["ttft_ms"] / 1e3)) <= 0.1 * x["prefill_tok_s"] + 0.1


def test_sweep_bad_input(tiny_checkpoint):
    r = CliRunner().invoke(
        sweep,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-lens",
            "8",
            "--kv-dtypes",
            "fp8",
            "--gen",
            "2",
            "--runs",
            "1",
        ],
    )
    assert r.exit_code != 0 and "fp8" in r.output and "cuda" in r.output
    r = CliRunner().invoke(sweep, ["--model", str(tiny_checkpoint), "--prompt-lens", "8,x"])
    assert r.exit_code != 0 and "comma-separated" in r.output
    r = CliRunner().invoke(
        sweep,
        ["--model", str(tiny_checkpoint), "--backend", "reference", "--prompt-lens", "9000", "--kv-dtypes", "bf16"],
    )
    assert r.exit_code != 0 and "8192" in r.output  # over the tiny model's max_position_embeddings
