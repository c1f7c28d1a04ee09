"""Runtime tests: `thorgen bench report` regenerates docs/BENCHMARKS.md from NOTES.md and the committed JSON runs
(byte-identical to the committed file, so a stale report fails; the summary first, then the topic sections), writes
valid PNGs, appends runs NOTES.md does not place (a roofline run and a verify-step profile here), draws the summary,
`thorgen bench --suite` runs and the `--peer hf` rows of the bench view from made-up sample runs, adds a run's
commit and machine from NOTES.md's run lines, and names the file when a run or a notes line is wrong."""

from __future__ import annotations

import copy
import json
import shutil
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from thorgen.cli import main
from thorgen.runtime.bench.report import build_report

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "docs" / "benchmarks"


def _png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; AssertionError unless the file is a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", head[16:24])


def _copy_bench(tmp_path: Path) -> Path:
    """docs/benchmarks (JSON + NOTES.md, no plots) under tmp_path/docs, so that image links match the repo's."""
    folder = tmp_path / "docs" / "benchmarks"
    folder.mkdir(parents=True)
    for path in [*BENCH.glob("*.json"), BENCH / "NOTES.md"]:
        shutil.copy(path, folder / path.name)
    return folder


def _report(folder: Path) -> CliRunner:
    doc = folder.parent / "BENCHMARKS.md"
    return CliRunner().invoke(main, ["bench", "report", "--dir", str(folder), "--out", str(doc)])


def test_committed_report_is_regenerated(tmp_path):
    pytest.importorskip("matplotlib")
    folder = _copy_bench(tmp_path)
    result = _report(folder)
    assert result.exit_code == 0, result.output
    text = (folder.parent / "BENCHMARKS.md").read_text()
    assert text == (REPO / "docs" / "BENCHMARKS.md").read_text(), (
        "docs/BENCHMARKS.md is stale: run `thorgen bench report` from the repository root"
    )
    # the generated tables carry the JSON's numbers ...
    sweep = json.loads((folder / "h200-context-sweep.json").read_text())
    for row in sweep["rows"]:
        assert f"| {row['kv_dtype']} | {row['prompt_len']} | {row['ttft_ms']:.1f} |" in text
    serve = json.loads((folder / "h200-serve-concurrency.json").read_text())
    for level in serve["levels"]:
        assert f"| {level['concurrency']} | {level['requests']} | {level['aggregate_tok_s']:.1f} |" in text
    kernels = json.loads((folder / "h200-kernels-bandwidth.json").read_text())["kernels"]
    for k in kernels:
        assert f"| `{k['kernel']}` | {k['note']} | {k['single_us']:.1f} | {k['stream_us']:.2f} |" in text
    decode = json.loads((folder / "h200-decode-spec-emulated6.json").read_text())
    assert f"{decode['decode_tok_s']:.1f} (" in text
    for k in decode["decode_step_kernels"]:
        assert f"| `{k['kernel']}` | {k['count']} |" in text
    # the summary opens the document: the headline numbers of the runs it names, with where they came from ...
    summary = text[text.index("## Summary") : text.index("## Decode step")]
    assert f"| batch-1 decode | **{decode['decode_tok_s']:.1f} tok/s**" in summary
    assert f"**{decode['speculative']['spec_tok_s']:,.1f} tok/s**" in summary and "**emulated**" in summary
    ttft = json.loads((folder / "h200-ttft-p2048.json").read_text())
    assert f"| TTFT, 2,048-token prompt | **{ttft['ttft_ms']:.1f} ms** |" in summary
    assert "`docs/benchmarks/h200-decode-spec-emulated6.json`: NVIDIA H200, 2026-12-04, commit 9686a8e:" in summary
    assert "`docs/benchmarks/h200-serve-concurrency.json`: NVIDIA H200, 2026-12-02, commit d8ba5ad:" in summary
    assert "Published numbers for the same model" in summary
    # ... then the sections by topic, in this order
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert (
        headings[:7]
        == [
            "## Summary",
            "## Decode step",
            "## Speculative step",
            "## Prefill",
            "## Batching",
            "## Serving",
            "## Kernels",
        ]
        and headings[-1] == "## Ablations"
    )
    # ... and the hand-written tables and prose of NOTES.md survive
    for kept in (
        "| step | command | wall | peak process |",
        "| tree | TTFT at 2,048 tokens |",
        "| comparison | relative L2 error |",
        "| check (tiny preset, H200) | result |",
        "- fp8 KV is slower than bf16 here",
        "| change | measured | kept |",
    ):
        assert kept in text
    assert "<!-- run" not in text
    assert "<!-- report" not in text and "<!-- notes" not in text and "## Other runs" not in text
    # every linked plot was written and is a PNG of a sensible size
    plots = sorted((folder / "plots").glob("*.png"))
    assert {p.name for p in plots} == {p.name for p in (BENCH / "plots").glob("*.png")}
    for p in plots:
        assert f"(benchmarks/plots/{p.name})" in text
        width, height = _png_size(p)
        assert 300 <= width <= 1600 and 200 <= height <= 1600


