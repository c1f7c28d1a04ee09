"""`thorgen bench soak`: against the real server (scripted engine) every stream ends with its API's final event and
every hostile body gets a 4xx, so a short soak passes; against a broken server (streams cut off, 500s, an error
event, a hostile body accepted) it counts each failure and exits 1, so it cannot pass silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from fastapi import FastAPI, Request  # noqa: E402  (module level: the routes' annotations resolve here)
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402
from thorgen.runtime.bench.soak import bench_soak, parse_mix  # noqa: E402
from thorgen.runtime.engine.kv_pages import PagePool  # noqa: E402
from thorgen.runtime.bench.soak_requests import (  # noqa: E402
    IMAGE_POOL,
    KINDS,
    Settings,
    build,
    hostile_cases,
    png_data_url,
    warmup,
)

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
# what the scripted engine serves (it has no logits: no grammars, so no forced tools or JSON schemas; no vision)
SCRIPTED_MIX = (
    "chat=1,stream=2,tools_auto=1,messages=1,messages_stream=1,responses=1,responses_stream=1,abort=1,hostile=1"
)


def _soak(url: str, tmp_path: Path, mix: str, *extra: str):
    out = tmp_path / "soak.json"
    args = ["--url", url, "--duration", "2", "--concurrency", "3", "--windows", "2", "--mix", mix, "--out", str(out)]
    result = CliRunner().invoke(bench_soak, [*args, *extra])
    return result, json.loads(out.read_text()) if out.exists() else None


def test_soak_passes_against_the_server(tmp_path):
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda prompt: tok.encode("a short reply that streams"), delay=0.002, chunk=2)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    try:
        with running_server(create_app(state)) as url:
            result, report = _soak(url, tmp_path, SCRIPTED_MIX)
    finally:
        state.close()
    assert result.exit_code == 0, result.output
    assert report["passed"] and not any(report["failures"].values()), report["failure_examples"]
    assert set(report["kinds"]) == set(parse_mix(SCRIPTED_MIX))
    for kind, row in report["kinds"].items():
        assert row["sent"] >= 1 and row["none"] == row["5xx"] == 0, (kind, row)
        assert row["2xx" if kind != "hostile" else "4xx"] == row["sent"], (kind, row)
    assert report["kinds"]["abort"]["aborted"] >= 1
    assert report["kinds"]["stream"]["ttft_ms_p50"] is not None and report["windows"][0]["itl_ms_p50"] is not None
    assert report["warmup_requests"] == len(parse_mix(SCRIPTED_MIX)) - 1 + len(hostile_cases(Settings("m", 1)))
    assert report["memory"]["rss_start"] is not None  # the server's /metrics (in this process)
    # /health's caches: no images here, and no page registered (the scripted runner caches no prefix)
    assert report["memory"]["cache_start"] == PagePool(1).index_bytes
    assert report["memory"]["rss_less_caches_start"] == report["memory"]["rss_start"] - PagePool(1).index_bytes
    assert report["memory"]["gpu_memory_start"] is None  # (no device)
    assert "passed" in result.output and "failures: none" in result.output


def _broken_app():
    """A server that cuts chat streams short (no [DONE]), answers whole chats with a 500, ends Responses streams
    with an error event, ends Messages streams without message_stop, and accepts any body, hostile ones too."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "fake", "max_model_len": 256}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("process_resident_memory_bytes 1000\n")

    def sse(*events: str) -> StreamingResponse:
        return StreamingResponse(iter(events), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError):
            return {"choices": []}  # a hostile body accepted
        if isinstance(body, dict) and body.get("stream"):
            chunk = json.dumps({"choices": [{"index": 0, "delta": {"content": "cut"}}]})
            return sse(f"data: {chunk}\n\n", f"data: {chunk}\n\n", f"data: {chunk}\n\n")
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)

    @app.post("/v1/messages")
    async def messages(request: Request):
        delta = json.dumps({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}})
        return sse(f"event: content_block_delta\ndata: {delta}\n\n")

    @app.post("/v1/responses")
    async def responses(request: Request):
        delta = json.dumps({"type": "response.output_text.delta", "delta": "x"})
        error = json.dumps({"type": "error", "message": "the engine failed"})
        return sse(f"event: response.output_text.delta\ndata: {delta}\n\n", f"event: error\ndata: {error}\n\n")

    return app


