"""Test support (not a test module): random texts of an llguidance grammar over the tiny checkpoint's tokenizer, as a
model with uniform logits at temperature 1 would sample them under the grammar's token masks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

STOP = 1  # the tiny tokenizer's <eos>


class Walker:
    """walk(grammar) -> the decoded text of one random path through the grammar (till it lets only a stop
    follow, or, once complete, a coin says stop)."""

    def __init__(self, checkpoint: Path, seed: int = 0) -> None:
        from thorgen.runtime.text.grammar import tokenizer
        from thorgen.runtime.text.tokenizer import Tokenizer

        self.tok = Tokenizer.from_file(checkpoint / "tokenizer.json")
        self.vocab = 512
        self.ll = tokenizer(str(checkpoint / "tokenizer.json"), self.vocab, (STOP,))
        self.rng = np.random.default_rng(seed)

    def token(self, text: str) -> int:
        found = self.tok.token_to_id(text)
        assert found is not None, text
        return found

    def walk(self, grammar: str, max_tokens: int = 400) -> str:
        import llguidance

        m = llguidance.LLMatcher(self.ll, grammar, log_level=0)
        assert not m.is_error(), m.get_error()
        out: list[int] = []
        for _ in range(max_tokens):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[: self.vocab]
            allowed = np.flatnonzero(bits)
            assert allowed.size, f"the grammar allows no token after {self.tok.decode(out)!r}"
            if STOP in allowed and (allowed.size == 1 or self.rng.random() < 0.3):
                return self.tok.decode(out)
            choice = int(self.rng.choice(allowed[allowed != STOP]))
            assert m.consume_token(choice), m.get_error()
            out.append(choice)
        raise AssertionError(f"no end after {max_tokens} tokens: {self.tok.decode(out)!r}")