def test_unplaced_runs_are_appended(tmp_path):
    """A roofline run and a verify-step profile that NOTES.md does not name still get tables and plots."""
    pytest.importorskip("matplotlib")
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "NOTES.md").write_text("# Benchmarks\n\nHand-written.\n")
    run = {
        "gpu": "Test GPU",
        "date": "2026-12-02T00:00:00+00:00",
        "command": "thorgen bench --roofline",
        "roofline": {
            "decode": {
                "bytes": 2.0e9,
                "flops": 8.0e9,
                "ms": 2.5,
                "copy_gbs": 4000.0,
                "frac_copy": 0.2,
                "frac_tc": 0.004,
            },
            "prefill": {"bytes": 3.0e9, "flops": 4.0e12, "ms": 30.0},
        },  # fractions absent: tolerated
        "verify_step_kernels": [{"kernel": "k_a", "us": 30.0, "count": 3}, {"kernel": "k_b", "us": 10.0, "count": 1}],
    }
    (folder / "r.json").write_text(json.dumps(run))
    out = tmp_path / "BENCHMARKS.md"
    text, written = build_report(folder, folder / "NOTES.md", out, folder / "plots")
    assert text.startswith("<!-- Generated by") and "Hand-written." in text and "## Other runs" in text
    assert "| decode | 2.000 | 8.0 | 2.500 | 800 | 4000 | 20.0% | 3.2 | 0.4% |" in text
    assert "| prefill | 3.000 | 4000.0 | 30.000 | 100 |  |  | 133.3 |  |" in text
    assert "| `k_a` | 3 | 30.0 | 10.00 | 75.0% |" in text
    assert sorted(p.name for p in written) == ["r-roofline.png", "r-verify-kernels.png"]
    for p in written:
        _png_size(p)
        assert f"(b/plots/{p.name})" in text


# ---- made-up sample runs, shaped as `thorgen bench --suite` and `thorgen bench --peer hf` write them ------------

SAMPLE_SUITE = {  # a sample, not a measurement: a model with a drafter, one prompt too long for the context
    "gpu": "Sample GPU",
    "command": "thorgen bench --suite docs/prompt_suite.json --out sample-suite.json",
    "backend": "cuda",
    "model": "sample-gemma4",
    "suite_file": "docs/prompt_suite.json",
    "ctx": 32768,
    "kv_dtype": "bf16",
    "runs": 3,
    "ignore_eos": False,
    "speculative": True,
    "date": "2026-12-03T10:00:00+00:00",
    "summary": {
        "prompts": 4,
        "ran": 3,
        "plain_decode_tok_s_median": 400.0,
        "speculative_decode_tok_s_median": 700.0,
        "speculative_tau_median": 1.9,
    },
    "prompts": [
        {
            "id": "fact_01",
            "category": "short_factual",
            "max_tokens": 64,
            "prompt_tokens": 20,
            "plain": {"ttft_ms": 25.125, "decode_tok_s": 401.25, "tau": 1.0, "tokens": 64, "steps": 63},
            "speculative": {"ttft_ms": 27.5, "decode_tok_s": 702.5, "tau": 1.85, "tokens": 64, "steps": 34},
            "same_tokens": True,
        },
        {
            "id": "fact_02",
            "category": "short_factual",
            "max_tokens": 64,
            "prompt_tokens": 30,
            "plain": {"ttft_ms": 26.875, "decode_tok_s": 400.0, "tau": 1.0, "tokens": 40, "steps": 39},
            "speculative": {"ttft_ms": 28.0, "decode_tok_s": 650.0, "tau": 1.7, "tokens": 40, "steps": 23},
            "same_tokens": False,
        },
        {
            "id": "code_gen_01",
            "category": "code_gen",
            "max_tokens": 256,
            "prompt_tokens": 1500,
            "plain": {"ttft_ms": 140.0, "decode_tok_s": 395.5, "tau": 1.0, "tokens": 256, "steps": 255},
            "speculative": {"ttft_ms": 150.0, "decode_tok_s": 700.0, "tau": 1.9, "tokens": 256, "steps": 134},
            "same_tokens": True,
        },
        {
            "id": "longctx_64k_01",
            "category": "long_context_64k",
            "max_tokens": 256,
            "prompt_tokens": 64010,
            "skipped": "64010 prompt + 256 new tokens exceed the context of 32768 (--ctx)",
        },
    ],
}


