"""Serve stage: the Messages API's errors in Anthropic's shape: a route class that answers validation errors, the
server's own 4xx and a bug's 500 as `{"type": "error", "error": {"type", "message"}}`, at Anthropic's statuses."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

from .metrics import endpoint_of
from .protocol import APIError, anthropic_error_body, error_message
from .state import server_state

log = logging.getLogger("thorgen.serve")


def error_response(status: int, message: str) -> JSONResponse:
    """Anthropic's error shape, at Anthropic's status for it (a full queue is 529)."""
    status = 529 if status == 429 else status
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


def _invalid(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if any(err.get("type") == "json_invalid" for err in errors):
        return "the request body is not valid JSON"
    if errors and errors[0].get("type") == "invalid_text":
        return errors[0]["msg"]
    parts = []
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        parts.append(f"{'.'.join(loc) or 'body'}: {error_message(err)}")
    return "invalid request: " + "; ".join(parts)


class AnthropicRoute(APIRoute):
    """A route whose errors (validation and the server's own) are answered in Anthropic's shape."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            metrics = server_state(request).metrics
            try:
                return await handler(request)
            except RequestValidationError as exc:
                metrics.request_done(endpoint_of(request.scope), 400)
                return error_response(400, _invalid(exc))
            except APIError as exc:
                metrics.request_done(endpoint_of(request.scope), exc.status)
                return error_response(exc.status, exc.message)
            except HTTPException as exc:  # e.g. a body that is not JSON at all
                metrics.request_done(endpoint_of(request.scope), exc.status_code)
                return error_response(exc.status_code, str(exc.detail))
            except Exception as exc:  # a bug: logged, and answered as Anthropic's api_error
                log.exception("unhandled error on %s", request.url.path)
                metrics.request_done(endpoint_of(request.scope), 500)
                return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

        return route
