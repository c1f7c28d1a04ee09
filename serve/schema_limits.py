"""Serve stage: limits the server enforces beyond what the request models' types say, written as JSON Schema for the
OpenAPI document (json_schema_extra; validation stays the code's, whose 400s name each field), so that a client or
a fuzzer generating from the document sends what is accepted: content by role, content parts by type, exclusive
fields, token ids inside the vocabulary. Limits no schema can state (a conversation's order, context length, image
bytes) remain the code's alone."""

from __future__ import annotations

from typing import Any

GIVEN: dict[str, Any] = {"not": {"type": "null"}}
TOOL_NAME = "^[A-Za-z0-9_.-]{1,64}$"  # serve/conversation.py _TOOL_NAME
TOKEN_ID = "x-thorgen-token-id"  # marks a token id's schema; the document gets the vocabulary's bound there


def _block(kind: str, **required: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["type", *required], "properties": {"type": {"const": kind}, **required}}


def _given(*names: str) -> dict[str, Any]:
    return {"anyOf": [{"required": [name], "properties": {name: GIVEN}} for name in names]}


# serve/conversation.py: content is required but for an assistant message with tool calls, and a tool result
CONTENT_BY_ROLE: dict[str, Any] = {
    "if": {"properties": {"role": {"enum": ["system", "developer", "user"]}}},
    "then": {"required": ["content"], "properties": {"content": GIVEN}},
    "else": {
        "if": {"properties": {"role": {"const": "assistant"}}},
        "then": {
            "anyOf": [
                {"required": ["content"], "properties": {"content": GIVEN}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            ]
        },
    },
}
# serve/conversation.py _media_of: text with its text, image_url / video_url with its URL, or image / video with a
# url (or image / video)
CONTENT_PART: dict[str, Any] = {
    "anyOf": [
        _block("text", text={"type": "string"}),
        _block("image_url", image_url=GIVEN),
        {**_block("image"), **_given("url", "image")},
        _block("video_url", video_url=GIVEN),
        {**_block("video"), **_given("url", "video")},
    ]
}
# serve/vllm_extras.py legacy_functions: OpenAI's tools / tool_choice or its deprecated functions / function_call
TOOLS_OR_FUNCTIONS: dict[str, Any] = {
    "not": {"allOf": [_given("tools", "tool_choice"), _given("functions", "function_call")]}
}
# /tokenize: a raw prompt or a conversation, exactly one
PROMPT_OR_MESSAGES: dict[str, Any] = {
    "oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}},
    ]
}


def bound_token_ids(node: Any, vocab: int | None) -> None:
    """Each token id's schema in the document (marked TOKEN_ID) gets the vocabulary's bound (once it is known)."""
    if isinstance(node, dict):
        if node.pop(TOKEN_ID, None) and vocab:
            node["maximum"] = vocab - 1
        for value in node.values():
            bound_token_ids(value, vocab)
    elif isinstance(node, list):
        for value in node:
            bound_token_ids(value, vocab)


NULL_ONLY: dict[str, Any] = {"type": "null"}  # a field declared so that its 400 can name it: only null passes
# serve/vllm_extras.py: structured_outputs holds one kind of constraint (and the options that shape it)
STRUCTURED_OUTPUTS: dict[str, Any] = {
    "type": "object",
    "additionalProperties": NULL_ONLY,
    "properties": {
        "json": {"anyOf": [{"type": "string"}, {"type": "object"}, {"type": "null"}]},
        "regex": {"anyOf": [{"type": "string", "minLength": 1}, {"type": "null"}]},
        "choice": {"anyOf": [{"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}, NULL_ONLY]},
        "grammar": {"anyOf": [{"type": "string", "pattern": "\\S"}, {"type": "null"}]},
        "json_object": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "disable_fallback": {},
        "disable_any_whitespace": {},
        "disable_additional_properties": {},
    },
}
GUIDED_CHOICE: dict[str, Any] = {"minItems": 1, "items": {"minLength": 1}}


_TEXT = _block("text", text={"type": "string"})
_NAMED = {"type": "string", "minLength": 1}
# serve/anthropic_api.py _turns: the blocks each role's message takes, each with what it needs
_SOURCE = {
    "anyOf": [
        _block("base64", media_type={"type": "string"}, data={"type": "string"}),
        _block("url", url={"type": "string"}),
    ]
}
_RESULT = _block("tool_result", tool_use_id=_NAMED)
_RESULT["properties"]["content"] = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT}, {"type": "null"}]}
USER_BLOCKS = [_TEXT, _block("image", source=_SOURCE), _RESULT]
ASSISTANT_BLOCKS = [_TEXT, _block("tool_use", id=_NAMED, name=_NAMED), _block("thinking"), _block("redacted_thinking")]