def _sample_suite_plain() -> dict:
    """The sample suite on a model without a drafter (no speculative rows), one prompt failing to render."""
    run = copy.deepcopy(SAMPLE_SUITE)
    run.update(speculative=False, command="thorgen bench --suite s.json --out sample-suite-plain.json")
    run["summary"].update(speculative_decode_tok_s_median=None, speculative_tau_median=None)
    for row in run["prompts"]:
        row.pop("speculative", None)
        row.pop("same_tokens", None)
    run["prompts"][3] = {
        "id": "tool_use_01",
        "category": "tool_use",
        "max_tokens": 128,
        "skipped": "tool_use_01: no chat template | tools given",
    }
    return run


def _suite_without_plain() -> dict:
    run = copy.deepcopy(SAMPLE_SUITE)
    del run["prompts"][0]["plain"]
    return run


def _sample_bench(peer: dict | None, decode: float, ttft: float) -> dict:
    """A sample `thorgen bench` run (made up), with the peer object `--peer hf` adds when given."""
    run = {
        "gpu": "Sample GPU",
        "date": "2026-12-03T11:00:00+00:00",
        "command": "thorgen bench --prompt-len 512",
        "prompt_len": 512,
        "gen": 256,
        "runs": 3,
        "decode_tok_s": decode,
        "ttft_ms": ttft,
        "step_ms": 2.5,
    }
    return run | ({"peer": peer} if peer else {})


SAMPLE_PEER = {  # a sample: as runtime/bench/peer.py writes it now, with the experts implementation it picked
    "peer": "hf transformers 5.17.0 Gemma4ForCausalLM",
    "device": "cuda",
    "dtype": "bfloat16",
    "compiled": True,
    "cache": "static",
    "experts": "grouped_mm",
    "experts_tried": {"grouped_mm": 95.5, "batched_mm": 61.25, "eager": "unavailable: RuntimeError: out of\n  memory"},
    "load_s": 41.2,
    "ttft_ms": 412.3,
    "decode_tok_s": 93.0,
    "tokens": 256,
    "decode_ratio": 4.301,
    "ttft_ratio": 3.298,
}
SAMPLE_PEER_OLD = {  # a sample of an older run: no experts, experts_tried or load_s yet
    "peer": "hf transformers 5.9.0 Gemma4ForCausalLM",
    "device": "cpu",
    "dtype": "float32",
    "compiled": False,
    "cache": "static",
    "ttft_ms": 980.0,
    "decode_tok_s": 20.5,
    "tokens": 256,
    "decode_ratio": 18.537,
    "ttft_ratio": 7.538,
}


def _sample_folder(tmp_path: Path, notes: str, runs: dict[str, dict]) -> Path:
    folder = tmp_path / "b"
    folder.mkdir()
    (folder / "NOTES.md").write_text(notes)
    for name, run in runs.items():
        (folder / name).write_text(json.dumps(run))
    return folder


