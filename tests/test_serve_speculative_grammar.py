"""Serve-stage tests: speculative decoding stays on under the grammars the API arms (tools with tool_choice auto,
a forced call, response_format json_schema, guided_regex / guided_choice) and changes nothing: a speculative
server answers each request exactly as a plain one does, greedy and seeded (the tiny model, reference backend)."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("llguidance")

from test_serve_tool_grammar import MSGS, TOOLS  # noqa: E402
from tiny_server import tiny_server  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
BODIES = {
    "tools-auto": {"tools": TOOLS, "tool_choice": "auto"},
    "forced-call": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "json-schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
    "regex": {"guided_regex": r"(sunny|rain|snow), [0-9]{1,2} degrees"},
    "choice": {"guided_choice": ["yes", "no", "maybe later"]},
}


def _drafted(url: str) -> float:
    lines = httpx.get(url + "/metrics").text.splitlines()
    return float(next(ln for ln in lines if ln.startswith("thorgen_draft_tokens_total")).split()[-1])


def _answer(url: str, body: dict) -> tuple:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls") or []]
    return choice["message"].get("content"), calls, choice["finish_reason"], usage["completion_tokens"]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}], ids=["greedy", "seeded"])
def test_speculative_answers_equal_plain_under_grammars(tiny_checkpoint, sampling) -> None:
    with tiny_server(tiny_checkpoint, 1024) as (plain_url, _):
        plain = {
            k: _answer(plain_url, {"model": "tiny", "messages": MSGS, "max_tokens": 60, **sampling, **v})
            for k, v in BODIES.items()
        }
    with tiny_server(tiny_checkpoint, 1024, speculative=None) as (url, _):
        for name, extra in BODIES.items():
            before = _drafted(url)
            got = _answer(url, {"model": "tiny", "messages": MSGS, "max_tokens": 60, **sampling, **extra})
            assert got == plain[name], name
            assert _drafted(url) > before, f"{name}: no draft was verified"
    assert plain["forced-call"][1] and plain["forced-call"][1][0][0] == "get_weather"
