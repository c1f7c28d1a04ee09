"""Serve stage: OpenAI's Responses API, stateless (POST /v1/responses): its request schema and its translation into
a GenerationRequest; serve/responses_format.py writes the answers. Nothing is stored, so whatever needs a stored
response (previous_response_id, conversation, background, item references) is refused with a 400."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal, Union

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field, StrictBool

from . import openapi
from . import schema_limits as limits
from .answer import answer
from .pipeline import prepare
from .protocol import (
    REASONING_EFFORTS,
    APIError,
    ContentPart,
    FunctionCall,
    FunctionDef,
    Message,
    Integer,
    Number,
    Tool,
    ToolCallIn,
    _Body,
    _Open,
    integer,
)
from .conversation import image_source, template_messages, tool_choice_mode, validate_tools
from .request import GenerationRequest, ImageSource, OutputFormat, SamplingOptions
from .responses_format import ResponsesAdapter
from .state import server_state

# fields that need state or features this server does not have: refused when set (and not false / empty)
REFUSED = {
    "previous_response_id": "stored responses (this server keeps none; send the whole conversation)",
    "conversation": "stored conversations (this server keeps none; send the whole conversation)",
    "background": "background responses",
    "prompt": "stored prompt templates",
    "include": "extra output (encrypted reasoning, logprobs, sources)",
    "top_logprobs": "logprobs",
    "max_tool_calls": "a cap on tool calls",
}


UNSET: dict[str, Any] = {"enum": [None, False, []]}  # what a refused field may hold: nothing


class Reasoning(_Open):
    effort: str | None = None
    summary: str | None = None  # accepted: the reasoning comes back whole, as the reasoning item's content
    generate_summary: str | None = None


class TextConfig(_Open):
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None  # Gemma has one verbosity


class ResponsesRequest(_Body):
    # unknown fields are refused: any of OpenAI's fields this server does not know could change the answer
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: Union[str, list[dict[str, Any]]] = Field(json_schema_extra=limits.RESPONSES_ITEMS)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=limits.RESPONSES_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = Field(None, json_schema_extra=limits.RESPONSES_TOOL_CHOICE)
    parallel_tool_calls: StrictBool | None = None
    reasoning: Reasoning | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    seed: Integer | None = None  # (not in OpenAI's Responses API; vLLM's and chat's: reproducible sampling)
    text: TextConfig | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: there is none to include
    store: StrictBool | None = None  # nothing is stored, whatever it says; answers say store: false
    truncation: Literal["disabled"] | None = None  # "auto" (dropping earlier input) is not done here
    # accepted and ignored: they do not change the answer
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache needs no key
    service_tier: str | None = None
    # REFUSED when set (a 400 naming each); the document says which values pass
    previous_response_id: str | None = Field(None, json_schema_extra={"not": {"type": "string"}})
    conversation: Any = Field(None, json_schema_extra=UNSET)
    background: StrictBool | None = Field(None, json_schema_extra={"not": {"const": True}})
    prompt: Any = Field(None, json_schema_extra=UNSET)
    include: list[str] | None = Field(None, json_schema_extra={"maxItems": 0})
    top_logprobs: integer(ge=0, le=20) | None = Field(None, json_schema_extra={"maximum": 0})
    max_tool_calls: integer(ge=1) | None = Field(None, json_schema_extra={"not": {"type": "integer"}})


def _text(
    content: Any, where: str, allowed: tuple[str, ...], image_fields: list[str] | None = None
) -> str | list[ContentPart]:
    """A message's content: its text parts joined, or (with `image_fields`, a user message) text and image parts
    in order when it holds an input_image (whose places are appended to `image_fields`)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content must be a string or a list of content parts", param="input")
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        kind, at = part.get("type") if isinstance(part, dict) else None, f"{where}.content[{j}]"
        if kind == "input_image" and image_fields is not None:
            if part.get("file_id") is not None or part.get("image_url") is None:
                raise APIError(
                    f"{at}: an input_image needs an image_url (a data: or http(s) URL); file_id needs "
                    "stored files, which this server does not keep",
                    param="input",
                )
            try:
                source = image_source(part.get("image_url"), part.get("detail"), at, param="input")
            except APIError as exc:
                raise APIError(f"{exc.message} (the input_image's image_url or detail)", param="input") from None
            parts.append(ContentPart(type="image_url", image_url={"url": source.url, "detail": part.get("detail")}))
            image_fields.append(at)
            continue
        if kind in ("input_video", "video_url", "video"):
            raise APIError(
                f"{at}: video input is not supported by the Responses API; send it to /v1/chat/completions as a "
                "video_url content part",
                param="input",
            )
        if kind in ("input_image", "input_file", "input_audio"):
            raise APIError(
                f"{at}: {kind} is not supported {'here' if kind == 'input_image' else 'by this server'}", param="input"
            )
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise APIError(f"{at} must be a text part ({' or '.join(allowed)} with a 'text')", param="input")
        parts.append(ContentPart(type="text", text=part["text"]))
    if any(part.type == "image_url" for part in parts):
        return parts
    return "".join(part.text for part in parts)


