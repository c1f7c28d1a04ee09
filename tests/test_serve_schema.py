"""Serve stage tests: schemathesis fuzzes every endpoint of /openapi.json (>= 500 requests) and no answer is a 5xx."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

from thorgen.runtime.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from thorgen.serve.scripted import ScriptedBackend, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
Q = '<|"|>'
EXAMPLES = 100  # per operation and generation mode (8 operations; GETs without input yield few cases)


def test_schemathesis_no_server_errors(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from schemathesis.generation import GenerationMode

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    # a reply with reasoning and a tool call, so accepted requests exercise the whole output path
    out = tok.encode(f"<|channel>thought\nhm<channel|>ok <|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>")
    engine = ScriptedBackend(lambda prompt: out, max_context=4096, chunk=4)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(state))
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def call(case) -> None:
                response = case.call()
                statuses[response.status_code] += 1
                if response.status_code >= 500 and len(failures) < 5:
                    failures.append(f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code} "
                                    f"{response.text[:300]}")
            try:
                call()
            except hypothesis.errors.Unsatisfiable:  # no invalid input exists (GET without parameters)
                assert mode == GenerationMode.NEGATIVE
    total = sum(statuses.values())
    print(f"\nschemathesis: {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures)
    assert total >= 500
    assert statuses[200] > 50  # the fuzzing reached generation, not only validation errors
    assert state.client.ready