def test_suite_view(tmp_path):
    """A placed suite run with speculative rows, and an unplaced one without them: tables, medians, plots."""
    pytest.importorskip("matplotlib")
    folder = _sample_folder(
        tmp_path,
        "# Benchmarks\n\n<!-- report suite sample-suite.json -->\n",
        {"sample-suite.json": SAMPLE_SUITE, "sample-suite-plain.json": _sample_suite_plain()},
    )
    text, written = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    spec, plain = text.split("## Other runs")
    assert (
        "Run: Sample GPU, 2026-12-03 (`docs/benchmarks/sample-suite.json`): "
        "`thorgen bench --suite docs/prompt_suite.json --out sample-suite.json`"
    ) in spec
    assert "model `sample-gemma4` (cuda backend), ctx 32768, KV bf16, the median of 3 runs" in spec
    assert (
        "| prompt | category | prompt tokens | new tokens | plain TTFT ms | plain decode tok/s | "
        "speculative decode tok/s | tau | same tokens |"
    ) in spec
    assert "| `fact_01` | short_factual | 20 | 64 | 25.1 | 401.2 | 702.5 | 1.85 | yes |" in spec
    assert "| `fact_02` | short_factual | 30 | 40 | 26.9 | 400.0 | 650.0 | 1.70 | **no** |" in spec
    assert "| `code_gen_01` | code_gen | 1500 | 256 | 140 | 395.5 | 700.0 | 1.90 | yes |" in spec
    assert (
        "| `longctx_64k_01` | long_context_64k | 64010 |  | skipped: 64010 prompt + 256 new tokens exceed the "
        "context of 32768 (--ctx) |  |  |  |  |"
    ) in spec
    # per category: the median over the prompts that ran, a skipped one counted but not measured
    assert "| short_factual | 2 / 2 | 25 | 26.0 | 400.6 | 676.2 | 1.77 | 1 / 2 |" in spec
    assert "| code_gen | 1 / 1 | 1500 | 140 | 395.5 | 700.0 | 1.90 | 1 / 1 |" in spec
    assert "| long_context_64k | 0 / 1 |  |  |  |  |  |  |" in spec
    assert (
        "Medians over the 3 of 4 prompts that ran: plain decode 400.0 tok/s, speculative decode 700.0 tok/s "
        "at tau 1.90 (1.75x plain)."
    ) in spec
    assert "![suite of sample-suite.json](b/plots/sample-suite-suite.png)" in spec
    # without a drafter: no speculative columns, and a skip reason's "|" escaped so the row keeps its cells
    assert "| prompt | category | prompt tokens | new tokens | plain TTFT ms | plain decode tok/s |\n" in plain
    assert "speculative decode tok/s" not in plain and "same tokens" not in plain
    assert "no drafter, so plain decoding only" in plain
    assert "| `fact_01` | short_factual | 20 | 64 | 25.1 | 401.2 |\n" in plain
    assert "| `tool_use_01` | tool_use |  |  | skipped: tool_use_01: no chat template \\| tools given |" in plain
    assert "Medians over the 3 of 4 prompts that ran: plain decode 400.0 tok/s." in plain
    assert sorted(p.name for p in written) == ["sample-suite-plain-suite.png", "sample-suite-suite.png"]
    for p in written:
        width, height = _png_size(p)
        assert 300 <= width <= 1600 and 200 <= height <= 1600


def test_bench_view_peer_rows(tmp_path):
    """Peer rows appear only in a bench view with a peer run; older peer objects (no experts) still render."""
    pytest.importorskip("matplotlib")
    notes = (
        "<!-- report bench sample-bench.json -->\n\nSPLIT\n\n<!-- report bench sample-bench-peer.json "
        "sample-bench-peer-old.json sample-bench.json -->\n"
    )
    folder = _sample_folder(
        tmp_path,
        notes,
        {
            "sample-bench.json": _sample_bench(None, 390.0, 120.0),
            "sample-bench-peer.json": _sample_bench(SAMPLE_PEER, 400.0, 125.0),
            "sample-bench-peer-old.json": _sample_bench(SAMPLE_PEER_OLD, 380.0, 130.0),
        },
    )
    text, _ = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    alone, compared = text.split("SPLIT")
    assert "| decode tok/s, median (range) | 390.0 |" in alone and "peer" not in alone
    assert (
        "| peer | hf transformers 5.17.0 Gemma4ForCausalLM (bfloat16, cuda, static cache, torch.compile, experts "
        "grouped_mm) | hf transformers 5.9.0 Gemma4ForCausalLM (float32, cpu, static cache) |  |"
    ) in compared
    assert "| peer decode tok/s / TTFT ms | 93.0 / 412.3 | 20.5 / 980.0 |  |" in compared
    assert "| peer load s | 41.2 |  |  |" in compared
    assert (
        "| ours vs peer | ours: 4.3x its decode tok/s; its TTFT 3.3x ours | ours: 18.5x its decode tok/s; its "
        "TTFT 7.5x ours |  |"
    ) in compared
    assert (
        "- `sample-bench-peer` peer experts tried (tok/s of a short uncompiled decode, prefill included: a "
        "ranking only): grouped_mm 95.50; batched_mm 61.25; eager unavailable: RuntimeError: out of memory\n"
    ) in compared
    assert "`sample-bench-peer-old` peer experts tried" not in compared


