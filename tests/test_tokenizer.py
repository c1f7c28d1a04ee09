"""Tests for the synthetic tokenizer (model_spec/synth/tokenizer.py) and the runtime wrapper
(runtime/text/tokenizer.py)."""

from __future__ import annotations

import json
import random

import pytest

from thorgen.model_spec.synth.tokenizer import SPECIAL_IDS, build_tokenizer, tokenizer_config
from thorgen.runtime.text.tokenizer import IncrementalDecoder, Tokenizer, TokenizerError

# MODEL_FACTS §4.2, written out here (not imported) so the test checks the table in the code.
REAL_IDS = {
    "<pad>": 0,
    "<eos>": 1,
    "<bos>": 2,
    "<unk>": 3,
    "<mask>": 4,
    "<|tool>": 46,
    "<tool|>": 47,
    "<|tool_call>": 48,
    "<tool_call|>": 49,
    "<|tool_response>": 50,
    "<tool_response|>": 51,
    '<|"|>': 52,
    "<|think|>": 98,
    "<|channel>": 100,
    "<channel|>": 101,
    "<|turn>": 105,
    "<turn|>": 106,
    "\n": 107,
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    path.write_text(build_tokenizer(512).to_str())
    return Tokenizer.from_file(path)


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        range(0x20, 0x7F),
        range(0x7F, 0x800),
        range(0x800, 0xD800),
        range(0xE000, 0x10000),
        range(0x10000, 0x110000),
        [0x0, 0x9, 0xA, 0xD, 0x20, 0x20],
    ]
    out = []
    for _ in range(n):
        c = rng.choice(rng.choice(pools))
        out.append(chr(c) if c != 0x2581 else "x")  # a literal '▁' decodes as ' ' (as in real Gemma)
    return "".join(out)


def test_special_ids_match_model_facts(tok):
    for s, i in REAL_IDS.items():
        assert tok.token_to_id(s) == i, s
        assert tok.id_to_token(i) == s
    assert tok.vocab_size == 512
    assert {tok.id_to_token(i) for i in range(107) if i not in SPECIAL_IDS} == {
        f"<unused_{k}>" for k in range(107 - len(SPECIAL_IDS))
    }
    assert tok.encode("\n") == [107]
    assert tok.is_special(106) and not tok.is_special(107)


def test_specials_in_text_are_parsed(tok):
    ids = tok.encode("<bos><|turn>user\nHi there<turn|>\n<|turn>model\n")
    assert ids[:2] == [2, 105] and ids.count(106) == 1 and ids.count(107) == 3
    assert ids[-1] == 107
    assert tok.decode(ids) == "<bos><|turn>user\nHi there<turn|>\n<|turn>model\n"
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi there\nmodel\n"
    assert tok.encode('<|tool_call>call:f{a:<|"|>x<|"|>}<tool_call|>')[0] == 48


def test_round_trip_arbitrary_unicode(tok):
    rng = random.Random(0)
    samples = [
        "",
        " ",
        "  leading and trailing  ",
        "Hello, world!",
        "naïve café 日本語 🙂👍🏽",
        "\x00\t\r\n",
        "def f(x):\n    return x ** 2\n",
        "<0x41> is not a byte token",
        "<eos> inside text",
    ]
    samples += [_random_text(rng, rng.randint(1, 60)) for _ in range(300)]
    for s in samples:
        ids = tok.encode(s)
        assert all(0 <= i < 512 for i in ids)
        assert tok.decode(ids) == s, repr(s)


def test_byte_fallback_is_used_for_unknown_characters(tok):
    ids = tok.encode("é")
    assert [tok.id_to_token(i) for i in ids] == ["<0xC3>", "<0xA9>"]
    assert len(tok.encode(" the")) == 1  # learnt merges exist even in the 512-token vocabulary


def test_incremental_decoder_never_splits_characters(tok):
    rng = random.Random(1)
    for s in ["日本語 and 🙂 mixed", "plain ascii", "é" * 5, _random_text(rng, 200)]:
        dec = tok.incremental_decoder()
        parts = [dec.push(i) for i in tok.encode(s)]
        parts.append(dec.flush())
        assert "".join(parts) == s and dec.text == s
        assert all("\ufffd" not in p for p in parts)
    dec = IncrementalDecoder(tok.decode)
    first, second, third = tok.encode("日")  # three byte-fallback ids
    assert dec.push(first) == "" and dec.push(second) == "" and dec.push(third) == "日"


def test_incremental_decoder_flushes_incomplete_tail(tok):
    dec = tok.incremental_decoder()
    ids = tok.encode("a日")
    assert dec.push(ids[0]) == "a"
    assert dec.push(ids[1]) == ""
    assert dec.flush() == "\ufffd"


def test_incremental_decoder_emits_undecodable_tails(tok):
    """More than 4 held byte tokens cannot be one character still arriving: they stream out as U+FFFD."""
    dec = tok.incremental_decoder()
    lone = tok.token_to_id("<0x80>")
    streamed = dec.push_many([lone] * 12)
    assert streamed == "\ufffd" * 10
    assert dec.flush() == "\ufffd" * 2 and dec.text == "\ufffd" * 12


def test_incremental_decoder_skips_specials(tok):
    dec = tok.incremental_decoder(skip_special_tokens=True)
    out = dec.push_many(tok.encode("<|turn>model\nParis<turn|>"))
    assert out + dec.flush() == "model\nParis"


def test_errors(tok, tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(TokenizerError, match="cannot load"):
        Tokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([5, 512])


def test_full_vocab_layout():
    full = build_tokenizer(262144)
    assert full.get_vocab_size() == 262144
    assert full.id_to_token(262143).startswith("<unused")
    assert full.token_to_id("<|turn>") == 105 and full.token_to_id("<0x00>") == 108
    s = "The model answers the question. 日本 \u2603"
    assert full.decode(full.encode(s).ids, skip_special_tokens=False) == s
    assert len(full.encode("the capital of France is Paris").ids) < 12  # real merges, not characters


def test_hf_transformers_agrees(tmp_path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "tokenizer.json").write_text(build_tokenizer(512).to_str())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(None, 8192)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    mine = Tokenizer.from_checkpoint(tmp_path)
    for s in ["Hello, world!", "<|turn>user\nnaïve 🙂<turn|>\n", "  x"]:
        assert hf.encode(s, add_special_tokens=False) == mine.encode(s)
        assert hf.decode(mine.encode(s)) == s
    assert hf.bos_token_id == 2 and hf.eos_token_id == 1 and hf.pad_token_id == 0
