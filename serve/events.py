"""Serve stage: the API-neutral events a generation's output becomes, which each API's adapter writes in its own shapes.

Per choice they come in output order: each engine step's text, reasoning and tool-call events, then that step's
`Tokens`; after the last step, the flushed output, `Usage` and `Finish`. An `Error` instead ends the choice (and the
request). No event names an API: ids carry no API prefix, the finish reason is `FinishReason`'s.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Union

from ..runtime.backend import TokenLogprob
from .protocol import APIError

ScoredToken = tuple[int, Union[TokenLogprob, None]]  # a token id and its logprob (None: the prompt's first token)


class FinishReason(enum.Enum):
    """Why a generation ended."""

    STOP = "stop"  # the model ended its turn (a stop id)
    LENGTH = "length"  # the token budget ran out
    TOOL_CALLS = "tool_calls"  # the answer called tools (and ended after its calls)
    STOP_SEQUENCE = "stop_sequence"  # a stop string matched (Finish.stop_sequence says which)
    CANCELLED = "cancelled"  # the engine ended it early for no reason of its own


@dataclass(frozen=True)
class TextDelta:
    """A piece of the answer's text."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the thought channel's text."""

    text: str


@dataclass(frozen=True)
class ToolCallBegin:
    """A tool call starts; `id` is unique on this server (each API prefixes it its own way)."""

    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    """A piece of the open call's arguments, JSON text."""

    id: str
    delta: str


@dataclass(frozen=True)
class ToolCallEnd:
    """The call's arguments are complete."""

    id: str


@dataclass(frozen=True)
class Tokens:
    """The token ids one engine step added (after the events they made). `scored`: the (token, logprob) entries
    of this step when the request asked for logprobs (an echoed prompt's first); `prompt_scores`: the prompt's
    logprobs, on the first step of a request that asked for vLLM's prompt_logprobs."""

    ids: tuple[int, ...]
    scored: tuple[ScoredToken, ...] = ()
    prompt_scores: tuple[TokenLogprob | None, ...] | None = None


@dataclass(frozen=True)
class Usage:
    """What the generation cost: its prompt (of which `cached_tokens` came from the prefix cache) and output tokens
    (of which `reasoning_tokens` were in the thought channel, its delimiters included)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True)
class Finish:
    reason: FinishReason
    stop_sequence: str | None = None  # the stop string that ended the answer (reason STOP_SEQUENCE)


@dataclass(frozen=True)
class Error:
    """The generation failed after it started: the error its API reports in its own shape."""

    error: APIError


OutputEvent = Union[TextDelta, ReasoningDelta, ToolCallBegin, ToolCallArguments, ToolCallEnd]  # the parser's
Event = Union[OutputEvent, Tokens, Usage, Finish, Error]