def _content_of(blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": blocks}}]}}}


ANTHROPIC_MESSAGE: dict[str, Any] = {
    "if": {"properties": {"role": {"const": "user"}}},
    "then": _content_of(USER_BLOCKS),
    "else": _content_of(ASSISTANT_BLOCKS),
}
SYSTEM_BLOCKS: dict[str, Any] = {"items": _TEXT}  # (beside the field's anyOf: it applies to the list form only)


def _part(kind: str, field: str) -> dict[str, Any]:
    return _block(kind, **{field: {"type": "string"}})


# serve/responses_api.py _text: the content parts of a message item, by its role
_ITEM_PARTS = [
    (["user"], [_part("input_text", "text"), _part("input_image", "image_url")]),
    (["assistant"], [_part("output_text", "text"), _part("refusal", "text")]),
    (["system", "developer"], [_part("input_text", "text")]),
]
# serve/anthropic_api.py _output_format: the structured output in one of its two places
ONE_OUTPUT_FORMAT: dict[str, Any] = {
    "not": {
        "required": ["output_format", "output_config"],
        "properties": {
            "output_format": GIVEN,
            "output_config": {"required": ["format"], "properties": {"format": GIVEN}},
        },
    }
}
# serve/responses_api.py _items: the input items it reads, each with what it needs
RESPONSES_ITEMS: dict[str, Any] = {
    "minItems": 1,
    "items": {
        "anyOf": [
            *(
                {
                    "type": "object",
                    "required": ["role", "content"],
                    "properties": {
                        "type": {"const": "message"},
                        "role": {"enum": roles},
                        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": parts}}]},
                    },
                }
                for roles, parts in _ITEM_PARTS
            ),
            {
                "type": "object",
                "required": ["type", "call_id", "name", "arguments"],
                "properties": {
                    "type": {"const": "function_call"},
                    "call_id": {"type": "string"},
                    "name": {"type": "string"},
                    "arguments": {"type": "string"},
                },
            },
            {
                "type": "object",
                "required": ["type", "call_id", "output"],
                "properties": {
                    "type": {"const": "function_call_output"},
                    "call_id": {"type": "string"},
                    "output": {"type": "string"},
                },
            },
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "reasoning"}}},
        ]
    },
}
RESPONSES_TOOL_CHOICE: dict[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", "required", None]},
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"const": "function"}, "name": {"type": "string"}},
        },
    ]
}
# completions: max_tokens 0 scores the prompt only, which needs echo
SCORE_NEEDS_ECHO: dict[str, Any] = {
    "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
    "then": {"required": ["echo"], "properties": {"echo": {"const": True}}},
}
RESPONSES_TOOLS: dict[str, Any] = {
    "items": {
        "type": "object",
        "required": ["type", "name"],
        "properties": {
            "type": {"const": "function"},
            "name": {"type": "string", "pattern": TOOL_NAME},
            "parameters": {"type": ["object", "null"]},
        },
    }
}
# OpenAI's deprecated function_call: "none", "auto" or {"name": ...}
FUNCTION_CALL: dict[str, Any] = {
    "anyOf": [
        {"enum": ["none", "auto", None]},
        {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
    ]
}
