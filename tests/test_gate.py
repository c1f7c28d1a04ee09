"""Serve tests: `thorgen gate` on traces the reference backend writes from the tiny synthetic checkpoint. The
engine's own traces pass (with token ids, and without them as in vLLM's traces); corrupted ones (a changed token,
an expected substring the answer lacks, DFlash counters above ours, another prompt length) fail with exit code 1
and a table row that says why. The seed traces load (the long-context one's messages rebuilt from the suite) and the
shipped expectations
of the seed suite hold for vLLM's answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from thorgen.cli import main
from thorgen.serve.tools.gate import GateError, load_traces, margin
from thorgen.runtime.text.prompts import load_suite

REPO = Path(__file__).resolve().parent.parent
SUITE = {
    "prompts": [
        {
            "id": "capital",
            "category": "short_factual",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
        },
        {
            "id": "haiku",
            "category": "multi_turn",
            "max_tokens": 8,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "Write a haiku."},
            ],
        },
    ]
}


def _gate(model: Path, traces: Path, *extra: str):
    return CliRunner().invoke(
        main,
        ["gate", "--model", str(model), "--backend", "reference", "--traces", str(traces), "--margin", "0", *extra],
    )  # margin 0: every position counts


def _rows(output: str) -> dict[tuple[str, str], str]:
    """(trace, check) -> the rest of its table line."""
    rows = {}
    for line in output.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and parts[1] in ("prompt", "run", "top-1", "expect", "dflash"):
            rows[(parts[0], parts[1])] = parts[2]
    return rows


@pytest.fixture(scope="module")
def traces(tiny_checkpoint, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("gate")
    (folder / "suite.json").write_text(json.dumps(SUITE))
    out = folder / "traces"
    result = _gate(tiny_checkpoint, out, "--write-traces", "--suite", str(folder / "suite.json"))
    assert result.exit_code == 0, result.output
    return out


def _edit(src: Path, dst: Path, change) -> None:
    dst.mkdir()
    for path in src.glob("*.json"):
        trace = json.loads(path.read_text())
        change(trace)
        (dst / path.name).write_text(json.dumps(trace))


def test_own_traces_pass(tiny_checkpoint, traces, tmp_path):
    written = {t["id"]: t for t in load_traces(traces)}
    assert set(written) == {"capital", "haiku"}
    for t in written.values():
        assert len(t["tokens"]) == t["n_completion_tokens"] > 0 and len(t["tokens"][0]["top"]) == 5
        assert t["dflash"]["drafts"] > 0  # the tiny checkpoint has a drafter

    def like_vllm(trace):  # vLLM's traces have no token ids; the engine's answer becomes an expectation
        for entry in trace["tokens"]:
            entry.pop("id")
            for alt in entry["top"]:
                alt.pop("id")
        trace["expect"] = [trace["content"][:2]] if trace["content"] else []

    _edit(traces, tmp_path / "no-ids", like_vllm)
    for folder in (traces, tmp_path / "no-ids"):
        result = _gate(tiny_checkpoint, folder)
        assert result.exit_code == 0, result.output
        rows = _rows(result.output)
        assert len(rows) == 8 and not any(r.startswith("FAIL") for r in rows.values()), result.output
        for tid in ("capital", "haiku"):
            assert rows[(tid, "top-1")].startswith("pass") and "(100%, 0 resyncs)" in rows[(tid, "top-1")]
            assert rows[(tid, "dflash")].startswith("pass") and rows[(tid, "prompt")].startswith("pass")
    assert "passed, 0 failed" in result.output


def test_corrupted_traces_fail(tiny_checkpoint, traces, tmp_path):
    def corrupt(trace):
        if trace["id"] == "capital":  # the reference's token 2 becomes its runner-up
            entry, alt = trace["tokens"][2], trace["tokens"][2]["top"][1]
            entry.update(token=alt["token"], id=alt["id"])
            trace["expect"] = ["no such answer"]
        else:
            trace["dflash"]["accepted_tokens"] = 15 * trace["dflash"]["drafts"]
            trace["usage"]["prompt_tokens"] += 1

    _edit(traces, tmp_path / "bad", corrupt)
    result = _gate(tiny_checkpoint, tmp_path / "bad")
    assert result.exit_code == 1, result.output
    rows = _rows(result.output)
    assert rows[("capital", "top-1")].startswith("FAIL") and "token 2: ours" in rows[("capital", "top-1")]
    assert rows[("capital", "expect")].startswith("FAIL") and "no such answer" in rows[("capital", "expect")]
    assert rows[("capital", "dflash")].startswith("pass") and rows[("haiku", "top-1")].startswith("pass")
    assert rows[("haiku", "dflash")].startswith("FAIL") and "15.00" in rows[("haiku", "dflash")]
    assert rows[("haiku", "prompt")].startswith("FAIL")
    assert "4 failed" in result.output
    # without speculative decoding the acceptance check is skipped, not passed
    rows = _rows(_gate(tiny_checkpoint, tmp_path / "bad", "--no-speculative").output)
    assert rows[("haiku", "dflash")].startswith("skip")


def test_bad_trace_names_the_file(tiny_checkpoint, tmp_path):
    (tmp_path / "one.json").write_text('{"messages": []}')
    result = _gate(tiny_checkpoint, tmp_path)
    assert result.exit_code != 0 and "one.json" in result.output and "max_tokens" in result.output
    (tmp_path / "one.json").write_text("{")
    result = _gate(tiny_checkpoint, tmp_path)
    assert result.exit_code != 0 and "one.json" in result.output and "Traceback" not in result.output


def test_seed_traces_and_expectations(shared_dir):
    """The seed traces load; the shipped expectations are in vLLM's answers; confident positions exist."""
    suite = load_suite(shared_dir / "seed_data" / "prompt_suite.json")
    traces = {t["id"]: t for t in load_traces(shared_dir / "seed_data" / "traces", suite)}
    assert "Bluefin" in traces["longctx_001"]["messages"][0]["content"]  # rebuilt from the suite's recipe
    with pytest.raises(GateError, match="longctx_001.json: its messages were omitted"):
        load_traces(shared_dir / "seed_data" / "traces")
    expect = json.loads((REPO / "docs" / "gate" / "seed-suite-expect.json").read_text())
    assert set(expect) <= set(traces)
    for tid, wanted in expect.items():
        assert all(w in traces[tid]["content"] for w in wanted), tid
    margins = [margin(e) for t in traces.values() for e in t["tokens"]]
    assert sum(m >= 2.0 for m in margins) > 0.8 * len(margins)
