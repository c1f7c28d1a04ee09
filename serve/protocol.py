"""Serve stage: OpenAI request schemas, their validation, and OpenAI-style error objects."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, model_validator
from pydantic_core import PydanticCustomError

from . import schema_limits as limits


# Numbers are typed as JSON Schema types them. StrictFloat takes JSON integers too but no booleans or numeric
# strings; a plain (non-union) type also lets pydantic write bounds as JSON Schema's minimum/maximum. NaN and the
# infinities (Python's json reads NaN, Infinity) are refused as such, not as out of some bound.
Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]


def error_message(err: Any) -> str:
    """A pydantic error's message as a 400 says it (NaN and the infinities: "must be a finite number")."""
    return "must be a finite number" if err.get("type") == "finite_number" else str(err.get("msg", "invalid"))


def _no_coercion(value: Any) -> Any:
    if isinstance(value, (bool, str)):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def integer(**bounds: int) -> Any:
    """JSON Schema's integer includes 2.0, so an integral float passes (as lax int allows); booleans and strings
    do not. The bounds go before the validator, or pydantic would write them as non-standard ge/le."""
    return Annotated[int, Field(**bounds), BeforeValidator(_no_coercion)]


Integer = integer()
# a token id: at least 0, and (the OpenAPI document says, once the model is loaded) below the vocabulary's size
TokenId = Annotated[int, Field(ge=0, json_schema_extra={limits.TOKEN_ID: True}), BeforeValidator(_no_coercion)]
_SURROGATE = re.compile("[\ud800-\udfff]")


class APIError(Exception):
    """Becomes `{"error": {...}}` with this HTTP status (always 4xx for anything the client can fix)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
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


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Anthropic's error types by HTTP status; the engine's full queue is Anthropic's 529 "overloaded"
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """Whether a request path is Anthropic's Messages API (whose errors take Anthropic's shape)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_body_for(
    path: str, status: int, message: str, type: str = "invalid_request_error", code: str | None = None
) -> dict:
    """The error body a client of the API at `path` expects: Anthropic's on /v1/messages, else OpenAI's."""
    return anthropic_error_body(status, message) if is_anthropic_path(path) else error_body(message, type, code=code)


class _Open(BaseModel):
    # Unknown fields are accepted (clients send many harmless extras); fields that would change the output and
    # that we do not implement are rejected explicitly in `check_unsupported`.
    model_config = ConfigDict(extra="allow")


def _find_surrogate(value: Any, path: str) -> tuple[str, int, str] | None:
    """(field path, index, char) of the first lone surrogate in any string or key of a parsed JSON value."""
    if isinstance(value, str):
        if value.isascii():  # O(1) in CPython: a long base64 image needs no regex scan on the event loop
            return None
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
            raise PydanticCustomError(
                "invalid_text",
                "{field} contains a lone surrogate U+{code} at index {index}; text must be valid Unicode",
                {"field": field, "code": f"{ord(char):04X}", "index": index},
            )
        return data


class ImageURL(_Open):
    url: str
    detail: str | None = None  # DETAIL_BUDGETS


class VideoURL(_Open):
    url: str


class ContentPart(_Open):
    """A content part: text, image_url ({"url", "detail"?} or a URL string), image ("url" or "image": a URL),
    video_url ({"url"} or a URL string) or video ("url" or "video": a URL)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=limits.CONTENT_PART)

    type: str
    text: str | None = None
    image_url: Union[ImageURL, str, None] = None
    url: str | None = None
    image: str | None = None
    video_url: Union[VideoURL, str, None] = None
    video: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Open):
    model_config = ConfigDict(extra="allow", json_schema_extra=limits.CONTENT_BY_ROLE)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(_Open):
    name: str = Field(json_schema_extra={"pattern": limits.TOOL_NAME})  # (serve/conversation.py's 400 names it)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"] = "function"  # (the schema states it: the only kind of tool OpenAI defines)
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
    # choices: that many sequences of the prompt (serve/generation.py: choices); at most MAX_N (its own 400 says so)
    n: integer(ge=1) | None = Field(1, json_schema_extra={"maximum": 16})
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    # 1: off; runtime/backend.py's range, its own 400 names it
    repetition_penalty: Number | None = Field(None, json_schema_extra={"minimum": 0.01, "maximum": 100})
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
    stop_token_ids: list[TokenId] | None = None
    min_tokens: integer(ge=0) | None = None
    prompt_logprobs: integer(ge=0, le=20) | None = None
    # -1: the context length; 0 is a 400 of its own (serve/vllm_extras.py)
    truncate_prompt_tokens: integer(ge=-1) | None = Field(None, json_schema_extra={"not": {"const": 0}})
    structured_outputs: dict[str, Any] | None = Field(None, json_schema_extra=limits.STRUCTURED_OUTPUTS)
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = Field(None, json_schema_extra={"minLength": 1})
    guided_choice: list[str] | None = Field(None, json_schema_extra=limits.GUIDED_CHOICE)
    guided_grammar: str | None = Field(None, json_schema_extra={"pattern": "\\S"})
    guided_whitespace_pattern: str | None = Field(None, json_schema_extra=limits.NULL_ONLY)  # (a 400 when set)
    guided_decoding_backend: str | None = None  # which library: the one grammar library here serves any


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(extra="allow", json_schema_extra=limits.TOOLS_OR_FUNCTIONS)
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[FunctionDef] | None = None  # OpenAI's deprecated form of tools / tool_choice
    function_call: Union[str, dict[str, Any], None] = Field(None, json_schema_extra=limits.FUNCTION_CALL)
    mm_processor_kwargs: dict[str, Any] | None = None  # vLLM's: max_soft_tokens (images, frames), num_frames, fps


class CompletionRequest(_Sampling):
    model_config = ConfigDict(extra="allow", json_schema_extra=limits.SCORE_NEEDS_ECHO)
    # one prompt (text or token ids) or several (texts or token-id lists): OpenAI's four forms
    # no list empty, the outer or an inner one (serve/endpoints.py's 400s name which)
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]] = Field(
        json_schema_extra={"minItems": 1, "items": {"minItems": 1}}
    )
    max_tokens: integer(ge=0) | None = None  # 0: score the prompt only (needs echo; serve/endpoints.py)
    echo: StrictBool | None = False
    # not supported (a 400 each, serve/endpoints.py), which the document states: no suffix text, best_of 1
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: Integer | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1})


class TokenizeRequest(_Body):
    model_config = ConfigDict(extra="allow", json_schema_extra=limits.PROMPT_OR_MESSAGES)
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    tokens: list[TokenId]


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
MAX_N = 16  # choices per request (each its own engine sequence)
MAX_CHOICES = 64  # prompts x n of one completions request: bounds the engine work one request can queue
REASONING_EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def check_unsupported(req: _Sampling) -> None:
    """Fields whose effect we do not implement are refused with a 400 instead of being silently ignored (the
    sampling fields are checked where serve/sampling.py and serve/structured.py read them)."""
    if req.n is not None and req.n > MAX_N:
        raise APIError(f"n={req.n}: at most {MAX_N} choices per request", param="n")


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 16:
        raise APIError(f"{param}: at most 16 stop sequences", param=param)
    return [s for s in stops if s]
