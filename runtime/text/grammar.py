"""Runtime stage: grammar-constrained decoding: an llguidance grammar per request, a matcher per sequence.

llguidance (not xgrammar) because it computes a token mask lazily from a token trie and a lexer, so a mask
costs microseconds to ~1 ms even for a 262k vocabulary with no per-grammar precompile step, its JSON Schema
support covers what OpenAI's structured outputs accept, and its Python wheel (abi3, no torch) takes NumPy
masks directly. The grammar value travels in SamplingParams; the sequence owns its matcher, which survives
a preemption (the recomputed tokens are the ones it has already consumed).
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend import BackendError


# JSON without free whitespace: a weak (or random) model otherwise spends its whole budget on newlines inside
# a valid-so-far document. One space after ',' and ':' as json.dumps writes it.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


TokenizerKey = tuple[str, int, tuple[int, ...]]
# each tokenizer `tokenizer()` made (kept alive, so that its id stays its own) -> its arguments: a Grammar pickles
# as those (an llguidance tokenizer does not pickle) and the engine process rebuilds the tokenizer from them
_KEYS: dict[int, tuple[Any, TokenizerKey]] = {}


@functools.lru_cache(maxsize=4)
def tokenizer(tokenizer_json: str, n_vocab: int, eos: tuple[int, ...]) -> Any:
    """An llguidance tokenizer from a tokenizer.json path (built once per path: ~1 s for Gemma's vocabulary);
    `eos`: the stop ids, which the matcher allows once the grammar is complete."""
    import llguidance

    with open(tokenizer_json, encoding="utf-8") as f:
        tok = llguidance.LLTokenizer(f.read(), n_vocab=n_vocab, eos_token=list(eos))
    _KEYS[id(tok)] = (tok, (tokenizer_json, n_vocab, eos))
    return tok


def json_grammar(schema: dict | None, tok: Any) -> str:
    """The llguidance grammar for JSON valid against `schema` (None: any JSON object); ValueError names what
    is wrong with an invalid or unsupported schema."""
    import llguidance

    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"} if schema is None else schema), defaults=JSON_OPTIONS
        )
    except ValueError as exc:
        raise ValueError(f"the JSON schema is invalid: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(text, tok)
    if error and not error.startswith("WARNING"):
        raise ValueError(f"the JSON schema is invalid or unsupported: {error}")
    return text


@dataclass(frozen=True)
class Grammar:
    """An llguidance grammar (its JSON form) over an `llguidance.LLTokenizer` whose EOS tokens are the stop ids.

    `thought`: (channel open id, channel close id) with thinking on: the first token may open the thought
    channel instead, which runs unconstrained until it closes, and the grammar starts after it.
    `trigger`: a token id that starts the grammar: decoding is free until it is sampled, then the grammar
    constrains what follows until it is complete, and decoding is free again until the next trigger (a tool
    call that the model opens on its own under tool_choice auto)."""

    text: str
    tokenizer: Any = field(compare=False, repr=False)
    thought: tuple[int, int] | None = None
    trigger: int | None = None

    def matcher(self) -> Matcher:
        return Matcher(self)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled (to the engine process) as its text and its tokenizer's `tokenizer()` arguments."""
        entry = _KEYS.get(id(self.tokenizer))
        if entry is None:
            raise TypeError("a Grammar pickles only over a tokenizer made by runtime.text.grammar.tokenizer()")
        return _rebuilt, (self.text, entry[1], self.thought, self.trigger)


def _rebuilt(text: str, key: TokenizerKey, thought: tuple[int, int] | None, trigger: int | None) -> Grammar:
    return Grammar(text, tokenizer(*key), thought, trigger)


class Matcher:
    """One sequence's grammar state: `allowed(vocab)` -> bool mask for the next token; `accept(token)`."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self.thought = grammar.thought
        self._m, self._fresh = self._start(), True  # made now so that a bad grammar fails at admission
        if grammar.trigger is not None:
            self.state = "free"  # -> "active" at the trigger -> "free" when the grammar is complete
        else:
            self.state = "start" if self.thought else "active"  # -> "thinking" -> "active"

    def _start(self) -> Any:
        import llguidance

        m = llguidance.LLMatcher(self.grammar.tokenizer, self.grammar.text, log_level=0)
        if m.is_error():
            raise BackendError(f"the grammar is invalid: {m.get_error()}")
        return m

    def allowed(self, vocab: int) -> np.ndarray | None:
        """The allowed-token mask over `vocab` ids (ids past the tokenizer's are never allowed); None inside the
        thought channel and outside a triggered grammar."""
        if self.state in ("thinking", "free"):
            return None
        bits = np.unpackbits(np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        mask = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.shape[0])
        mask[:n] = bits[:n].astype(bool)
        if self.state == "start":
            mask[self.thought[0]] = True
        return mask

    @property
    def free(self) -> bool:
        """Whether its next token takes no mask (inside the thought channel, or before a trigger)."""
        return self.state in ("thinking", "free")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, from the first, it would accept in turn (a speculative step's drafts: the first
        one it refuses ends the run that can be accepted). This matcher stays as it is: the walk runs on a copy,
        whose llguidance matcher is forked only when the walk reaches the grammar."""
        walk = copy.copy(self)
        forked = False
        for i, token in enumerate(tokens):
            constrained = walk.state == "active" or (walk.state == "start" and token != self.thought[0])
            if not forked and (constrained or (walk.state == "free" and token == self.grammar.trigger)):
                walk._m, forked = walk._m.deep_copy(), True
            if constrained and walk._m.validate_tokens([int(token)]) < 1:
                return i
            walk.accept(token)
        return len(tokens)

    def fork(self) -> "Matcher":
        """An independent copy in the same state (a verify's walk through its drafts; this matcher stays as it
        is)."""
        walk = copy.copy(self)
        walk._m = self._m.deep_copy()
        return walk

    def accept(self, token: int) -> None:
        if self.state == "free":
            if token == self.grammar.trigger:
                if not self._fresh:  # each call starts the grammar afresh
                    self._m = self._start()
                self._fresh, self.state = False, "active"
            return
        if self.state == "start" and token == self.thought[0]:
            self.state = "thinking"
            return
        if self.state == "thinking":
            if token == self.thought[1]:
                self.state = "active"
            return
        self.state = "active"
        if not self._m.consume_token(int(token)):
            raise RuntimeError(f"grammar matcher rejected token {token}: {self._m.get_error()}")
        if self.grammar.trigger is not None and self._m.is_accepting():
            self.state = "free"
