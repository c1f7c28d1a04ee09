"""Model spec stage (synthetic checkpoints): a Gemma-style byte-fallback BPE tokenizer with the real special ids.

Layout (ids): 0..106 special tokens (the real Gemma-4 ids of MODEL_FACTS §4.2; the gaps are `<unused_N>`),
107 = "\\n" (an ordinary token, as in Gemma), then the 256 byte-fallback tokens <0x00>..<0xFF>, then single
characters (printable ASCII and '▁'), then BPE merges learnt from a small built-in English + code corpus, and
finally never-produced `<unusedN>` entries up to vocab_size so every id decodes to something.
SentencePiece conventions as in Gemma's tokenizer.json: the normalizer turns ' ' into '▁' (no prefix space),
the decoder turns '▁' back into ' ', fuses <0xXX> byte runs into UTF-8, and concatenates.
Known (and shared with real Gemma) limit: a literal '▁' in the input decodes back as a space.
"""

from __future__ import annotations

import re
from collections import Counter

from tokenizers import AddedToken, Tokenizer, decoders, normalizers
from tokenizers.models import BPE

from ..types import Gemma4VisionSpec

SPECIAL_IDS: dict[int, str] = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
NEWLINE_ID = 107
FIRST_BYTE_ID = 108
SPACE = "\u2581"
CHARS = [chr(c) for c in range(0x21, 0x7F)] + [SPACE]

# Merges are learnt from this text (written for thorgen): common English, chat roles, and Python.
CORPUS = """
The model answers the question of the user. The user asks the model about the weather, the time, and the
capital of France; the model says that the capital of France is Paris. A system message tells the model how
to behave: be helpful, be honest, and think step by step before you answer. Here is a list of the first prime
numbers, comma separated. Please write a short story about a robot who learns to paint. Once upon a time there
was a small robot that lived in a quiet town near the sea. Every morning it walked to the harbour and watched
the boats come and go. It wanted to make something beautiful, something that would last longer than the
morning light on the water. One day it found an old box of paints and a brush in the market, and it began to
paint what it saw: the boats, the birds, the people who were working and talking and laughing together.
Explain how a transformer language model works. It reads a sequence of tokens, turns each token into a vector,
and passes the vectors through many layers of attention and feed forward networks. Attention lets every
position look at the positions before it, so the model can use the context to predict the next token. The
output of the last layer goes through a final norm and a projection onto the vocabulary, and the next token is
sampled from the resulting distribution. Speculative decoding uses a small draft model to propose several
tokens at once; the large target model then checks them in a single pass and keeps the longest prefix that it
agrees with. This makes generation faster without changing the result. What is the difference between a list
and a tuple in Python? A list can be changed after it is created, while a tuple cannot. Tools can be called by
the model when it needs information that it does not have, for example the current weather in a city or the
result of a calculation. The function returns a value, and the model uses that value in its answer.
def fibonacci(n: int) -> list[int]:
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result

class Server:
    def __init__(self, host: str = "localhost", port: int = 8000) -> None:
        self.host = host
        self.port = port

    def handle(self, request: dict) -> dict:
        if request.get("stream"):
            return {"error": "not implemented"}
        return {"status": "ok", "content": self.generate(request["messages"])}

import json
import numpy as np

def main():
    data = json.loads(open("config.json").read())
    print(f"loaded {len(data)} keys from the config file")
    x = np.zeros((4, 4), dtype=np.float32)
    return x.sum()

if __name__ == "__main__":
    main()
"""


def _train_merges(corpus: str, max_merges: int) -> list[tuple[str, str]]:
    """Greedy BPE over space-separated words ('▁' marks a word start); no merges involving digits, like Gemma."""
    words: Counter[tuple[str, ...]] = Counter()
    for line in corpus.split("\n"):
        for i, piece in enumerate(re.split(r"( +)", line.replace("\t", "    "))):
            if not piece or piece.isspace():
                continue
            word = (SPACE if i > 0 else "") + piece
            words[tuple(word)] += 1
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:]):
                if not (any(ch.isdigit() for ch in a + b) or (SPACE in b)):
                    pairs[(a, b)] += freq
        if not pairs:
            break
        best, count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))  # most frequent, ties by text: stable
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, freq in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += freq
        words = merged
    return merges


def media_special_ids(vision: Gemma4VisionSpec | None) -> dict[int, str]:
    """The image/video special tokens at the ids the vision spec names (none without a tower)."""
    if vision is None:
        return {}
    return {
        vision.boi_token_id: "<|image>",
        vision.image_token_id: "<|image|>",
        vision.eoi_token_id: "<image|>",
        vision.video_token_id: "<|video|>",
    }


def _place_specials(vocab: dict[str, int], extra: dict[int, str]) -> dict[str, int]:
    """The vocab with each extra special token taking over the never-produced filler entry at its id."""
    by_id = {i: t for t, i in vocab.items()}
    for i, text in extra.items():
        old = by_id.get(i)
        if old is None or not old.startswith("<unused") or text in vocab:
            raise ValueError(f"synthetic tokenizer: id {i} ({old!r}) cannot hold the special token {text!r}")
        by_id[i] = text
        vocab = {t: j for j, t in by_id.items()}
    return vocab


def build_vocab(
    vocab_size: int, max_merges: int = 3000, extra_specials: dict[int, str] | None = None
) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The (vocab, merges) of the synthetic tokenizer; vocab has exactly vocab_size entries. extra_specials
    (id -> text, e.g. the image tokens) take the filler slots at their ids."""
    base = FIRST_BYTE_ID + 256 + len(CHARS)
    if vocab_size < base:
        raise ValueError(f"vocab_size {vocab_size} is below the {base} ids the special/byte/char layout needs")
    vocab: dict[str, int] = {}
    unused = 0
    for i in range(NEWLINE_ID):
        if i in SPECIAL_IDS:
            vocab[SPECIAL_IDS[i]] = i
        else:
            vocab[f"<unused_{unused}>"] = i
            unused += 1
    vocab["\n"] = NEWLINE_ID
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = FIRST_BYTE_ID + b
    for ch in CHARS:
        vocab[ch] = len(vocab)
    merges: list[tuple[str, str]] = []
    for a, b in _train_merges(CORPUS, max_merges):
        if len(vocab) >= vocab_size:
            break
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
        merges.append((a, b))
    n = 0
    while len(vocab) < vocab_size:  # ids that BPE never produces, so every id still decodes to some text
        vocab[f"<unused{n}>"] = len(vocab)
        n += 1
    vocab = _place_specials(vocab, extra_specials or {})
    assert sorted(vocab.values()) == list(range(vocab_size))
    return vocab, merges


def build_tokenizer(vocab_size: int, extra_specials: dict[int, str] | None = None) -> Tokenizer:
    extra = extra_specials or {}
    vocab, merges = build_vocab(vocab_size, extra_specials=extra)
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = [tok_str for tok_str, i in sorted(vocab.items(), key=lambda kv: kv[1]) if i < NEWLINE_ID or i in extra]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    for i, s in (SPECIAL_IDS | extra).items():
        assert tok.token_to_id(s) == i, (s, i, tok.token_to_id(s))
    return tok


def tokenizer_config(chat_template: str | None, max_len: int) -> dict:
    """tokenizer_config.json for HF loaders (PreTrainedTokenizerFast reads tokenizer.json directly)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg
