"""Serve stage: the OpenAPI document, made to say what the server does: 400 (not FastAPI's 422) for invalid
requests with the OpenAI error model, every other error status it sends, and SSE for streamed generations."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pydantic import BaseModel

from .protocol import ErrorResponse

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


def install(app: FastAPI) -> None:
    """Replace app.openapi with the corrected document (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = corrected(
                get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            )
        return app.openapi_schema

    app.openapi = openapi


def corrected(schema: dict) -> dict:
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
    return schema