def _items(items: list[dict[str, Any]], image_fields: list[str]) -> list[Message]:
    """Input items -> chat messages: function_call items become the assistant's tool_calls (joined to the
    assistant message just before them), function_call_output items `tool` messages; reasoning items are
    dropped (the chat template leaves earlier reasoning out of the prompt)."""
    out: list[Message] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"{where}.role must be user, assistant, system or developer", param="input")
            allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            out.append(
                Message(
                    role=role,
                    content=_text(item.get("content"), where, allowed, image_fields if role == "user" else None),
                )
            )
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise APIError(
                    f"{where}: a function_call item needs call_id, name and arguments (strings)", param="input"
                )
            call = ToolCallIn(id=call_id, function=FunctionCall(name=name, arguments=args))
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(Message(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output, call_id = item.get("output"), item.get("call_id")
            if not isinstance(call_id, str):
                raise APIError(f"{where}: a function_call_output item needs its call_id", param="input")
            out.append(
                Message(
                    role="tool",
                    tool_call_id=call_id,
                    content=output if isinstance(output, str) else _text(output, where, ("input_text",)),
                )
            )
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise APIError(
                f"{where}: item references need stored responses, which this server does not keep", param="input"
            )
        else:
            raise APIError(f"{where}: input item type {kind!r} is not supported", param="input")
    return out


def _tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    declared = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise APIError(
                f"tools[{i}]: only function tools are supported (built-in tool {tool.get('type')!r} is not)",
                param="tools",
            )
        if not isinstance(tool.get("name"), str):
            raise APIError(f"tools[{i}].name must be a string", param="tools")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"tools[{i}].parameters must be a JSON schema object", param="tools")
        declared.append(
            Tool(function=FunctionDef(name=tool["name"], description=tool.get("description"), parameters=params))
        )
    return validate_tools(declared)


def _tool_choice(choice: str | dict | None, tools: list[dict] | None) -> tuple[str, str | None]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                param="tool_choice",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tool_choice_mode(choice, tools)


def _format(text: TextConfig | None) -> OutputFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return OutputFormat("json_object", param="text.format")
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(
            "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': 'json_schema', "
            "'name': ..., 'schema': {...}}",
            param="text.format",
        )
    if not isinstance(fmt.get("strict", False), (bool, type(None))):
        raise APIError("text.format.strict must be true or false", param="text.format")
    return OutputFormat("json_schema", fmt["schema"], "text.format")


def thinking(reasoning: Reasoning | None) -> bool:
    effort = reasoning.effort if reasoning is not None else None
    if effort is None:
        return False
    if effort not in REASONING_EFFORTS:
        raise APIError(f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}", param="reasoning")
    return REASONING_EFFORTS[effort]


def response_request(req: ResponsesRequest) -> GenerationRequest:
    for name, what in REFUSED.items():
        if getattr(req, name) not in (None, False, []):
            raise APIError(f"{name}: {what} is not supported by this server", param=name)
    image_fields: list[str] = []  # each input_image's place in this request (errors name it)
    if isinstance(req.input, str):
        messages = [Message(role="user", content=req.input)]
    else:
        messages = _items(req.input, image_fields)
    if req.instructions:
        messages.insert(0, Message(role="system", content=req.instructions))
    tools = _tools(req.tools)
    mode, forced = _tool_choice(req.tool_choice, tools)
    images: list[ImageSource] = []
    templated = template_messages(messages, images)
    images = [replace(source, where=where) for source, where in zip(images, image_fields)]
    return GenerationRequest(
        messages=templated,
        images=images,
        tools=tools,
        tool_mode=mode,
        forced_tool=forced,
        parallel_tool_calls=req.parallel_tool_calls is not False,
        thinking=thinking(req.reasoning),
        sampling=SamplingOptions(temperature=req.temperature, top_p=req.top_p, seed=req.seed),
        output_format=_format(req.text),
        max_tokens=req.max_output_tokens,
        stream=bool(req.stream),
        prompt_field="input",
        max_tokens_field="max_output_tokens",
    )


def echoed(req: ResponsesRequest) -> dict:
    """The request's settings as a response object repeats them."""
    fmt = (req.text.format if req.text is not None else None) or {"type": "text"}
    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": req.reasoning.summary if req.reasoning else None,
        },
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": fmt},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [],
        "metadata": req.metadata or {},
        "store": False,
        "truncation": "disabled",
    }


def router() -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses", responses=openapi.errors(400, 401, 404, 413, 429, 500, 503))
    async def responses(req: ResponsesRequest, request: Request):
        server_state(request).check_model(req.model)
        ctx = server_state(request).require_ready()
        gen_req = response_request(req)
        gens = await prepare(ctx, gen_req, "/v1/responses")
        return await answer(ctx, request, ResponsesAdapter(ctx, gens[0], gen_req.stream, echoed(req)))

    return routes
