"""What the server keeps per request: after the soak's mix of requests (chat, streams, tools, Anthropic Messages,
Responses, aborts mid-stream, hostile bodies) against the real serve layer and engine core (the scripted engine),
no object of the package outlives its request: the live count of every thorgen type returns to what it was, and
the core's, the scheduler's and the client's per-request records are empty."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402
from thorgen.runtime.bench.soak_requests import Settings, build, send  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
# the soak's kinds the scripted engine serves (no logits: no forced tools, JSON schemas or images)
KINDS = ("chat", "stream", "tools_auto", "messages", "messages_stream", "responses", "responses_stream", "abort")
KINDS += ("hostile",)
OUTCOME = "thorgen.runtime.bench.soak_requests.Outcome"  # (this test's own record of each answer)


def _live_thorgen_objects() -> Counter[str]:
    """Live objects by type, for the package's own types."""
    gc.collect()
    return Counter(
        f"{type(o).__module__}.{type(o).__qualname__}"
        for o in gc.get_objects()
        if str(getattr(type(o), "__module__", "")).startswith("thorgen.")
    )


def _send_all(url: str, rng: random.Random, n: int) -> list:
    async def run() -> list:
        settings = Settings("scripted-test-engine", 4096, 24)
        slots = asyncio.Semaphore(4)
        async with httpx.AsyncClient(timeout=60) as http:

            async def one(kind: str):
                async with slots:
                    return await send(http, url, build(kind, rng, settings), time.perf_counter(), {})

            return await asyncio.gather(*(one(KINDS[i % len(KINDS)]) for i in range(n)))

    return asyncio.run(run())


def test_no_object_outlives_its_request(tmp_path):
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda prompt: tok.encode("a reply that streams out over several steps"), chunk=2)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    rng = random.Random(0)
    try:
        with running_server(create_app(state)) as url:
            _send_all(url, rng, 2 * len(KINDS))  # (every path once first: lazy imports, compiled templates)
            time.sleep(0.5)  # (an abort's cancellation reaches the core at its next step)
            engine.calls.clear()  # (the scripted engine's record of each request, kept for other tests)
            before = _live_thorgen_objects()
            outcomes = _send_all(url, rng, 6 * len(KINDS))
            time.sleep(0.5)
            engine.calls.clear()
            after = _live_thorgen_objects() - Counter({OUTCOME: len(outcomes)})
            core = state.client.core  # (the client's engine thread is idle: nothing is running)
            assert not core._seqs and not core.scheduler.running and not core.scheduler.waiting
            assert not state.client._live
    finally:
        state.close()
    assert sum(o.aborted for o in outcomes) >= 6 and all(o.status is not None for o in outcomes)
    grew = {name: (before[name], count) for name, count in after.items() if count > before[name]}
    assert not grew, f"live objects (before, after) of types that grew over {len(outcomes)} requests: {grew}"
