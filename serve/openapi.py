"""Serve stage: the OpenAPI document, made to say what the server does: 400 (not FastAPI's 422) for invalid
requests with the OpenAI error model, every other error status it sends, SSE for streamed generations, and the
served model names as the only values `model` may take."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pydantic import BaseModel

from .protocol import ErrorResponse
from .schema_limits import bound_token_ids

_WHY = {
    400: "Invalid request (malformed JSON, a schema violation, or a request the model cannot serve)",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    404: "No such model",
    413: "The request body is larger than the server's limit (--max-body-mb)",
    429: "The engine's queue is full; retry later",
    500: "The engine failed while generating",
    503: "The model is still loading, failed to load, or the engine stopped",
    529: "The engine's queue is full; retry later (Anthropic's 'overloaded')",
}
SSE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The body of every 4xx/5xx answer of the Messages API (Anthropic's shape)."""

    type: str
    error: AnthropicErrorDetail


def errors(*statuses: int, model: type[BaseModel] = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: these statuses, each with the OpenAI error body (or `model`)."""
    return {status: {"model": model, "description": _WHY[status]} for status in statuses}


class Served(NamedTuple):
    """What the document says of the running server: the names `model` may give, and, once the model is loaded
    (None before), its vocabulary's size and whether it can decode speculatively."""

    model_names: Sequence[str] = ()
    vocab_size: int | None = None
    speculative: bool | None = None


def install(app: FastAPI, served: Callable[[], Served] = Served) -> None:
    """Replace app.openapi with the corrected document (built on first request, and kept once the model is loaded:
    before, the limits it brings are not known yet)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            now = served()
            schema = corrected(
                get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes),
                now,
            )
            if now.vocab_size is None:
                return schema
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _served_models(schema: dict, names: Sequence[str]) -> None:
    """Each request body's `model` and the model path parameter list the served names (others are a 404)."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        model = component.get("properties", {}).get("model") if component.get("title", "").endswith("Request") else None
        for branch in [model, *(model or {}).get("anyOf", [])] if model else []:
            if branch.get("type") == "string":
                branch["enum"] = list(names)
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            for parameter in operation.get("parameters", []):
                if parameter.get("name") == "model_id":
                    parameter["schema"]["enum"] = list(names)


def _no_speculation(schema: dict) -> None:
    """A request's num_speculative_tokens can only be 0 on a server that cannot decode speculatively."""
    for component in schema.get("components", {}).get("schemas", {}).values():
        field = component.get("properties", {}).get("num_speculative_tokens")
        for branch in [field, *(field or {}).get("anyOf", [])] if field else []:
            if branch.get("type") == "integer":
                branch["maximum"] = 0


def corrected(schema: dict, served: Served = Served()) -> dict:
    for path, item in schema.get("paths", {}).items():
        for operation in item.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)  # validation errors are answered with 400 (OpenAI's convention)
            ok = responses.get("200", {}).get("content")
            if path in SSE_PATHS and ok is not None:
                # One event (how schemathesis and OpenAPI 3.2's itemSchema read an event stream's schema): the
                # body is a sequence of them, each 'data: <JSON chunk>', the last 'data: [DONE]'.
                ok["text/event-stream"] = {
                    "schema": {
                        "type": "object",
                        "required": ["data"],
                        "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                        "description": "with \"stream\": true: server-sent events, each 'data: <JSON chunk>', ending "
                        "with 'data: [DONE]'",
                    }
                }
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    if served.model_names:
        _served_models(schema, served.model_names)
    if served.speculative is False:
        _no_speculation(schema)
    bound_token_ids(schema, served.vocab_size)
    return schema
