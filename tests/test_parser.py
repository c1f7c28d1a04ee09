"""Serve stage tests: the output parser gives the same final message however the token stream is chunked."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from thorgen.serve.blocks import BlockKind, Blocks
from thorgen.serve.chat_template import control_ids
from thorgen.serve.parser import OutputParser, StopMatcher, ToolSyntaxError, parse_tool_call
from thorgen.runtime.text.tokenizer import Tokenizer
from scripted_backend import write_test_tokenizer

Q = '<|"|>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


# (model output text, expected content, expected reasoning, expected [(name, arguments)])
CORPUS = [
    ("Hello world", "Hello world", "", []),
    ("<|channel>thought\nStep 1. ∑ ü<channel|>The answer<turn|>", "The answer", "Step 1. ∑ ü", []),
    ("<|channel>thought\n<channel|>Plain", "Plain", "", []),
    (
        f"<|tool_call>call:get_weather{{city:{Q}Paris, FR{Q},days:3}}<tool_call|><|tool_response>",
        "",
        "",
        [("get_weather", {"city": "Paris, FR", "days": 3})],
    ),
    (
        f"Let me check.<|tool_call>call:a.b-c{{x:{{y:[1,-2.5,true,false,null,{Q}}}]{Q}]}},z:{Q}日本語 ∑{Q}}}"
        "<tool_call|>"
        f"<|tool_call>call:now{{}}<tool_call|>",
        "Let me check.",
        "",
        [("a.b-c", {"x": {"y": [1, -2.5, True, False, None, "}]"]}, "z": "日本語 ∑"}), ("now", {})],
    ),
    ("<|channel>thought\nneed a tool<|tool_call>call:f{n:1e-05}<tool_call|>", "", "need a tool", [("f", {"n": 1e-05})]),
    (
        f'<|tool_call>call:f{{text:{Q}line1\nline2 {{not json}}{Q},q:{Q}say "hi"{Q}}}<tool_call|>',
        "",
        "",
        [("f", {"text": "line1\nline2 {not json}", "q": 'say "hi"'})],
    ),
    ("<|tool_call>call:broken{a:<tool_call|>after", "<|tool_call>call:broken{a:<tool_call|>after", "", []),
    (f"Cut short <|tool_call>call:f{{a:{Q}unterminated", f"Cut short <|tool_call>call:f{{a:{Q}unterminated", "", []),
    ("<|channel>thought\nstill thinking when max_tokens hit", "", "still thinking when max_tokens hit", []),
    ("emoji 🎉 and bytes \u00e9\u0301 done<eos>", "emoji 🎉 and bytes \u00e9\u0301 done", "", []),
]


KINDS = {BlockKind.REASONING: "reasoning", BlockKind.TEXT: "content", BlockKind.TOOL_CALL: "tool_call"}


def _blocks(events: list) -> list:
    """The events as the blocks every API's answer is made of (adjacent text of one kind merged)."""
    blocks = Blocks()
    for e in events:
        blocks.add(e)
    blocks.close()
    return blocks.closed


def _fold(events: list) -> SimpleNamespace:
    """Events -> the text of each kind and the whole calls (each with id, name and JSON arguments)."""
    blocks = _blocks(events)
    return SimpleNamespace(
        content="".join(b.text for b in blocks if b.kind is BlockKind.TEXT),
        reasoning="".join(b.text for b in blocks if b.kind is BlockKind.REASONING),
        tool_calls=[
            SimpleNamespace(id=b.call_id, name=b.name, arguments=b.text)
            for b in blocks
            if b.kind is BlockKind.TOOL_CALL
        ],
    )


def _run(tok: Tokenizer, ids: list[int], cuts: list[int], **kw) -> tuple[SimpleNamespace, list[list]]:
    """(the whole output folded, the events of each feed and of the finish)."""
    parser = OutputParser(tok.decode, control_ids(tok, frozenset({1, 106, 50})), call_id_prefix="call_t", **kw)
    steps = []
    bounds = [0] + cuts + [len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        steps.append(parser.feed(ids[a:b]))
    steps.append(parser.finish())
    return _fold([e for step in steps for e in step]), steps


def _key(d: SimpleNamespace):
    return d.content, d.reasoning, [(c.id, c.name, c.arguments) for c in d.tool_calls]


@pytest.mark.parametrize("case", range(len(CORPUS)))
def test_every_chunking_gives_the_same_message(tok, case):
    text, content, reasoning, calls = CORPUS[case]
    ids = tok.encode(text)
    whole, _ = _run(tok, ids, [])
    assert whole.content == content
    assert whole.reasoning == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    # every single split point, token by token, and random multi-token steps (speculative decoding)
    for cut in range(1, len(ids)):
        assert _key(_run(tok, ids, [cut])[0]) == _key(whole), cut
    assert _key(_run(tok, ids, list(range(1, len(ids))))[0]) == _key(whole)
    rng = random.Random(case)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(ids)), min(len(ids) - 1, rng.randint(1, 8))))
        assert _key(_run(tok, ids, cuts)[0]) == _key(whole)


def test_streamed_pieces_never_hold_delimiters_or_broken_utf8(tok):
    text, *_ = CORPUS[4]
    _, steps = _run(tok, tok.encode(text), list(range(1, len(tok.encode(text)))))
    for d in map(_fold, steps):
        for piece in (d.content, d.reasoning):
            assert "\ufffd" not in piece and Q not in piece and "<|tool_call>" not in piece
        for call in d.tool_calls:  # each call arrives whole: id, name and complete JSON arguments
            assert call.id and call.name and isinstance(json.loads(call.arguments), dict)


