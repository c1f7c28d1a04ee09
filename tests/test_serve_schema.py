"""Serve stage tests: schemathesis fuzzes every operation of /openapi.json over real HTTP (uvicorn on loopback),
with valid and invalid input: no answer is a 5xx, and the answers conform to the documented schema."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
requests = pytest.importorskip("requests")

from thorgen.runtime.text.tokenizer import Tokenizer  # noqa: E402
from thorgen.serve.app import create_app  # noqa: E402
from thorgen.serve.chat_template import ChatTemplate  # noqa: E402
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer  # noqa: E402

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
Q = '<|"|>'
EXAMPLES = 60  # per operation and generation mode (12 operations: 720 cases, as 9 x 80 before; GETs yield few)
# wall-clock cap for all requests; past it, remaining examples are skipped (and the test fails). On the 2-core CI
# machine (2026-12-02) the fuzzing took 37 s alone but ran past 50 s twice inside the whole suite
BUDGET_S = 100
# Schemathesis checks we do not run, and why. Everything else (not_a_server_error, status_code_conformance,
# content_type_conformance, response_schema_conformance, negative_data_rejection, unsupported_method, ...) must
# pass on every case.
ALLOWED = {
    "positive_data_acceptance": "schemathesis's own check would fail any refusal of a schema-valid request; the "
    "document states every limit JSON Schema can (serve/schema_limits.py), and the test below fails a refusal of a "
    "schema-valid request unless INEXPRESSIBLE names it",
}
# The refusals of schema-valid requests that no JSON Schema can state, by their message: each the reason why.
INEXPRESSIBLE = {
    r"exceeds the context of": "the prompt's length and max_tokens together",
    r"a 'tool' message must follow": "the conversation's order",
    r"messages must not be empty": "a conversation left empty once dropped blocks are gone",
    r"final assistant message|cannot be combined": "fields that exclude one another for some values only",
    r"image|video|base64|data URL|media type": "an image's or a video's bytes, and which URLs the server fetches",
    r"not valid JSON": "JSON inside a string",
    r"on the scripted backend|needs grammar-constrained decoding": "the test engine's own limits",
    r"give one guided-decoding constraint": "several constraints, each optional",
    r"choices; at most": "prompts times n",
    r"min_tokens \d+ exceeds max_tokens": "two fields compared",
    r"prompt_logprobs": "prompt_logprobs with stream or echo",
    r"tool_choice|declared twice": "tool_choice against the tools declared",
    r"parameters|input_schema|tool parameters": "a tool's own JSON schema",
    r"budget_tokens": "thinking's budget against max_tokens",
    r"logit_bias": "logit_bias keys (token ids as strings)",
    r"must be a (Lark grammar|non-empty regular expression)|is invalid or unsupported": "grammar text",
}


def test_schemathesis_over_http(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import CHECKS, load_all_checks
    from schemathesis.generation import GenerationMode

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    # a reply with reasoning and a tool call, so accepted requests exercise the whole output path
    out = tok.encode(f"<|channel>thought\nhm<channel|>ok <|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>")
    engine = ScriptedBackend(lambda prompt: out, max_context=4096, chunk=4)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    # explicit: without `checks=`, call_and_validate runs only the few enabled by default (not_a_server_error)
    load_all_checks()
    run = [check for check in CHECKS.get_all() if check.__name__ not in ALLOWED]
    assert len(run) >= 10 and {"status_code_conformance", "negative_data_rejection"} <= {c.__name__ for c in run}
    with running_server(create_app(state)) as url, requests.Session() as session:
        schema = schemathesis.openapi.from_url(url + "/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {
            "/v1/chat/completions",
            "/v1/completions",
            "/tokenize",
            "/detokenize",
            "/v1/models/{model_id}",
            "/v1/messages",
            "/v1/messages/count_tokens",
            "/v1/responses",
        }
        deadline = time.monotonic() + BUDGET_S
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(
                    max_examples=EXAMPLES,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    suppress_health_check=list(HealthCheck),
                )
                @given(case=op.as_strategy(generation_mode=mode))
                def call(case) -> None:
                    if time.monotonic() > deadline:
                        return
                    # a failed check raises (and hypothesis reports the smallest such case)
                    response = case.call_and_validate(session=session, checks=run)
                    statuses[response.status_code] += 1
                    if mode == GenerationMode.POSITIVE and 400 <= response.status_code < 500:
                        body = response.json()
                        error = body.get("error")
                        message = error.get("message", "") if isinstance(error, dict) else str(body)
                        if not any(re.search(pattern, message) for pattern in INEXPRESSIBLE):
                            failures.append(
                                f"schema-valid request rejected: {case.method} {case.path} {case.body!r:.200} -> "
                                f"{response.status_code} {message:.300}"
                            )

                try:
                    call()
                except hypothesis.errors.Unsatisfiable:  # no invalid input exists (GET without parameters)
                    assert mode == GenerationMode.NEGATIVE
        assert time.monotonic() <= deadline, "the fuzzing ran past its time budget"
    total = sum(statuses.values())
    print(f"\nschemathesis: {total} requests, statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures)
    assert total >= 200
    assert statuses[200] > 30  # the fuzzing reached generation, not only validation errors
    assert not any(status >= 500 for status in statuses)
    assert state.client.ready


def test_the_document_states_the_servers_own_limits(tmp_path):
    """The served model names, the vocabulary's bound on token ids, speculation a scripted engine cannot run, and
    the limits of serve/schema_limits.py, as /openapi.json says them."""
    import httpx

    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda prompt: tok.encode("ok"), max_context=4096)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url:
        doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    names = list(state.model_names)
    for request in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest"):
        model = schemas[request]["properties"]["model"]
        assert names in [b.get("enum") for b in [model, *model.get("anyOf", [])]], request
    [param] = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert param["schema"]["enum"] == names
    token = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token["minimum"] == 0 and token["maximum"] == state.caps.vocab_size - 1
    assert "x-thorgen-token-id" not in json.dumps(doc)
    spec = schemas["ChatCompletionRequest"]["properties"]["num_speculative_tokens"]["anyOf"][0]
    assert spec["maximum"] == 0  # (the scripted engine has no drafter)
    assert schemas["ChatCompletionRequest"]["properties"]["n"]["maximum"] == 16
    assert "oneOf" in schemas["TokenizeRequest"] and "if" in schemas["Message"]
