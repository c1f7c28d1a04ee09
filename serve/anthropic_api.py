"""Serve stage: Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): its request schema and its
translation into a GenerationRequest; serve/anthropic_errors.py answers its errors, serve/anthropic_format.py its
answers."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from . import openapi
from . import schema_limits as limits
from .anthropic_errors import AnthropicRoute
from .anthropic_format import MessagesAdapter
from .answer import answer
from .conversation import image_source, template_messages, validate_tools
from .pipeline import conversation_prompt, prepare
from .protocol import (
    APIError,
    ContentPart,
    FunctionCall,
    FunctionDef,
    Integer,
    Message,
    Number,
    Tool,
    ToolCallIn,
    _Body,
    _Open,
    integer,
    stop_list,
)
from .request import GenerationRequest, ImageSource, OutputFormat, SamplingOptions
from .state import server_state

MIN_THINKING_BUDGET = 1024  # Anthropic's lower bound on thinking.budget_tokens
REFUSED = {
    "mcp_servers": "MCP servers",
    "container": "code-execution containers",
    "context_management": "context management (clearing earlier turns)",
}


class Block(_Open):
    """A content block: text, tool_use, tool_result, thinking, redacted_thinking (others are refused)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: Union[str, list["Block"], None] = None
    is_error: StrictBool | None = None
    thinking: str | None = None
    signature: str | None = None
    source: dict[str, Any] | None = None  # an image block's: {"type": "base64", "media_type", "data"} or "url"


class AnthropicMessage(_Open):
    model_config = ConfigDict(extra="allow", json_schema_extra=limits.ANTHROPIC_MESSAGE)
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class AnthropicTool(_Open):
    name: str = Field(json_schema_extra={"pattern": limits.TOOL_NAME})
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    # absent or "custom"; Anthropic's server tools (web search, bash, ...) are refused
    type: str | None = Field(None, json_schema_extra={"enum": ["custom", None]})


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["enabled", "disabled"]
    budget_tokens: Integer | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool | None = None


class JSONOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: JSONOutputFormat | None = None  # structured output: the answer's text is JSON valid against the schema
    # accepted: Gemma has no effort setting (thinking is `thinking`'s), so every level answers alike
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class _Conversation(_Body):
    # unknown fields are refused: any of Anthropic's fields this server does not know could change the answer
    model_config = ConfigDict(extra="forbid", json_schema_extra=limits.ONE_OUTPUT_FORMAT)
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[Block], None] = Field(None, json_schema_extra=limits.SYSTEM_BLOCKS)
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    output_format: JSONOutputFormat | None = None  # the structured-outputs beta's name for output_config.format
    # refused when set (REFUSED): declared so that the 400 says what they are, and the document that only null passes
    mcp_servers: Any = Field(None, json_schema_extra={"type": "null"})
    container: Any = Field(None, json_schema_extra={"type": "null"})
    context_management: Any = Field(None, json_schema_extra={"type": "null"})


class CountTokensRequest(_Conversation):
    pass


class MessagesRequest(_Conversation):
    max_tokens: integer(ge=1)
    stop_sequences: list[str] | None = None
    temperature: Number | None = Field(default=None, ge=0, le=1)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=0) | None = None
    stream: StrictBool | None = False
    metadata: dict[str, Any] | None = None  # accepted and ignored: it does not change the answer
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: nothing to choose


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for block in content:
        if block.type != "text" or block.text is None:
            raise APIError(f"{where}: only text blocks are supported here (got {block.type!r})", param="messages")
        parts.append(block.text)
    return "".join(parts)


