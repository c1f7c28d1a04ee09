"""Serve stage: the server's lifecycle state: loading the model on a thread (so /health can answer 503 meanwhile),
the ServerContext a loaded model gives every request, the served model names, and the engine's shutdown."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from fastapi import Request

from ..runtime.client import Capabilities
from ..runtime.process.malloc import Trimmer
from ..runtime.text.tokenizer import Tokenizer
from .chat_template import ChatTemplate, control_ids, describe_tokenizer, safe_decoder
from .context import Engine, ServerContext
from .guards import longest_token_chars
from .image_loader import ImageLoader
from .video_loader import VideoLoader
from .media import MediaOptions
from .metrics import Metrics
from .protocol import APIError

log = logging.getLogger("thorgen.serve")
Loader = Callable[[], tuple[Engine, Tokenizer, ChatTemplate, dict[str, Any]]]


class ServerState:
    """Filled by `load()`: `context` once the model is loaded (None before, or after a failed load).

    `loader()` returns (engine client, tokenizer, chat template, generation_config); the client has opened its
    backend on its own engine thread. `model_names`: the names requests may give as `model` (--served-model-name;
    default: `model_id`); answers carry the first, `model_id`. `speculative`: True / False, or None for exactly
    when the engine can (decided once loaded)."""

    def __init__(
        self,
        model_id: str,
        loader: Loader,
        speculative: bool | None = False,
        draft_tokens: int | None = None,
        model_names: Sequence[str] = (),
        media: MediaOptions = MediaOptions(),
    ) -> None:
        self.model_names = tuple(dict.fromkeys(model_names or (model_id,)))
        self.model_id = self.model_names[0]
        self.media = media  # how images are taken (budget, count, which URLs are fetched)
        self.loader = loader
        self.speculative = speculative
        self.draft_tokens = draft_tokens  # --draft-tokens N: a speculative request's drafts per step, at most
        self.metrics = Metrics(self.model_id)
        self.trimmer = Trimmer()  # free malloc pages back to the kernel every so many answers (serve/host_memory.py)
        self.load_error: str | None = None
        self.created = int(time.time())
        self.client: Engine | None = None  # set as soon as the loader returns (closed by close())
        self.context: ServerContext | None = None

    @property
    def caps(self) -> Capabilities | None:
        return self.context.caps if self.context is not None else None

    def load(self) -> None:
        try:
            client, tokenizer, template, gen_cfg = self.loader()
            self.client = client
            caps = client.capabilities
            speculative = caps.speculative if self.speculative is None else self.speculative
            if speculative and not caps.speculative:
                raise ValueError(
                    "speculative decoding was asked for but the engine cannot run it (no drafter, "
                    "or its kernels are missing)"
                )
            eos = gen_cfg.get("eos_token_id", [1, 106, 50])
            stop_ids = frozenset([eos] if isinstance(eos, int) else eos)
            self.context = ServerContext(
                model_id=self.model_id,
                client=client,
                caps=caps,
                tokenizer=tokenizer,
                template=template,
                stop_ids=stop_ids,
                controls=control_ids(tokenizer, stop_ids),
                decode=safe_decoder(tokenizer),
                max_token_chars=longest_token_chars(tokenizer),
                generation_defaults={k: gen_cfg[k] for k in ("temperature", "top_k", "top_p", "min_p") if k in gen_cfg},
                tokenizer_info=describe_tokenizer(tokenizer, template, gen_cfg, caps.max_context),
                media=self.media,
                images=ImageLoader(caps.vision, self.media),
                videos=VideoLoader(caps.vision, self.media),
                metrics=self.metrics,
                speculative=speculative,
                draft_tokens=self.draft_tokens,
            )
        except Exception as exc:  # reported by /health and by every request instead of killing the process
            # one line for the operator (`thorgen serve` prints it); the traceback only under --log-level debug
            log.debug("model loading failed", exc_info=True)
            self.load_error = f"{type(exc).__name__}: {exc}"

    def load_in_background(self) -> threading.Thread:
        t = threading.Thread(target=self.load, name="thorgen-load", daemon=True)
        t.start()
        return t

    def require_ready(self) -> ServerContext:
        """The loaded model's context, or a 503 saying why there is none (yet)."""
        if self.load_error:
            raise APIError(f"the model failed to load: {self.load_error}", status=503, type="server_error")
        if self.context is None:
            raise APIError(
                "the model is still loading; retry shortly (GET /health turns 200 when ready)",
                status=503,
                type="server_error",
            )
        if not self.context.client.ready:
            raise APIError(
                f"the engine stopped ({self.context.client.health().get('error')}); restart the server",
                status=503,
                type="server_error",
            )
        return self.context

    def check_model(self, name: str | None) -> None:
        """A request's `model`: one of the served names (or none given, as this server has always accepted)."""
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise APIError(
                f"the model {name!r} does not exist; this server serves {served}",
                status=404,
                param="model",
                type="not_found_error",
                code="model_not_found",
            )

    def end_requests(self, reason: str) -> int:
        """End every running and queued request with a 503 carrying `reason` (streams: an error event, then
        [DONE]); how many there were."""
        return self.client.end_all(reason) if self.client is not None else 0

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.context is not None:
            self.context.images.close()
            self.context.videos.close()


def server_state(request: Request) -> ServerState:
    """The ServerState of the app serving `request` (create_app puts it there)."""
    state: ServerState = request.app.state.server
    return state