def test_bench_view_speculative_rows(tmp_path):
    """A `bench --speculative --emulate-acceptance K` run gets its rows, marked emulated; a plain run beside it
    leaves them empty."""
    pytest.importorskip("matplotlib")
    spec = dict(
        _sample_bench(None, 400.0, 120.0),
        speculative={  # sample numbers, shaped as bench_spec writes
            "emulated_acceptance": 6,
            "tau": 7.0,
            "spec_tok_s": 1012.5,
            "step_ms": 6.914,
            "draft_step_ms": 0.98,
            "verify_step_ms": 5.71,
            "spec_tok_s_runs": [1012.5],
        },
    )
    notes = "<!-- report bench sample-bench-spec.json sample-bench.json -->\n"
    folder = _sample_folder(
        tmp_path, notes, {"sample-bench.json": _sample_bench(None, 390.0, 120.0), "sample-bench-spec.json": spec}
    )
    text, _ = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    assert "| speculative tok/s, tau | 1012.5, 7.00 (**emulated**: 6 drafts accepted a step) |  |" in text
    assert "| speculative step ms (draft + verify on the GPU) | 6.914 (0.980 + 5.710) |  |" in text


def _sample_image(budget: int, soft: int, encode: float | None, ttft: float) -> dict:
    """A sample image entry (made up), shaped as runtime/bench/image.py writes one per budget."""
    return {
        "file": "img.png",
        "width": 1280,
        "height": 720,
        "budget": budget,
        "soft_tokens": soft,
        "patches": soft * 9,
        "prompt_tokens": 512 + soft + 2,
        "preprocess_ms": 12.5,
        "encode_ms": encode,
        "ttft_ms": ttft,
        "ttft_ms_runs": [ttft],
        "decode_tok_s": 480.0,
    }


def test_image_view_reads_runs_of_one_budget_and_of_several(tmp_path):
    """`thorgen bench --image` runs list an entry per budget (`images`); older runs hold one `image`: the image
    view draws a row per run and budget for both, in budget order, and an unplaced run gets it too."""
    pytest.importorskip("matplotlib")
    listed = dict(
        _sample_bench(None, 490.0, 18.0),
        images=[_sample_image(1120, 1100, 150.0, 170.0), _sample_image(70, 64, None, 25.0)],
    )
    single = dict(_sample_bench(None, 491.0, 18.5), image=_sample_image(280, 264, 68.7, 98.5))
    folder = _sample_folder(
        tmp_path,
        "<!-- report image sample-old.json sample-list.json -->\n",
        {"sample-old.json": single, "sample-list.json": listed, "sample-other.json": listed},
    )
    text, _ = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    placed, other = text.split("## Other runs")
    rows = [line for line in placed.splitlines() if line.startswith("| `sample-")]
    assert rows == [
        "| `sample-old` | img.png 1280x720 | 280 | 264 (2,376) | 12.5 ms | 68.7 ms | 98.5 ms | 480.0 tok/s |",
        "| `sample-list` | img.png 1280x720 | 70 | 64 (576) | 12.5 ms | n/a | 25.0 ms | 480.0 tok/s |",
        "| `sample-list` | img.png 1280x720 | 1120 | 1,100 (9,900) | 12.5 ms | 150.0 ms | 170.0 ms | 480.0 tok/s |",
    ]
    assert "The image ahead of a 512-token text prompt" in placed
    assert "| `sample-other` | img.png 1280x720 | 1120 |" in other  # the image view applies to an unplaced run