def _turns(m: AnthropicMessage, i: int, image_fields: list[str]) -> list[Message]:
    """One Anthropic message -> chat messages: tool_result blocks become `tool` messages (ahead of the user's
    text), tool_use blocks the assistant's tool_calls; thinking blocks are dropped (the chat template leaves
    earlier reasoning out of the prompt, so their signatures need no checking)."""
    where = f"messages[{i}]"
    if isinstance(m.content, str):
        return [Message(role=m.role, content=m.content)]
    texts, calls, results = [], [], []
    parts: list[ContentPart] = []  # a user message's text and image blocks in order (when it holds an image)
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
            parts.append(ContentPart(type="text", text=block.text))
        elif block.type in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue
        elif block.type == "tool_use" and m.role == "assistant":
            if not block.id or not block.name:
                raise APIError(f"{at}: a tool_use block needs an id and a name", param="messages")
            calls.append(ToolCallIn(id=block.id, function=FunctionCall(name=block.name, arguments=block.input or {})))
        elif block.type == "tool_result" and m.role == "user":
            if not block.tool_use_id:
                raise APIError(f"{at}: a tool_result block needs its tool_use_id", param="messages")
            text = _text(block.content, at)
            results.append(
                Message(
                    role="tool",
                    tool_call_id=block.tool_use_id,
                    content=json.dumps({"error": text}) if block.is_error else text,
                )
            )
        elif block.type in ("video", "video_url"):
            raise APIError(
                f"{at}: video input is not supported by the Messages API; send it to /v1/chat/completions as a "
                "video_url content part",
                param="messages",
            )
        elif block.type == "image" and m.role == "user":
            parts.append(ContentPart(type="image_url", image_url=_image_url(block.source, at)))
            image_fields.append(at)
        else:
            raise APIError(
                f"{at}: content block type {block.type!r} is not supported in a {m.role} message", param="messages"
            )
    if m.role == "assistant":
        return [
            Message(role="assistant", content="".join(texts) if texts or not calls else None, tool_calls=calls or None)
        ]
    if any(part.type == "image_url" for part in parts):
        return results + [Message(role="user", content=parts)]
    return results + ([Message(role="user", content="".join(texts))] if texts or not results else [])


