"""Serve stage: the FastAPI application: routes, API key, CORS, OpenAI-style errors, health, model names and the
graceful shutdown (the model's loading: serve/state.py)."""

from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path
from typing import Any

import uvicorn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import anthropic_api, endpoints, openapi, render, responses_api
from .conversation import template_messages, validate_tools
from .guards import BodyLimitMiddleware, BugMiddleware, prompt_ids
from .host_memory import TrimMiddleware
from .metrics import CONTENT_TYPE, endpoint_of
from ..runtime.media.prompts import video_frames
from .pipeline import with_images, with_video_layout
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    TokenizerInfo,
    error_body,
    error_body_for,
    error_message,
)
from .request import ImageSource, VideoSampling, VideoSource
from .state import ServerState
from .tool_schemas import template_tools

log = logging.getLogger("thorgen.serve")
WEBUI = Path(__file__).with_name("webui.html")
DEFAULT_MAX_BODY = 8 << 20  # bytes; a full 64k-token conversation is well under 1 MB of JSON


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose graceful shutdown waits up to `deadline_s` for running requests, then ends those
    still running with an error (a stream gets an error event and its `data: [DONE]`, not a cut connection) and
    gives them `END_GRACE_S` to send it before uvicorn cancels what is left."""

    END_GRACE_S = 2.0

    def __init__(self, config: uvicorn.Config, state: ServerState, deadline_s: float) -> None:
        config.timeout_graceful_shutdown = deadline_s + self.END_GRACE_S
        super().__init__(config)
        self.state, self.deadline_s = state, deadline_s

    async def shutdown(self, sockets=None) -> None:
        def end() -> None:
            ended = self.state.end_requests(
                f"the server is shutting down (its --shutdown-timeout of {self.deadline_s:g} s passed)"
            )
            if ended:
                log.warning("shutdown deadline: ended %d running request(s)", ended)

        timer = asyncio.get_running_loop().call_later(self.deadline_s, end)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class APIKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which would hide client disconnects from streaming responses). The key
    comes as OpenAI sends it (`Authorization: Bearer KEY`) or as Anthropic's clients do (`x-api-key: KEY`)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            bearer = headers.get(b"authorization", b"")
            ok = hmac.compare_digest(bearer, b"Bearer " + self.key) or hmac.compare_digest(
                headers.get(b"x-api-key", b""), self.key
            )
            if not ok:
                response = JSONResponse(
                    error_body_for(
                        scope["path"],
                        401,
                        "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _param(loc: tuple) -> str | None:
    """Pydantic's error location as a field path: ('body', 'messages', 0, 'content') -> messages[0].content."""
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def create_app(
    state: ServerState,
    api_key: str | None = None,
    cors_origins: list[str] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY,
) -> FastAPI:
    app = FastAPI(
        title="thorgen", version="0.1.0", description="OpenAI-compatible server for Gemma-4 on the thorgen engine."
    )
    app.state.server = state
    openapi.install(
        app,
        lambda: openapi.Served(
            state.model_names,
            state.caps.vocab_size if state.caps else None,
            state.caps.speculative if state.caps else None,
        ),
    )
    # add_middleware puts each new one outside the previous: bug handler innermost, then the body limit (the
    # app never sees an oversized body), the malloc trim count (every answer counts, a refused one too), the key
    # check, and CORS outermost.
    app.add_middleware(BugMiddleware, on_error=lambda scope: state.metrics.request_done(endpoint_of(scope), 500))
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes)
    app.add_middleware(TrimMiddleware, trimmer=state.trimmer)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # added last = outermost: CORS headers also reach 401 answers, and preflights skip the key check
    if cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            allow_credentials="*" not in cors_origins,
        )

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        state.metrics.request_done(endpoint_of(request.scope), exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        state.metrics.request_done(endpoint_of(request.scope), 400)
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(error_body("the request body is not valid JSON"), status_code=400)
        params = [(err.get("ctx") or {}).get("field") or _param(tuple(err.get("loc", ()))) for err in errors]
        # msg only, never the input: it can be megabytes, and pydantic's messages already name what is wrong
        parts = [f"{param or 'body'}: {error_message(err)}" for param, err in zip(params, errors[:5])]
        if errors and errors[0].get("type") == "invalid_text":
            parts = [errors[0]["msg"]]
        return JSONResponse(
            error_body(
                "invalid request: " + "; ".join(parts),
                param=params[0] if params else None,
                code=errors[0].get("type") if errors else None,
            ),
            status_code=400,
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        # exc.headers carries e.g. Allow on a 405
        state.metrics.request_done(endpoint_of(request.scope), exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body_for(request.url.path, exc.status_code, str(exc.detail), type=kind),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if state.context is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        engine = state.context.client.health()
        if engine["status"] != "ok":
            return JSONResponse(engine, status_code=503)
        return engine | {"caches": cache_bytes(engine)}

    def cache_bytes(engine: dict) -> dict[str, int]:
        """Host bytes of the bounded caches: the engine's (health()'s caches) and the preprocessed images'."""
        out = dict(engine.get("caches", {}))
        if state.context is not None:
            out["preprocessed_images_bytes"] = state.context.images.cache.bytes
        return out

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        engine = state.client.health() if state.client is not None else {}
        state.metrics.running, state.metrics.queued = engine.get("running", 0), engine.get("queued", 0)
        body = state.metrics.render(
            engine.get("steps"), engine.get("kv"), engine.get("gpu_memory_used"), cache_bytes(engine)
        )
        return Response(body, media_type=CONTENT_TYPE)

    app.include_router(render.router)  # the web UI's markdown rendering, highlighting stylesheet and favicon

    @app.get("/", response_class=HTMLResponse)
    async def webui():
        return HTMLResponse(WEBUI.read_text(encoding="utf-8"))

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "thorgen",
            "root": state.model_id,
            "max_model_len": state.caps.max_context if state.caps else None,
        }

    @app.get("/v1/models", responses=openapi.errors(401))
    async def models():
        return {"object": "list", "data": [model_card(name) for name in state.model_names]}

    # `:path`: model ids may contain '/' (the openai client puts them into the URL unescaped)
    @app.get("/v1/models/{model_id:path}", responses=openapi.errors(401, 404))
    async def model(model_id: str):
        state.check_model(model_id)
        return model_card(model_id)

    generating = openapi.errors(400, 401, 404, 413, 429, 500, 503)

    @app.post("/v1/chat/completions", responses=generating)
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        state.check_model(req.model)
        return await endpoints.chat_completions(state.require_ready(), req, request)

    @app.post("/v1/completions", responses=generating)
    async def completions(req: CompletionRequest, request: Request):
        state.check_model(req.model)
        return await endpoints.completions(state.require_ready(), req, request)

    app.include_router(anthropic_api.router())
    app.include_router(responses_api.router())

    @app.post("/tokenize", responses=openapi.errors(400, 413, 503))
    async def tokenize(req: TokenizeRequest):
        ctx = state.require_ready()
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' or 'messages'")
        checked = validate_tools(req.tools)  # (a 400 for a bad tool with either form, as the schema says)
        if req.messages is not None:
            thinking = (req.chat_template_kwargs or {}).get("enable_thinking", False)
            images: list[ImageSource] = []
            videos: list[VideoSource] = []
            messages = template_messages(req.messages, images, videos)
            tools = template_tools(checked)
            clips = await ctx.videos.load(videos, VideoSampling())  # the default sampling, as a chat request's
            ids = await prompt_ids(
                ctx,
                lambda: with_video_layout(
                    ctx,
                    ctx.template.render(
                        messages,
                        tools,
                        add_generation_prompt=req.add_generation_prompt is not False,
                        enable_thinking=thinking is True,
                    ),
                    clips,
                ),
            )
            ids, _ = await with_images(ctx, images, None, ids, frames=video_frames(clips))  # the server's budget
        else:
            bos, prompt = ctx.template.bos_token, req.prompt
            add = req.add_special_tokens is not False and not prompt.startswith(bos)
            ids = await prompt_ids(ctx, lambda: (bos if add else "") + prompt, param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": ctx.caps.max_context}

    @app.post("/detokenize", responses=openapi.errors(400, 413, 503))
    async def detokenize(req: DetokenizeRequest):
        ctx = state.require_ready()
        bad = [t for t in req.tokens if not 0 <= t < ctx.tokenizer.vocab_size]
        if bad:
            raise APIError(
                f"token ids {bad[:5]} are outside the vocabulary 0..{ctx.tokenizer.vocab_size - 1}", param="tokens"
            )
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=openapi.errors(503))
    async def tokenizer_info():
        return state.require_ready().tokenizer_info

    return app