def test_serve_view_of_image_arrivals(tmp_path):
    """A `bench serve --image --image-arrivals` run: the streams' inter-token latency without images and the image
    requests' TTFT are columns beside the usual ones, and a line says what was sent."""
    pytest.importorskip("matplotlib")

    def level(c: int, itl99: float, alone99: float) -> dict:
        numbers = {"ttft_ms_p50": 80.0, "ttft_ms_p99": 90.0, "itl_ms_p50": 5.0, "request_decode_tok_s_median": 190.0}
        return {
            "concurrency": c,
            "requests": 2 * c,
            "aggregate_tok_s": 180.0 * c,
            "itl_ms_p99": itl99,
            **numbers,
            "without_images": {**numbers, "itl_ms_p50": 4.5, "itl_ms_p99": alone99},
            "image_requests": 7,
            "image_ttft_ms_p50": 160.0,
            "image_ttft_ms_p99": 210.5,
        }

    run = {
        "gpu": "Sample GPU",
        "date": "2026-12-03T11:00:00+00:00",
        "command": "thorgen bench serve --concurrency 1,8 --image img.png --image-max-tokens 1120 --image-arrivals",
        "prompt_len": 512,
        "gen": 256,
        "levels": [level(1, 9.5, 5.5), level(8, 12.25, 6.0)],
        "image": {"file": "img.png", "width": 1280, "height": 720, "budget": 1120, "same_image": False},
    }
    run["image"]["arrivals"] = True
    folder = _sample_folder(tmp_path, "<!-- report serve sample-serve.json -->\n", {"sample-serve.json": run})
    text, written = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    assert "| inter-token p50 / p99 | inter-token p50 / p99 without images | image arrivals: TTFT p50 / p99 |" in text
    assert "| 5.00 / 12.25 ms | 4.50 / 6.00 ms | 7: 160.0 / 210.5 ms |" in text
    assert "one-token chats of img.png 1280x720 (budget 1120, a fresh variant each) back to back" in text
    assert len(written) == 1 and _png_size(written[0])[0] > 300


@pytest.mark.parametrize(
    "content, says",
    [
        ('{"rows": [', "not a readable JSON file"),
        ("[1, 2]", "expected a JSON object"),
        ('{"levels": [{"concurrency": 1}]}', "missing key"),  # a serve run without its numbers
        (json.dumps(_suite_without_plain()), "cannot draw the suite view (missing key 'plain')"),
        ('{"prompts": [3]}', "cannot draw the suite view (TypeError"),
    ],
)
def test_bad_run_names_the_file(tmp_path, content, says):
    pytest.importorskip("matplotlib")  # the runs before the broken one are drawn
    folder = _copy_bench(tmp_path)
    (folder / "broken-run.json").write_text(content)
    result = _report(folder)
    assert result.exit_code != 0
    assert "broken-run.json" in result.output and says in result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (KeyError, TypeError))


def test_bad_notes_line_names_the_line(tmp_path):
    folder = _copy_bench(tmp_path)
    notes = folder / "NOTES.md"
    notes.write_text(notes.read_text() + "\n<!-- report sweep no-such-run.json -->\n<!-- report nope x.json -->\n")
    result = _report(folder)
    assert result.exit_code != 0 and "NOTES.md:" in result.output and "no-such-run.json" in result.output
    notes.write_text("<!-- report nope h200-kernels-bandwidth.json -->\n")
    result = _report(folder)
    assert result.exit_code != 0 and "unknown view 'nope'" in result.output


SAMPLE_SERVE = {  # a sample `thorgen bench serve` run; like the real ones it records no machine
    "date": "2026-12-03T12:00:00+00:00",
    "command": "thorgen bench serve --concurrency 1,32",
    "prompt_len": 512,
    "gen": 256,
    "engine_tok_s": 400.0,
    "levels": [
        {
            "concurrency": c,
            "requests": 2 * c,
            "aggregate_tok_s": a,
            "request_decode_tok_s_median": r,
            "ttft_ms_p50": t,
            "ttft_ms_p99": 3 * t,
            "itl_ms_p50": 2.5,
            "itl_ms_p99": 9.0,
        }
        for c, a, r, t in ((1, 390.0, 390.0, 20.0), (32, 3050.5, 95.0, 61.25), (64, 3100.0, 48.0, 900.0))
    ],
}


def _sample_spec() -> dict:
    return dict(
        _sample_bench(None, 496.0, 19.0),
        fraction_of_copy=0.25,
        speculative={
            "emulated_acceptance": 6,
            "tau": 6.9,
            "spec_tok_s": 1487.125,
            "step_ms": 4.7,
            "draft_step_ms": 0.62,
            "verify_step_ms": 3.99,
        },
    )


