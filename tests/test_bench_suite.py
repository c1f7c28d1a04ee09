"""The project's prompt suite (docs/prompt_suite.json) and `thorgen bench --suite` on the reference backend with
the tiny model: per prompt TTFT, decode tok/s and tau for plain and speculative decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from thorgen.runtime.text.prompts import FILLER_LINE, PromptRenderer, filler_for_tokens, load_suite

SUITE = Path(__file__).resolve().parents[1] / "docs" / "prompt_suite.json"
CATEGORIES = {
    "short_factual",
    "reasoning",
    "code_gen",
    "code_edit",
    "explanation",
    "multi_turn",
    "tool_use",
    "long_context_16k",
    "long_context_64k",
}


def test_the_suite_covers_every_category_and_renders(tiny_checkpoint):
    entries = load_suite(SUITE)
    assert {e["category"] for e in entries} == CATEGORIES
    assert len({e["id"] for e in entries}) == len(entries)
    renderer = PromptRenderer(tiny_checkpoint)
    per_repeat = len(renderer.tokenizer.encode(FILLER_LINE))
    for e in entries:
        ids = renderer.entry_ids(e)
        if "prompt_tokens" in e:  # sized to the target, within one filler line of it
            assert e["prompt_tokens"] - 2 * per_repeat < len(ids) <= e["prompt_tokens"], e["id"]
        if e.get("tools"):
            text = renderer.render(e["messages"], e["tools"])
            assert all(t["function"]["name"] in text for t in e["tools"]), e["id"]
    sizes = {e["category"]: e["prompt_tokens"] for e in entries if "prompt_tokens" in e}
    assert sizes == {"long_context_16k": 16000, "long_context_64k": 64000}


def test_filler_for_tokens_finds_the_edge():
    entry = {"id": "n"}

    def count(r):
        return 50 + 37 * r + (r % 3)  # not exactly linear, as real tokenizers are not

    r = filler_for_tokens(entry, 10_000, count)
    assert count(r) <= 10_000 < count(r + 1)
    assert filler_for_tokens(entry, 50, count) == 0
    with pytest.raises(ValueError, match="without filler"):
        filler_for_tokens(entry, 49, count)


class OracleDrafter:
    """Drafts the known greedy continuation, so every draft is accepted: tau must come out as the block size."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, full: list[int], block_size: int) -> None:
        self.full, self.block_size = full, block_size

    def new_context(self):
        from thorgen.runtime.reference.drafter import DraftContext

        return DraftContext(None, 0)

    def propose(self, ctx, last_token: int, start: int) -> list[int]:
        drafts = list(self.full[start + 1 : start + self.block_size])
        return drafts + [0] * (self.block_size - 1 - len(drafts))


def test_tau_is_measured_from_accepted_drafts(tiny_ckpt, tiny_checkpoint):
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.bench.suite import run_entries
    from thorgen.runtime.options import DraftOptions
    from thorgen.runtime.reference.backend import ReferenceBackend

    entry = {
        "id": "x",
        "category": "short_factual",
        "max_tokens": 33,
        "messages": [{"role": "user", "content": "Count to ten."}],
    }
    renderer = PromptRenderer(tiny_checkpoint)
    ids = renderer.entry_ids(entry)
    plain = ReferenceBackend(tiny_ckpt, prefix_cache=False).generate(ids, 33, SamplingParams()).token_ids
    backend = ReferenceBackend(tiny_ckpt, drafter=OracleDrafter(ids + plain, 16), prefix_cache=False)
    backend.draft_options = DraftOptions(adaptive=False)  # (every step drafts the whole block)
    [row] = run_entries(backend, renderer, [entry], 1, frozenset(), True)
    assert row["plain"]["tau"] == 1.0 and row["plain"]["steps"] == 32
    # 1 token from the prefill, then two fully accepted blocks of 16
    assert row["speculative"]["tau"] == 16.0 and row["speculative"]["steps"] == 2
    assert row["same_tokens"] is True and row["speculative"]["tokens"] == 33


def test_bench_suite_cli_on_the_reference_backend(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    suite = {
        "prompts": [
            {
                "id": "q",
                "category": "short_factual",
                "max_tokens": 6,
                "messages": [{"role": "user", "content": "What is two plus two?"}],
            },
            {
                "id": "turns",
                "category": "multi_turn",
                "max_tokens": 6,
                "messages": [
                    {"role": "user", "content": "Hi."},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Name a colour."},
                ],
            },
            {
                "id": "tool",
                "category": "tool_use",
                "max_tokens": 6,
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "get_forecast",
                            "parameters": {
                                "type": "object",
                                "properties": {"city": {"type": "string"}},
                                "required": ["city"],
                            },
                        },
                    }
                ],
            },
            {
                "id": "needle",
                "category": "long_context_16k",
                "_build": "needle",
                "needle": "The code is 42.",
                "question": "What is the code?",
                "filler_repeats": 2,
                "prompt_tokens": 400,
                "max_tokens": 4,
            },
            {
                "id": "huge",
                "category": "long_context_64k",
                "_build": "needle",
                "needle": "The code is 42.",
                "question": "What is the code?",
                "filler_repeats": 2,
                "prompt_tokens": 64000,
                "max_tokens": 4,
            },
        ]
    }
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(suite))
    out = tmp_path / "out.json"
    res = CliRunner().invoke(
        bench,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--suite",
            str(path),
            "--runs",
            "1",
            "--ignore-eos",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert r["speculative"] is True and "--suite" in r["command"] and r["ctx"] == 8192
    rows = {row["id"]: row for row in r["prompts"]}
    assert list(rows) == ["q", "turns", "tool", "needle", "huge"]
    assert "exceed the context of 8192" in rows["huge"]["skipped"]
    assert rows["needle"]["prompt_tokens"] <= 400 and rows["tool"]["prompt_tokens"] > rows["q"]["prompt_tokens"]
    for name in ("q", "turns", "tool", "needle"):
        row = rows[name]
        for mode in ("plain", "speculative"):
            m = row[mode]
            assert m["ttft_ms"] > 0 and m["decode_tok_s"] > 0 and m["tokens"] == row["max_tokens"]
            assert 1.0 <= m["tau"] <= 16
        assert row["plain"]["tau"] == 1.0 and row["same_tokens"] is True
    assert r["summary"]["ran"] == 4 and r["summary"]["prompts"] == 5
    assert "skipped" in res.output and "spec: TTFT" in res.output


def test_bench_suite_rejects_a_malformed_file(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"prompts": [{"id": "n", "_build": "needle", "needle": "x"}]}))
    res = CliRunner().invoke(bench, ["--model", str(tiny_checkpoint), "--backend", "reference", "--suite", str(path)])
    assert res.exit_code != 0 and "needs needle, question and filler_repeats" in res.output