def test_stop_strings_trimmed_across_chunks(tok):
    ids = tok.encode("one two STOP three")
    for cut in range(1, len(ids)):
        total, _ = _run(tok, ids, [cut], stop=["STOP", "zzz"])
        assert total.content == "one two "
    total, _ = _run(tok, tok.encode("no match ST"), [3], stop=["STOP"])
    assert total.content == "no match ST"  # a held-back partial match is released at the end


def test_stop_matcher_earliest_match_wins():
    m = StopMatcher(["bc", "abcd"])  # "abcd" starts at 1, "bc" at 2: the text ends before "abcd"
    assert m.push("xa") + m.push("bcd") == "x" and m.hit


def test_forced_tool_call_prefill(tok):
    """tool_choice named/required: the prompt ends inside `call:NAME{`, the output continues the arguments."""
    ids = tok.encode(f"x:{Q}1{Q}}}<tool_call|>")
    total, _ = _run(tok, ids, [], prefill_tool="call:pick{")
    assert [(c.name, json.loads(c.arguments)) for c in total.tool_calls] == [("pick", {"x": "1"})]


def test_a_call_comes_whole_as_neutral_events(tok):
    """Text and reasoning as deltas; a call as begin, its arguments' JSON, end, once its closing token arrives;
    call ids carry no API's prefix."""
    from thorgen.serve.events import ReasoningDelta, TextDelta, ToolCallArguments, ToolCallBegin, ToolCallEnd

    parser = OutputParser(tok.decode, control_ids(tok, frozenset({1, 106, 50})), call_id_prefix="t")
    ids = tok.encode(f"<|channel>thought\nhm<channel|>Hi<|tool_call>call:f{{a:{Q}x{Q}}}")
    assert parser.feed(ids) == [ReasoningDelta("hm"), TextDelta("Hi")]
    call = [ToolCallBegin("t_0", "f"), ToolCallArguments("t_0", '{"a": "x"}'), ToolCallEnd("t_0")]
    assert parser.feed(tok.encode("<tool_call|>")) == call
    assert parser.finish() == []


def test_tools_off_keeps_text(tok):
    total, _ = _run(tok, tok.encode("<|tool_call>call:f{}<tool_call|>"), [], parse_tools=False)
    assert total.tool_calls == [] and "call:f{}" in total.content


@pytest.mark.parametrize(
    "body", ["f{}", "call:{a:1}", "call:f{a:1", "call:f{a:1}}", "call:f{:1}", f"call:f{{a:{Q}x}}", "call:f[1]"]
)
def test_malformed_calls_rejected(body):
    with pytest.raises(ToolSyntaxError):
        parse_tool_call(body)


def test_invalid_bytes_are_not_held_back_forever(tok):
    """Random weights emit lone UTF-8 continuation bytes; they stream out as U+FFFD instead of piling up."""
    lone = tok.token_to_id("<0x80>")
    parser = OutputParser(tok.decode, control_ids(tok, frozenset({1, 106, 50})))
    streamed = "".join(_fold(parser.feed([lone])).content for _ in range(40))
    assert streamed.count("\ufffd") >= 30
    assert (streamed + _fold(parser.finish()).content).count("\ufffd") == 40


def _events(tok: Tokenizer, ids: list[int], cuts: list[int]) -> list:
    """The ordered events of one run, adjacent text of one kind merged (as a streaming client joins them)."""
    blocks = _blocks([e for step in _run(tok, ids, cuts)[1] for e in step])
    return [
        (
            KINDS[b.kind],
            "" if b.kind is BlockKind.TOOL_CALL else b.text,
            (b.call_id, b.name, b.text) if b.kind is BlockKind.TOOL_CALL else None,
        )
        for b in blocks
    ]


RECORDED = (
    f"<|channel>thought\nPlan: ∑ two calls.<channel|>Calling.<|tool_call>call:f{{a:{Q}x{Q}}}<tool_call|>"
    f" then <|tool_call>call:g{{n:2}}<tool_call|>done 🎉"
)


def test_events_are_the_same_for_every_split(tok):
    """Reasoning, content and several tool calls, in order, whatever the steps (a speculative step commits up
    to 16 tokens): every 2-way split and random k-way splits give the same events."""
    ids = tok.encode(RECORDED)
    whole = _events(tok, ids, [])
    assert [k for k, *_ in whole] == ["reasoning", "content", "tool_call", "content", "tool_call", "content"]
    assert whole[0][1] == "Plan: ∑ two calls." and whole[3][1] == " then " and whole[5][1] == "done 🎉"
    assert [c[1:] for *_, c in whole if c] == [("f", '{"a": "x"}'), ("g", '{"n": 2}')]
    for cut in range(1, len(ids)):
        assert _events(tok, ids, [cut]) == whole, cut
    rng = random.Random(7)
    for _ in range(60):
        k = rng.randint(2, 24)
        cuts = sorted(rng.sample(range(1, len(ids)), k))
        assert _events(tok, ids, cuts) == whole, cuts
    steps = list(range(16, len(ids), 16))  # speculative steps of 16 tokens
    assert _events(tok, ids, steps) == whole