def test_summary_view(tmp_path):
    """The summary takes each run's role from its shape, cites every run with its machine, date, commit and command
    (the commit and the serve run's machine from NOTES.md's run lines), and labels the peer measured in the same run."""
    pytest.importorskip("matplotlib")
    ttft = dict(_sample_bench(None, 450.0, 68.75), prompt_len=2048, peak_gpu_mem_gib=18.94, ctx=65536, kv_dtype="bf16")
    notes = (
        '<!-- run spec.json commit=abc1234 -->\n<!-- run serve.json commit=def5678 machine="Sample GPU 2" -->\n'
        "# Benchmarks\n\n<!-- report summary spec.json ttft.json serve.json peer.json -->\n"
    )
    folder = _sample_folder(
        tmp_path,
        notes,
        {
            "spec.json": _sample_spec(),
            "ttft.json": ttft,
            "serve.json": SAMPLE_SERVE,
            "peer.json": _sample_bench(SAMPLE_PEER, 400.0, 125.0),
        },
    )
    text, written = build_report(folder, folder / "NOTES.md", tmp_path / "BENCHMARKS.md", folder / "plots")
    assert "<!-- run" not in text and "## Other runs" not in text
    assert "| measure | thorgen | peer measured in the same run | run |" in text
    assert "| batch-1 decode | **496.0 tok/s** (2.500 ms a step, 25.0% of the copy bandwidth) |  | [1] |" in text
    assert (
        "| speculative decode (DFlash), **emulated** 6 drafts accepted a step | **1,487.1 tok/s** (tau 6.90) |  | [1] |"
    ) in text
    assert "| draft + verify step | **4.61 ms** (0.620 + 3.990) |  | [1] |" in text
    assert "| TTFT, 2,048-token prompt | **68.8 ms** |  | [2] |" in text
    assert "| peak GPU memory | **18.9 GiB** (context 65,536, KV bf16) |  | [2] |" in text
    assert (
        "| aggregate tok/s through HTTP by concurrency (512 in, 256 out) | 1: 390, 32: 3,050, 64: 3,100 |  | [3] |"
        in text
    )
    assert "| TTFT p50 / p99 at concurrency 32 | 61.2 / 184 ms |  | [3] |" in text  # 32 over the last level
    assert (
        "| batch-1 decode and TTFT (512-token prompt) against a peer | 400.0 tok/s, TTFT 125.0 ms | 93.0 tok/s, "
        "TTFT 412.3 ms: hf transformers 5.17.0 Gemma4ForCausalLM (bfloat16, torch.compile, static cache), same GPU "
        "and prompt | [4] |"
    ) in text
    assert (
        "- [1] `docs/benchmarks/spec.json`: Sample GPU, 2026-12-03, commit abc1234: `thorgen bench --prompt-len 512`"
        in text
    )
    assert "- [2] `docs/benchmarks/ttft.json`: Sample GPU, 2026-12-03: `thorgen bench --prompt-len 512`" in text
    assert (
        "- [3] `docs/benchmarks/serve.json`: Sample GPU 2, 2026-12-03, commit def5678: "
        "`thorgen bench serve --concurrency 1,32`"
    ) in text
    assert sorted(p.name for p in written) == ["serve-serve.png"]  # the sample spec run has no kernel table
    assert json.loads((folder / "serve.json").read_text()) == SAMPLE_SERVE  # the JSON is left as measured


@pytest.mark.parametrize(
    "notes, says",
    [
        ("<!-- report summary spec.json spec2.json -->\n", "spec2.json is not a run the summary has a row for"),
        ("<!-- report summary plain.json -->\n", "plain.json is not a run the summary has a row for"),
        ("<!-- run spec.json branch=x -->\n", "expected key=value with a key in commit, machine, found 'branch'"),
        ("<!-- run spec.json machine=Other -->\n", "spec.json records its machine already"),
        ("<!-- run gone.json commit=abc1234 -->\n", "no such run gone.json"),
    ],
)
def test_summary_and_run_lines_name_what_is_wrong(tmp_path, notes, says):
    folder = _sample_folder(
        tmp_path,
        notes,
        {"spec.json": _sample_spec(), "spec2.json": _sample_spec(), "plain.json": _sample_bench(None, 390.0, 120.0)},
    )
    result = _report(folder)
    assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output