def test_soak_fails_on_cut_streams_5xx_error_events_and_accepted_hostile_bodies(tmp_path):
    with running_server(_broken_app()) as url:
        result, report = _soak(url, tmp_path, "chat=1,stream=1,messages_stream=1,responses_stream=1,hostile=1")
    assert result.exit_code == 1, result.output
    failures = report["failures"]
    assert not report["passed"]
    assert failures["5xx"] >= 1 and failures["truncated"] >= 2 and failures["stream_errors"] >= 1
    assert failures["hostile_accepted"] >= 1
    assert report["kinds"]["stream"]["truncated"] == report["kinds"]["stream"]["sent"]
    assert report["kinds"]["messages_stream"]["truncated"] == report["kinds"]["messages_stream"]["sent"]
    assert report["memory"]["rss_source"] == "/metrics" and report["memory"]["rss_start"] == 1000
    assert "FAILED" in result.output and "streams that ended without their final event" in result.output


def test_every_kind_builds_and_the_hostile_cases_are_what_they_say():
    import random

    s = Settings("m", 2048)
    rng = random.Random(0)
    for kind in KINDS:
        req = build(kind, rng, s)
        assert req.path.startswith("/v1/") and (req.hostile is not None) == (kind == "hostile")
    names = [name for name, _, _ in hostile_cases(s)]
    assert len(names) == len(set(names)) >= 20
    bodies = dict((name, body) for name, _, body in hostile_cases(s))
    with pytest.raises(ValueError):
        json.loads(bodies["malformed_json"])
    assert len(json.dumps(bodies["body_over_the_limit"])) > 8 << 20  # over the server's default --max-body-mb
    assert png_data_url().startswith("data:image/png;base64,iVBORw0KGgo")  # the PNG signature
    with pytest.raises(Exception, match="unknown kind"):
        parse_mix("chat=1,teleport=2")


def _image_url(req) -> str:
    return req.body["messages"][0]["content"][0]["image_url"]["url"]


def test_the_warm_up_sends_every_distinct_payload_the_soak_sends():
    import random

    s = Settings("m", 2048)
    sent = warmup(list(KINDS), random.Random(0), s)
    assert {r.kind for r in sent} == set(KINDS)
    images = {_image_url(r) for r in sent if r.kind == "image"}
    assert len(images) == sum(r.kind == "image" for r in sent) == IMAGE_POOL  # each image once
    assert len({_image_url(r) for r in warmup(["image"], random.Random(0), Settings("m", 2048, images=3))}) == 3
    assert {r.hostile for r in sent if r.kind == "hostile"} == {name for name, _, _ in hostile_cases(s)}
    rng = random.Random(1)
    assert {_image_url(build("image", rng, s)) for _ in range(20 * IMAGE_POOL)} == images  # none the warm-up missed


def test_rss_growth_is_measured_less_the_servers_caches():
    from thorgen.runtime.bench.soak_report import drift_failures, memory_row

    # caches filling to their bounds: RSS +50 %, RSS less caches flat
    samples = [{"rss_bytes": 1000, "cache_bytes": 100}, {"rss_bytes": 1500, "cache_bytes": 600}]
    memory = memory_row(samples)
    assert memory["rss_change_pct"] == 50.0 and memory["rss_less_caches_change_pct"] == 0.0
    assert drift_failures(memory, None, {"rss_growth": 5}) == []
    leak = memory_row([samples[0], {"rss_bytes": 1500, "cache_bytes": 100}])  # the same caches, RSS +50 %
    assert leak["rss_less_caches_change_pct"] == pytest.approx(55.556, abs=1e-3)
    assert drift_failures(leak, None, {"rss_growth": 5}) == ["rss_growth"]
    unknown = memory_row([{"rss_bytes": 1000, "cache_bytes": None}, {"rss_bytes": 1100, "cache_bytes": None}])
    assert unknown["rss_less_caches_change_pct"] == 10.0  # (a server without /health's caches: RSS alone)


