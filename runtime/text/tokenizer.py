"""Runtime stage: the tokenizer wrapper used by generate and the server (HF `tokenizer.json` via `tokenizers`).

encode() never adds BOS (Gemma's chat template writes `<bos>` itself) and parses special-token strings in the
text as specials. IncrementalDecoder turns a stream of ids into text deltas that never split a UTF-8 character
(byte-fallback tokens can carry one character's bytes across several ids).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Iterable

from tokenizers import Tokenizer as _HFTokenizer

REPLACEMENT = "\ufffd"
MAX_CHARACTER_TOKENS = 4  # a UTF-8 character is at most 4 bytes, so at most 4 byte-fallback tokens


class TokenizerError(ValueError):
    """A tokenizer file that cannot be loaded, or an id outside the vocabulary."""


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, path: Path | None = None) -> None:
        self._tok = tok
        self.path = path
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(i for i, t in tok.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"{path}: tokenizer file not found")
        try:
            return cls(_HFTokenizer.from_file(str(path)), path)
        except Exception as exc:  # tokenizers raises plain Exception on malformed JSON
            raise TokenizerError(f"{path}: cannot load tokenizer: {exc}") from exc

    @classmethod
    def from_checkpoint(cls, model_dir: str | os.PathLike) -> "Tokenizer":
        return cls.from_file(Path(model_dir) / "tokenizer.json")

    def encode(self, text: str) -> list[int]:
        """Token ids of text: no BOS added; special-token strings in the text become their ids. Through
        encode_batch, which releases the GIL (encode holds it), so a long text never stalls other threads."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise TokenizerError(f"token id(s) {bad[:5]} outside the vocabulary (size {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_ids

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))


class IncrementalDecoder:
    """Feed ids one at a time; each call returns only the newly completed text ('' while a character is open).

    Decodes a short window of ids and emits what extends past the already-emitted part of that window, so each
    push costs the same however long the output. Text ending in U+FFFD is held back (an unfinished byte-fallback
    sequence) until more ids or flush(), but a UTF-8 character spans at most 4 byte tokens: a longer undecodable
    tail is garbage (random weights emit lone continuation bytes), so it is emitted as U+FFFD rather than held and
    re-decoded forever. (`tokenizers`' DecodeStream holds such a tail forever and cannot flush, hence this class.)
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []  # the window: ids before _read are emitted, the rest are held back
        self._read = 0
        self.text = ""  # everything emitted so far

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._decode(self._ids)
        if text.endswith(REPLACEMENT) and len(self._ids) - self._read <= MAX_CHARACTER_TOKENS:
            return ""
        new = text[len(self._decode(self._ids[: self._read])) :]
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self.text += new
        return new

    def push_many(self, token_ids: Iterable[int]) -> str:
        return "".join(self.push(t) for t in token_ids)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character decodes as U+FFFD), then start a fresh window."""
        new = ""
        if self._read < len(self._ids):
            new = self._decode(self._ids)[len(self._decode(self._ids[: self._read])) :]
        self._ids, self._read = [], 0
        self.text += new
        return new
