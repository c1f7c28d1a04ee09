"""Serve stage: OpenAI request schemas, their validation, and OpenAI-style error objects."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, model_validator
from pydantic_core import PydanticCustomError

from ..runtime.media.images import SOFT_TOKEN_BUDGETS
from .request import ImageSource

# Numbers are typed as JSON Schema types them. StrictFloat takes JSON integers too but no booleans or numeric
# strings; a plain (non-union) type also lets pydantic write bounds as JSON Schema's minimum/maximum.
Number = StrictFloat


def _no_coercion(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def integer(**bounds: int) -> Any:
    """JSON Schema's integer includes 2.0, so an integral float passes (as lax int allows); booleans and strings
    do not. The bounds go before the validator, or pydantic would write them as non-standard ge/le."""
    return Annotated[int, Field(**bounds), BeforeValidator(_no_coercion)]


Integer = integer()
# image_url.detail: "low" takes the smallest soft-token budget, "auto" and "high" the request's (or the server's)
DETAIL_BUDGETS = {"auto": None, "high": None, "low": SOFT_TOKEN_BUDGETS[0]}
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """Becomes `{"error": {...}}` with this HTTP status (always 4xx for anything the client can fix)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer (OpenAI's shape)."""

    error: ErrorDetail


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Open(BaseModel):
    # Unknown fields are accepted (clients send many harmless extras); fields that would change the output and
    # that we do not implement are rejected explicitly in `check_unsupported`.
    model_config = ConfigDict(extra="allow")


def _find_surrogate(value: Any, path: str) -> tuple[str, int, str] | None:
    """(field path, index, char) of the first lone surrogate in any string or key of a parsed JSON value."""
    if isinstance(value, str):
        m = _SURROGATE.search(value)
        return (path or "body", m.start(), m.group()) if m else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = f"{path}.{key}" if path else str(key)
            found = _find_surrogate(key, name) or _find_surrogate(item, name)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _find_surrogate(item, f"{path}[{i}]")
            if found:
                return found
    return None


class _Body(_Open):
    """A request body. JSON's \\uXXXX escapes can spell lone UTF-16 surrogates, which are not Unicode text: the
    tokenizer and the UTF-8 response encoder would fail on them, so they are refused up front, naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        found = _find_surrogate(data, "")
        if found:
            field, index, char = found
            field = field.encode("utf-8", "backslashreplace").decode()  # a key can hold the surrogate itself
            raise PydanticCustomError("invalid_text", "{field} contains a lone surrogate U+{code} at index {index}; "
                                      "text must be valid Unicode",
                                      {"field": field, "code": f"{ord(char):04X}", "index": index})
        return data


class ImageURL(_Open):
    url: str
    detail: str | None = None  # DETAIL_BUDGETS


class ContentPart(_Open):
    """A content part: text, image_url ({"url", "detail"?} or a URL string), or image ("url" or "image": a URL)."""

    type: str
    text: str | None = None
    image_url: Union[ImageURL, str, None] = None
    url: str | None = None
    image: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Open):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: str = "function"
    function: FunctionDef


class StreamOptions(_Open):
    include_usage: StrictBool | None = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: integer(ge=1) | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None
    min_p: Number | None = Field(default=None, ge=0, le=1)
    seed: Integer | None = None
    stop: Union[str, list[str], None] = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: integer(ge=1) | None = 1  # choices: that many sequences of the prompt (serve/generation.py: choices)
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: Number | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    response_format: Any = None
    # vLLM's extension: each choice also carries the generated `token_ids` (streamed: each chunk's own ids)
    # and the `prompt_token_ids` the engine saw.
    return_token_ids: StrictBool | None = False
    # vLLM's speculative setting, per request: at most this many drafts a step (DFlash proposes up to 15); 0 turns
    # speculative decoding off for this request; absent: the server's --draft-tokens
    num_speculative_tokens: integer(ge=0, le=15) | None = None
    # vLLM's sampling extras (serve/vllm_extras.py turns them into engine values)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[Integer] | None = None
    min_tokens: integer(ge=0) | None = None
    prompt_logprobs: integer(ge=0, le=20) | None = None
    truncate_prompt_tokens: integer(ge=-1) | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # which library: the one grammar library here serves any


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[FunctionDef] | None = None  # OpenAI's deprecated form of tools / tool_choice
    function_call: Union[str, dict[str, Any], None] = None
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: {"max_soft_tokens": 70..1120} per image


class CompletionRequest(_Sampling):
    # one prompt (text or token ids) or several (texts or token-id lists): OpenAI's four forms
    prompt: Union[str, list[str], list[Integer], list[list[Integer]]]
    max_tokens: integer(ge=0) | None = None  # 0: score the prompt only (needs echo; serve/endpoints.py)
    echo: StrictBool | None = False
    suffix: str | None = None
    best_of: Integer | None = None


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    tokens: list[Integer]


class TokenizerInfo(_Open):
    """GET /tokenizer_info (vLLM's, read by lm-eval's RemoteTokenizer): the special tokens as text, the chat
    template the server renders, and the context length."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    chat_template: str
    model_max_length: int
    vocab_size: int


# --- semantic checks ---------------------------------------------------------------------------------------
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")
MAX_N = 16  # choices per request (each its own engine sequence)
MAX_CHOICES = 64  # prompts x n of one completions request: bounds the engine work one request can queue
REASONING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def check_unsupported(req: _Sampling) -> None:
    """Fields whose effect we do not implement are refused with a 400 instead of being silently ignored (the
    sampling fields are checked where serve/sampling.py and serve/structured.py read them)."""
    if req.n is not None and req.n > MAX_N:
        raise APIError(f"n={req.n}: at most {MAX_N} choices per request", param="n")


def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise APIError("at most 16 stop sequences", param="stop")
    return [s for s in stops if s]


def image_source(url: Any, detail: Any, where: str, param: str = "messages") -> ImageSource:
    """An image part's URL and detail, checked (its bytes are read later, once per request)."""
    if not isinstance(url, str) or not url:
        raise APIError(f"{where}: the image URL must be a non-empty string", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("data", "http", "https"):
        raise APIError(f"{where}: an image URL is a data: URL (data:image/png;base64,...) or an http(s) URL; got "
                       f"{url[:40]!r}", param=param)
    if detail is not None and detail not in DETAIL_BUDGETS:
        raise APIError(f"{where}: detail must be one of {', '.join(DETAIL_BUDGETS)}; got {detail!r}", param=param)
    return ImageSource(url, where, DETAIL_BUDGETS.get(detail))


def _image_of(part: ContentPart, where: str) -> ImageSource | None:
    """The image a part names, or None for a text part; a 400 for any other part."""
    if part.type == "text" and part.text is not None:
        return None
    if part.type == "image_url" and part.image_url is not None:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return image_source(url, None if isinstance(part.image_url, str) else part.image_url.detail, where)
    if part.type == "image" and (part.url or part.image):
        return image_source(part.url or part.image, None, where)
    raise APIError(f"{where}: a content part is text ({{'type': 'text', 'text': ...}}) or an image "
                   f"({{'type': 'image_url', 'image_url': {{'url': ...}}}}); got type {part.type!r}",
                   param="messages")


def _content(m: Message, i: int, images: list[ImageSource] | None) -> str | list[dict] | None:
    """A message's content for the template: a string, or (a user message with images) text and {"type": "image"}
    parts in order, each image's source appended to `images` (None: images are refused here)."""
    if not isinstance(m.content, list):
        return m.content
    parts = [(part, _image_of(part, f"messages[{i}].content[{j}]")) for j, part in enumerate(m.content)]
    found = [source for _, source in parts if source is not None]
    if not found:
        return "".join(part.text for part, _ in parts)
    if images is None:
        raise APIError(f"{found[0].where}: this endpoint does not take images", param="messages")
    if m.role != "user":
        raise APIError(f"{found[0].where}: images are accepted in user messages only (not {m.role!r})",
                       param="messages")
    images += found
    return [{"type": "image"} if source is not None else {"type": "text", "text": part.text}
            for part, source in parts]


def validate_tools(tools: list[Tool] | None) -> list[dict] | None:
    if not tools:
        return None
    seen = set()
    out = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if tool.type != "function":
            raise APIError(f"tools[{i}].type must be 'function'", param="tools")
        if not _TOOL_NAME.fullmatch(fn.name):
            raise APIError(f"tools[{i}].function.name {fn.name!r} must match [A-Za-z0-9_.-]{{1,64}}", param="tools")
        if fn.name in seen:
            raise APIError(f"tool name {fn.name!r} is declared twice", param="tools")
        seen.add(fn.name)
        params = fn.parameters
        if params is not None:
            if params.get("type", "object") != "object":
                raise APIError(f"tools[{i}].function.parameters must be a JSON schema of type 'object'",
                               param="tools")
            if not isinstance(params.get("properties", {}), dict):
                raise APIError(f"tools[{i}].function.parameters.properties must be an object", param="tools")
        d = {"name": fn.name, "description": fn.description or ""}
        if params is not None:
            d["parameters"] = params
        out.append({"type": "function", "function": d})
    return out


def tool_choice_mode(choice: str | dict | None, tools: list[dict] | None) -> tuple[str, str | None]:
    """-> (mode, forced name) with mode in none/auto/required/named."""
    names = [t["function"]["name"] for t in tools or []]
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError("tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice")
        if choice == "required" and not names:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return (choice if names else "none"), None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not among the declared tools", param="tool_choice")
    return "named", name


def _arguments(call: ToolCallIn, i: int) -> dict | str:
    args = call.function.arguments
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        raise APIError(f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not valid JSON",
                       param="messages") from None
    if not isinstance(parsed, dict):
        raise APIError(f"messages[{i}].tool_calls: arguments must be a JSON object", param="messages")
    return parsed


def template_messages(messages: list[Message], images: list[ImageSource] | None = None) -> list[dict]:
    """OpenAI messages -> the dicts Gemma's template expects: text parts joined (or, in a user message with
    images, text and {"type": "image"} parts, the images' sources appended to `images`; None refuses images),
    tool-call arguments as mappings, and `role: "tool"` results folded into the preceding assistant message as
    `tool_responses` (the form Google's template renders inside the model turn)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    out: list[dict] = []
    owner: dict | None = None  # the assistant message that tool results attach to
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}", param="messages")
        content = _content(m, i, images)
        if m.role == "tool":
            if owner is None:
                raise APIError(f"messages[{i}]: a 'tool' message must follow an assistant message with tool_calls",
                               param="messages")
            name = m.name or "unknown"
            for call in owner.get("_ids", []):
                if m.tool_call_id is not None and call[0] == m.tool_call_id:
                    name = call[1]
            owner.setdefault("tool_responses", []).append({"name": name, "response": content or ""})
            continue
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(f"messages[{i}].content is required for role {m.role!r}", param="messages")
        d: dict = {"role": m.role, "content": content}
        owner = None
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _arguments(c, i)}}
                               for c in m.tool_calls]
            d["_ids"] = [(c.id, c.function.name) for c in m.tool_calls]
            owner = d
        out.append(d)
    for d in out:
        d.pop("_ids", None)
    return out
