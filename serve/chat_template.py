"""Serve stage: prompt construction: the checkpoint's own jinja chat template (sandboxed, HF conventions) and its
tokenizer (tokenizer.json through `tokenizers`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from ..runtime.text.prompts import template_environment
from ..runtime.text.tokenizer import Tokenizer
from .parser import ControlIds
from .protocol import APIError


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "<bos>") -> None:
        self.source = source
        self.bos_token = bos_token
        self._template = template_environment().from_string(source)

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                **kwargs,
            )
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
            RecursionError,
        ) as exc:
            # The template rejects this conversation (e.g. a tool schema shape it cannot render): the client's fix.
            raise APIError(
                f"the chat template cannot render this conversation ({type(exc).__name__}: {exc}); "
                "check the tool schemas and message structure",
                param="messages",
            ) from None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """tokenizer.json through `tokenizers` (the runtime's wrapper: no BOS added, specials matched literally)."""
    return Tokenizer.from_file(path)


def safe_decoder(tokenizer: Tokenizer):
    """decode() that never raises: an id outside the vocabulary (an engine bug) decodes to U+FFFD."""

    def decode(ids: list[int]) -> str:
        try:
            return tokenizer.decode(ids)
        except ValueError:
            return "".join(tokenizer.decode([i]) if 0 <= i < tokenizer.vocab_size else "\ufffd" for i in ids)

    return decode


def describe_tokenizer(tokenizer: Tokenizer, template: ChatTemplate, generation_config: dict, max_context: int) -> dict:
    """GET /tokenizer_info's body. The special tokens are the ids generation_config names (its first eos id is
    the tokenizer's own eos, as in Gemma's configs); the class is what transformers loads a tokenizer.json as."""

    def text(key: str) -> str | None:
        ids = generation_config.get(key)
        first = ids[0] if isinstance(ids, list) and ids else ids
        return tokenizer.id_to_token(first) if isinstance(first, int) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": template.bos_token,
        "eos_token": text("eos_token_id"),
        "pad_token": text("pad_token_id"),
        "chat_template": template.source,
        "model_max_length": max_context,
        "vocab_size": tokenizer.vocab_size,
    }


def control_ids(tokenizer: Tokenizer, stop_ids: frozenset[int]) -> ControlIds:
    """Control ids looked up by their token text (MODEL_FACTS §4.2 values as fallback); every other special
    token is hidden from the output text."""

    def tid(text: str, default: int) -> int:
        found = tokenizer.token_to_id(text)
        return default if found is None else found

    ids = dict(
        channel_open=tid("<|channel>", 100),
        channel_close=tid("<channel|>", 101),
        tool_call_open=tid("<|tool_call>", 48),
        tool_call_close=tid("<tool_call|>", 49),
        string_delim=tid('<|"|>', 52),
    )
    hidden = tokenizer.special_ids - set(ids.values()) - stop_ids
    return ControlIds(stops=stop_ids, hidden=frozenset(hidden), **ids)
