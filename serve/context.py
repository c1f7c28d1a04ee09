"""Serve stage: the typed context every request is served with: the loaded model (engine client, tokenizer, chat
template, control ids) and the server's settings, made once by ServerState.load()."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..runtime.backend import ImageSpan, SamplingParams
from ..runtime.client import Capabilities, OutputStream
from ..runtime.text.tokenizer import Tokenizer
from .chat_template import ChatTemplate
from .image_loader import ImageLoader
from .video_loader import VideoLoader
from .media import MediaOptions
from .metrics import Metrics
from .parser import ControlIds


class Engine(Protocol):
    """What the server drives: runtime.client.EngineClient, or the cluster's RemoteEngineClient."""

    @property
    def ready(self) -> bool: ...

    @property
    def capabilities(self) -> Capabilities: ...

    def health(self) -> dict[str, Any]: ...

    def submit(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        request_id: str | None = None,
        images: Sequence[ImageSpan] = (),
    ) -> OutputStream: ...

    def close(self) -> None: ...

    def end_all(self, reason: str) -> int: ...


@dataclass(frozen=True)
class ServerContext:
    """Everything a request reads, all of it loaded: no field is ever None for want of loading."""

    model_id: str  # the name answers carry
    client: Engine
    caps: Capabilities
    tokenizer: Tokenizer
    template: ChatTemplate
    stop_ids: frozenset[int]  # the checkpoint's end-of-turn / EOS ids
    controls: ControlIds
    decode: Callable[[list[int]], str]  # the tokenizer's decode, never raising
    max_token_chars: int  # the most characters one token decodes to (guards.prompt_ids' cheap bound)
    generation_defaults: dict[str, float]  # the checkpoint's sampler defaults (generation_config)
    tokenizer_info: dict[str, Any]  # GET /tokenizer_info's body
    media: MediaOptions
    images: ImageLoader  # reads, decodes and preprocesses requests' images off the event loop
    videos: VideoLoader  # reads, decodes and samples requests' videos off the event loop
    metrics: Metrics
    speculative: bool  # requests decode speculatively unless they say otherwise
    draft_tokens: int | None  # --draft-tokens: a speculative request's drafts per step, at most
