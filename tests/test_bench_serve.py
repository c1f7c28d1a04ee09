"""Serve stage tests: `thorgen bench serve` against a scripted server: every level is reported, tokens come from
the usage, latencies are positive and ordered, and a server error stops the run with a clear message."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")

from click.testing import CliRunner  # noqa: E402

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.runtime.bench.serve_cli import bench_serve  # noqa: E402
from thorgen.runtime.bench.serve_load import percentile  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(1, 101)), 99) == 99
    assert percentile([5.0], 99) == 5.0


def test_bench_serve_levels(tmp_path):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda p: tok.encode("abcdefghijklmnopqrstuvwxyz" * 4), delay=0.002)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    out = tmp_path / "report.json"
    with running_server(create_app(state)) as url:
        r = CliRunner().invoke(
            bench_serve,
            [
                "--url",
                url,
                "--concurrency",
                "1,2",
                "--prompt-len",
                "40",
                "--gen",
                "12",
                "--requests",
                "2",
                "--engine-tok-s",
                "500",
                "--out",
                str(out),
            ],
        )
        assert r.exit_code == 0, r.output
        bad = CliRunner().invoke(bench_serve, ["--url", url, "--concurrency", "1", "--prompt-len", "5000"])
        assert bad.exit_code != 0 and "400" in bad.output  # the prompt exceeds the scripted context
    report = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["requests"] == 2 * lv["concurrency"] and lv["completion_tokens"] == 12 * lv["requests"]
        assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and 0 < lv["itl_ms_p50"] <= lv["itl_ms_p99"]
        assert len(lv["ttft_ms_by_send"]) == lv["requests"] and min(lv["ttft_ms_by_send"]) > 0
        largest = lv["itl_ms_largest"]  # (2 x 11 gaps a stream)
        assert len(largest) == min(24, 22 * lv["concurrency"]) and largest == sorted(largest, reverse=True)
        assert largest[0] >= lv["itl_ms_p99"] >= largest[-1] > 0
        assert lv["aggregate_tok_s"] > 0
        # the engine thread's own account of the level (from /health): every step sleeps `delay` somewhere
        steps = lv["engine_steps"]
        assert steps["steps"] >= 12 and 0 < steps["mean_running"] <= lv["concurrency"]
        assert min(steps[f"{p}_ms"] for p in ("prepare", "flush", "finish")) >= 0
        assert sum(steps[f"{p}_ms"] for p in ("prepare", "flush", "finish")) >= 0.9 * 2.0
        # the server's own account of each request (from /metrics): its handler to the engine, then a first token
        # that takes at least one scripted step
        assert lv["server"]["to_engine_ms"] > 0 and lv["server"]["ttft_ms"] >= 0.9 * 2.0
        assert lv["server"]["to_engine_ms"] + lv["server"]["ttft_ms"] < lv["ttft_ms_p99"]
    assert "engine:" in r.output and "prepare" in r.output and "server: to the engine" in r.output
    assert len(engine.calls[-1]["prompt"]) == 40 and report["server_over_engine"] > 0
    assert CliRunner().invoke(bench_serve, ["--url", "http://127.0.0.1:9", "--concurrency", "1"]).exit_code != 0
    state.close()


def test_bench_serve_suite(tmp_path):
    """--suite runs every prompt alone through chat (messages or the needle recipe); an entry the server
    refuses is reported, not fatal."""
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda p: tok.encode("one two three four five six"), max_context=3000)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    suite = {
        "prompts": [
            {"id": "a", "category": "short_factual", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            {
                "id": "n",
                "category": "long_context",
                "_build": "needle",
                "needle": "The code is 7.",
                "question": "What is the code?",
                "filler_repeats": 2,
                "max_tokens": 3,
            },
            {
                "id": "big",
                "category": "long_context",
                "_build": "needle",
                "needle": "x",
                "question": "y",
                "filler_repeats": 50,
                "max_tokens": 3,
            },
        ]
    }
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    out = tmp_path / "r.json"
    with running_server(create_app(state)) as url:
        r = CliRunner().invoke(
            bench_serve,
            [
                "--url",
                url,
                "--concurrency",
                "1",
                "--prompt-len",
                "8",
                "--gen",
                "4",
                "--requests",
                "1",
                "--suite",
                str(tmp_path / "suite.json"),
                "--out",
                str(out),
            ],
        )
    assert r.exit_code == 0, r.output
    rows = {row["id"]: row for row in json.loads(out.read_text())["suite"]}
    assert rows["a"]["completion_tokens"] == 4 and rows["a"]["ttft_ms"] > 0
    assert rows["n"]["completion_tokens"] == 3 and "The code is 7." in tok.decode(engine.calls[-1]["prompt"])
    assert "context" in rows["big"]["error"]  # 50 filler repeats exceed the 3000-token context
    state.close()


def _photo(path: Path, size=(48, 64)) -> Path:
    from PIL import Image

    Image.fromarray(np.random.default_rng(3).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path


def test_image_variants_differ_for_every_cache():
    """Each request's variant has its own bytes and its own patches (so its own content hash): neither the
    server's image caches nor its prefix cache can answer for it."""
    from PIL import Image

    from thorgen.model_spec.presets import get_preset
    from thorgen.runtime.bench.serve_images import variant
    from thorgen.runtime.media.images import load_image

    rgb = np.random.default_rng(4).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    original = rgb.copy()
    made = [variant(rgb, n, "PNG") for n in (0, 1, 255, 256)]
    vision = get_preset("tiny").vision
    assert len(set(made)) == 4 and len({load_image(v, vision, 70).hash for v in made}) == 4
    assert Image.open(io.BytesIO(made[0])).size == (60, 40) and np.array_equal(rgb, original)
    with pytest.raises(ValueError, match="too small"):
        variant(np.zeros((2, 2, 3), np.uint8), 70_000, "PNG")  # three blocks on two pixels