def test_drift_limits_fail_a_soak_over_them_or_unable_to_measure_them():
    from thorgen.runtime.bench.soak_report import drift_failures

    memory = {"rss_change_pct": 3.0, "gpu_memory_change_pct": -0.5}
    assert drift_failures(memory, 1.2, {"rss_growth": 5, "gpu_memory_change": 1, "ttft_drift": 1.5}) == []
    assert drift_failures(memory, 1.6, {"rss_growth": 2, "ttft_drift": 1.5}) == ["rss_growth", "ttft_drift"]
    assert drift_failures(memory, 1.0, {"gpu_memory_change": 0.4}) == ["gpu_memory_change"]  # |-0.5| > 0.4
    unmeasured = memory | {"gpu_memory_change_pct": None}  # (the reference backend reports no GPU memory)
    assert drift_failures(unmeasured, None, {"gpu_memory_change": 1, "ttft_drift": 2}) == [
        "gpu_memory_change",
        "ttft_drift",
    ]
    assert drift_failures(unmeasured, None, {}) == []


def test_the_report_keeps_the_server_s_and_the_engine_process_s_rss_apart():
    """Samples that measured both processes: the windows, the memory row and the summary show each process's RSS
    beside their sum, so a growing one is named; samples of one process leave the engine's None."""
    from thorgen.runtime.bench.soak_report import memory_row, summarize, text
    from thorgen.runtime.bench.soak_requests import Outcome

    mib = 2**20

    def sample(t: float, server: int, engine: int | None) -> dict:
        both = {"server_rss_bytes": server * mib, "engine_rss_bytes": None if engine is None else engine * mib}
        return {"t": t, "rss_bytes": (server + (engine or 0)) * mib, "cache_bytes": 0, "gpu_memory_bytes": None} | both

    samples = [sample(0.0, 300, 700), sample(1.0, 301, 760), sample(2.0, 302, 800)]
    outcomes = [Outcome("chat", 0.2, status=200, latency=0.1), Outcome("chat", 1.2, status=200, latency=0.1)]
    figures = summarize(outcomes, 0.0, 2.0, 2, samples, {"rss_growth": 5})
    m = figures["memory"]
    assert (m["server_rss_start"], m["server_rss_end"]) == (300 * mib, 302 * mib)
    assert (m["engine_rss_start"], m["engine_rss_end"]) == (700 * mib, 800 * mib)
    assert m["engine_rss_change_pct"] == round(100 * 100 / 700, 3) and m["server_rss_change_pct"] < 1
    assert [w["engine_rss_bytes"] for w in figures["windows"]] == [760 * mib, 800 * mib]
    assert [w["server_rss_bytes"] for w in figures["windows"]] == [301 * mib, 302 * mib]
    assert not figures["passed"] and figures["failures"]["rss_growth"] == 1  # (the sum grew 10 %)
    report = {"requests": 2, "warmup_requests": 0, "duration_s": 2, "concurrency": 1, "url": "u"} | figures
    summary = text(report)
    assert "(server 301.0 MiB + engine 760.0 MiB)" in summary
    assert "server 300.0 MiB -> 302.0 MiB, engine process 700.0 MiB -> 800.0 MiB" in summary
    alone = memory_row([sample(0.0, 300, None), sample(1.0, 310, None)])
    assert alone["engine_rss_start"] is None and alone["server_rss_change_pct"] == round(100 * 10 / 300, 3)