def _image_url(source: dict[str, Any] | None, at: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL; a "url" source as it is."""
    kind = (source or {}).get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise APIError(f"{at}.source: a base64 source needs media_type and data (strings)", param="messages")
        return image_source(f"data:{media_type};base64,{data}", None, at).url
    if kind == "url":
        return image_source(source.get("url"), None, at).url
    raise APIError(
        f"{at}: an image block's source must be {{'type': 'base64', 'media_type': ..., 'data': ...}} or "
        "{'type': 'url', 'url': ...}",
        param="messages",
    )


def conversation_request(req: _Conversation) -> GenerationRequest:
    """What a request's prompt is made of (messages and their images, tools, tool choice, thinking), with none of
    its generation settings: /v1/messages adds them, /v1/messages/count_tokens renders it as it is."""
    for name, what in REFUSED.items():
        if getattr(req, name) is not None:
            raise APIError(f"{name}: {what} are not supported by this server", param=name)
    thinking = req.thinking is not None and req.thinking.type == "enabled"
    turns, prefill = _prefill(req.messages, thinking)
    messages: list[Message] = []
    if req.system:
        messages.append(Message(role="system", content=_text(req.system, "system")))
    image_fields: list[str] = []  # each image block's place in this request (errors name it)
    for i, m in enumerate(turns):
        messages += _turns(m, i, image_fields)
    tools = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(
                f"tools[{i}]: Anthropic's server tool {tool.type!r} is not supported; declare custom "
                "tools with name, description and input_schema",
                param="tools",
            )
        tools.append(
            Tool(function=FunctionDef(name=tool.name, description=tool.description, parameters=tool.input_schema))
        )
    declared = validate_tools(tools)
    mode, forced, parallel = _tool_choice(req.tool_choice, declared)
    found: list[ImageSource] = []
    templated = template_messages(messages, found)
    output_format = _output_format(req)
    if prefill is not None and output_format is not None:
        raise APIError(
            f"{output_format.param} cannot be combined with a final assistant message (a prefill): the answer "
            "would have to continue it and be JSON from its start",
            param=output_format.param,
        )
    return GenerationRequest(
        messages=templated,
        images=[replace(source, where=where) for source, where in zip(found, image_fields)],
        tools=declared,
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=parallel,
        thinking=thinking,
        output_format=output_format,
        assistant_prefill=prefill,
    )


def _prefill(turns: list[AnthropicMessage], thinking: bool) -> tuple[list[AnthropicMessage], str | None]:
    """(the turns before a final assistant message, that message's text), which the answer continues (as vLLM's
    continue_final_message); (turns, None) when the user speaks last."""
    if turns[-1].role != "assistant":
        return turns, None
    at = f"messages[{len(turns) - 1}]"
    if thinking:
        raise APIError(
            f"{at}: a final assistant message (a prefill for the answer to continue) cannot be combined with "
            "thinking; end with a user message or turn thinking off",
            param="messages",
        )
    content = turns[-1].content
    if not isinstance(content, str):
        kinds = {block.type for block in content} - {"text", "thinking", "redacted_thinking"}
        if kinds:
            raise APIError(
                f"{at}: a final assistant message is a prefill the answer continues, so it holds text only "
                f"(not {sorted(kinds)[0]!r})",
                param="messages",
            )
        content = "".join(block.text or "" for block in content if block.type == "text")
    return turns[:-1], content


def _output_format(req: _Conversation) -> OutputFormat | None:
    """output_config.format (or the beta's output_format): the answer's text is JSON valid against the schema."""
    config = req.output_config.format if req.output_config is not None else None
    if config is not None and req.output_format is not None:
        raise APIError("give output_config.format or output_format, not both", param="output_config")
    if config is not None:
        return OutputFormat("json_schema", config.schema_, "output_config.format")
    if req.output_format is not None:
        return OutputFormat("json_schema", req.output_format.schema_, "output_format")
    return None


def _tool_choice(choice: ToolChoice | None, tools: list[dict] | None) -> tuple[str, str | None, bool]:
    parallel = not (choice and choice.disable_parallel_tool_use)
    if choice is None or choice.type == "auto":
        return ("auto" if tools else "none"), None, parallel
    if choice.type == "none":
        return "none", None, parallel
    if not tools:
        raise APIError(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "any":
        return "required", None, parallel
    names = [t["function"]["name"] for t in tools]
    if choice.name not in names:
        raise APIError(f"tool_choice names {choice.name!r}, which is not among the declared tools", param="tool_choice")
    return "named", choice.name, parallel


def messages_request(req: MessagesRequest) -> GenerationRequest:
    prompt = conversation_request(req)
    if req.thinking is not None and req.thinking.type == "enabled":
        budget = req.thinking.budget_tokens
        if budget is None or not MIN_THINKING_BUDGET <= budget < req.max_tokens:
            raise APIError(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET} and less than max_tokens",
                param="thinking",
            )
    return replace(
        prompt,
        sampling=SamplingOptions(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
        stop=stop_list(req.stop_sequences, param="stop_sequences"),
        max_tokens=req.max_tokens,
        stream=bool(req.stream),
    )


def router() -> APIRouter:
    routes = APIRouter(route_class=AnthropicRoute)
    # (the API key and body-size checks run before any route, and answer in Anthropic's shape here too)
    errors = openapi.errors(400, 401, 404, 413, 500, 503, 529, model=openapi.AnthropicError)

    @routes.post("/v1/messages", responses=errors)
    async def messages(req: MessagesRequest, request: Request):
        server_state(request).check_model(req.model)
        ctx = server_state(request).require_ready()
        gen_req = messages_request(req)
        gens = await prepare(ctx, gen_req, "/v1/messages")
        return await answer(ctx, request, MessagesAdapter(ctx, gens[0], gen_req.stream))

    @routes.post("/v1/messages/count_tokens", responses=errors)
    async def count_tokens(req: CountTokensRequest, request: Request):
        server_state(request).check_model(req.model)
        # the very prompt /v1/messages would generate from (so a forced tool_choice's opened call counts too)
        ids, _ = await conversation_prompt(server_state(request).require_ready(), conversation_request(req))
        return {"input_tokens": len(ids)}

    return routes
