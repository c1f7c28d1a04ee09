"""Test support (not a test module): the tiny checkpoint served on the reference backend, for the openai client."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def tiny_server(
    checkpoint: Path, ctx: int, speculative: bool | None = False, media=None, drafts=None, **app_options
) -> Iterator[tuple[str, object]]:
    """(base URL, ServerState) of a running server (`media`: its MediaOptions; `drafts`: the engine's DraftOptions;
    `app_options`: create_app's, e.g. api_key); closed on exit."""
    from thorgen.runtime.api import DraftOptions, EngineConfig
    from thorgen.serve.app import ServerState, create_app
    from thorgen.serve.cli import open_model
    from thorgen.serve.media import MediaOptions
    from scripted_backend import TEST_MODEL_NAMES, running_server

    state = ServerState(
        "tiny",
        lambda: open_model(EngineConfig(checkpoint, "reference", ctx, drafts=drafts or DraftOptions())),
        speculative=speculative,
        model_names=("tiny", *TEST_MODEL_NAMES),
        media=media or MediaOptions(),
    )
    state.load()
    assert state.load_error is None, state.load_error
    try:
        with running_server(create_app(state, **app_options)) as url:
            yield url, state
    finally:
        state.close()


def openai_client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
