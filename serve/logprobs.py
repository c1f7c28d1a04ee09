"""Serve stage: the engine's per-token logprobs -> OpenAI's `logprobs` objects (chat and completions, streamed
or whole). One entry per generated token, the final stop token included (as vLLM reports it); with completions'
`echo`, the prompt's tokens come first, the very first one without a logprob (nothing predicts it)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

from ..runtime.backend import TokenLogprob

# one token's entry: (its text, its logprob, [(text, logprob)] of the top entries, its text_offset); the logprob
# and the top entries are None for the first prompt token, which nothing predicts
_Item = tuple[str, Optional[float], Optional[list[tuple[str, float]]], int]


class Logprobs:
    """Formats one request's logprobs; `add` returns the object for the tokens of one engine step and keeps
    them for `total` (the non-streamed answer)."""

    def __init__(self, token_text: Callable[[int], str], chat: bool) -> None:
        self.token_text, self.chat = token_text, chat
        self.offset = 0  # completions' text_offset of the next token
        self.items: list[_Item] = []

    def add(self, entries: Iterable[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        """(token id, its TokenLogprob) pairs; None stands for the first prompt token's missing entry."""
        items: list[_Item] = []
        for token, entry in entries:
            text = self.token_text(token)
            lp, top = entry if entry is not None else (None, None)
            items.append((text, lp, None if top is None else [(self.token_text(t), v) for t, v in top], self.offset))
            self.offset += len(text)
        self.items += items
        return self._object(items)

    def total(self) -> dict[str, Any]:
        return self._object(self.items)

    def _object(self, items: list[_Item]) -> dict[str, Any]:
        if self.chat:  # (chat never scores its prompt: every item has its logprob and top entries)

            def entry(text: str, lp: float | None) -> dict[str, Any]:
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {
                "content": [
                    {**entry(text, lp), "top_logprobs": [entry(t, v) for t, v in top or ()]}
                    for text, lp, top, _ in items
                ]
            }
        return {
            "tokens": [i[0] for i in items],
            "token_logprobs": [i[1] for i in items],
            "top_logprobs": [None if i[2] is None else dict(i[2]) for i in items],
            "text_offset": [i[3] for i in items],
        }