def test_bench_serve_image_chats_and_arrivals(tiny_checkpoint, tmp_path):
    """--image: every level's requests are chats of a fresh variant of the image (the server decodes each one);
    --image-arrivals: text streams run alone, then beside one-token image chats, and the row holds both."""
    from thorgen.serve.media import MediaOptions
    from tiny_server import tiny_server

    photo, out, arrivals_out = _photo(tmp_path / "p.png"), tmp_path / "img.json", tmp_path / "arrivals.json"
    common = ["--concurrency", "1,2", "--prompt-len", "12", "--gen", "3", "--requests", "1", "--ignore-eos"]
    common += ["--image", str(photo)]
    with tiny_server(tiny_checkpoint, 1024, media=MediaOptions(budget=70)) as (url, state):
        loader = state.context.images
        r = CliRunner().invoke(bench_serve, ["--url", url, *common, "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert loader.decoded == 1 + 1 + 2  # the warm-up, then one variant per request: no cache answered
        a = CliRunner().invoke(
            bench_serve,
            ["--url", url, *common, "--image-arrivals", "--image-max-tokens", "140", "--out", str(arrivals_out)],
        )
        assert a.exit_code == 0, a.output
        bad = CliRunner().invoke(bench_serve, ["--url", url, "--same-image"])
        assert bad.exit_code == 2 and "go with --image" in bad.output
    report = json.loads(out.read_text())
    assert report["image"]["file"] == "p.png" and (report["image"]["width"], report["image"]["height"]) == (64, 48)
    assert "--image " in report["command"] and [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        assert lv["requests"] == lv["concurrency"] and lv["completion_tokens"] == 3 * lv["requests"]
        assert 0 < lv["ttft_ms_p50"] <= lv["ttft_ms_p99"] and lv["prompt_tokens_mean"] > 12 + 60
        assert lv["server"]["to_engine_ms"] > 0  # (each request's image decoded and preprocessed in it)
    report = json.loads(arrivals_out.read_text())
    assert report["image"]["arrivals"] and report["image"]["budget"] == 140 and "--image-arrivals" in report["command"]
    for lv in report["levels"]:
        assert lv["image_requests"] >= 1 and 0 < lv["image_ttft_ms_p50"] <= lv["image_ttft_ms_p99"]
        assert lv["itl_ms_p99"] > 0 and lv["without_images"]["itl_ms_p99"] > 0
        assert lv["without_images"]["requests"] == lv["requests"] and "image_requests" not in lv["without_images"]
        assert lv["prompt_tokens_mean"] < 20  # the streams measured are the text ones
    assert "image arrivals" in a.output and "without them ITL" in a.output


def test_bench_serve_tools_reports_speculation_per_level(tiny_checkpoint, tmp_path):
    """--tools: every request is an agent's chat with three tools (tool_choice auto); against a speculative server
    each level's row carries its verify steps and drafted / accepted tokens, from /health's counters."""
    from thorgen.runtime.bench.serve_tools import TOOLS
    from tiny_server import tiny_server

    out = tmp_path / "tools.json"
    args = ["--concurrency", "1,2", "--prompt-len", "24", "--gen", "24", "--requests", "1", "--ignore-eos"]
    with tiny_server(tiny_checkpoint, 2048, speculative=None) as (url, state):
        r = CliRunner().invoke(bench_serve, ["--url", url, *args, "--tools", "--out", str(out)])
        assert r.exit_code == 0, r.output
        bad = CliRunner().invoke(bench_serve, ["--url", url, "--tools", "--image", str(_photo(tmp_path / "p.png"))])
        assert bad.exit_code == 2 and "--tools" in bad.output
    report = json.loads(out.read_text())
    assert "--tools" in report["command"] and len(TOOLS) == 3
    for lv in report["levels"]:
        assert lv["completion_tokens"] == 24 * lv["requests"]
        assert lv["prompt_tokens_mean"] > 200  # the system prompt and the tools' schemas, rendered
        steps = lv["engine_steps"]
        assert steps["speculative_steps"] > 0 and steps["draft_tokens"] >= steps["speculative_steps"]
        assert 0 <= steps["accepted_tokens"] <= steps["draft_tokens"]
        assert steps["acceptance_rate"] == round(steps["accepted_tokens"] / steps["draft_tokens"], 4)
    assert "verify steps" in r.output


def test_bench_serve_reports_emulated_acceptance(tiny_checkpoint, tmp_path):
    """`serve --emulate-acceptance K` (DraftOptions.emulate_acceptance): every verify step commits K drafts + 1, so
    the tiny model's random drafter, which otherwise never lands, shows accepted drafts; /health carries K and the
    bench report and its text mark the level emulated. K past the drafter's block is refused when the engine opens."""
    from thorgen.runtime.api import DraftOptions, EngineConfig, open_backend
    from thorgen.runtime.backend import BackendError
    from tiny_server import tiny_server

    out = tmp_path / "emulated.json"
    args = ["--concurrency", "1", "--prompt-len", "24", "--gen", "40", "--requests", "2", "--ignore-eos"]
    with tiny_server(tiny_checkpoint, 2048, speculative=None, drafts=DraftOptions(emulate_acceptance=3)) as (url, _):
        r = CliRunner().invoke(bench_serve, ["--url", url, *args, "--out", str(out)])
        assert r.exit_code == 0, r.output
    steps = json.loads(out.read_text())["levels"][0]["engine_steps"]
    assert steps["emulated_acceptance"] == 3 and steps["speculative_steps"] > 0
    # every verify step that drafted 3 or more committed exactly 3 of them (fewer only where the step drafted fewer)
    assert steps["accepted_tokens"] <= 3 * steps["speculative_steps"]
    assert steps["accepted_tokens"] >= 3 * (steps["speculative_steps"] - 2 * 2)  # (two requests' last steps)
    assert "EMULATED" in r.output
    block = 16
    with pytest.raises(BackendError, match="emulated acceptance"):
        open_backend(EngineConfig(tiny_checkpoint, "reference", 512, drafts=DraftOptions(emulate_acceptance=block)))
