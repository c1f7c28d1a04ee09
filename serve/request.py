"""Serve stage: the one internal generation request that every API (chat, completions, Messages, Responses) is
translated into, and that serve/pipeline.py runs.

Every field is a plain value already checked by the translator that filled it (a bad value is that API's 400),
so the pipeline needs no knowledge of any wire format. New request options are new fields here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOOL_MODES = ("none", "auto", "required", "named")


@dataclass(frozen=True)
class SamplingOptions:
    """The request's sampler settings; None takes the checkpoint's generation_config default (as vLLM does)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Any = None  # OpenAI's {"token id": bias}, checked against the vocabulary by serve/sampling.py
    logprobs: int | None = None  # None: off; else top entries per token (0..20)
    num_speculative_tokens: int | None = None  # None: the server's setting; 0: off
    min_tokens: int = 0  # vLLM's: no stop id is sampled before this many output tokens
    prompt_logprobs: int | None = None  # vLLM's: None off, else top entries for each prompt token (0..20)


@dataclass(frozen=True)
class OutputFormat:
    """Structured output: "json_object" (any JSON object), "json_schema" (valid against `schema`) or "lark"
    (matching `grammar`, in llguidance's Lark: vLLM's guided regex, choice and grammar)."""

    kind: str
    schema: dict[str, Any] | None = None
    param: str = "response_format"  # the request field its errors name
    grammar: str | None = None


@dataclass(frozen=True)
class Prompt:
    """A raw prompt (completions): text (the BOS is added when missing) or token ids; `where` names its field."""

    where: str
    text: str | None = None
    ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ImageSource:
    """One image of a conversation as the request gave it, not yet read: a `data:` URL or an http(s) URL;
    `budget` its own soft-token budget (OpenAI's detail "low"), None for the request's; `where` names its field."""

    url: str
    where: str
    budget: int | None = None


@dataclass(frozen=True)
class VideoSource:
    """One video of a conversation as the request gave it, not yet read: a `data:` URL or an http(s) URL; `where`
    names its field."""

    url: str
    where: str


@dataclass(frozen=True)
class VideoSampling:
    """How a request's videos are sampled (vLLM's mm_processor_kwargs): `num_frames` or `fps` (None: up to 32
    frames spread over the clip) and the soft tokens per frame (None: the server's)."""

    num_frames: int | None = None
    fps: float | None = None
    budget: int | None = None


@dataclass
class GenerationRequest:
    """One request, whatever API it came from. Exactly one of `messages` (a conversation in the chat template's
    form: role/content dicts, assistant `tool_calls`, `tool_responses`) and `prompts` (raw prompts) is set."""

    messages: list[dict[str, Any]] | None = None
    prompts: list[Prompt] | None = None
    # the conversation's images in prompt order (each user message's {"type": "image"} parts, one each)
    images: list[ImageSource] = field(default_factory=list)
    image_budget: int | None = None  # soft tokens an image may take (vLLM's max_soft_tokens); None: the server's
    # the conversation's videos in prompt order (each user message's {"type": "video"} parts) and their sampling
    videos: list[VideoSource] = field(default_factory=list)
    video_sampling: VideoSampling = VideoSampling()
    tools: list[dict[str, Any]] | None = None  # OpenAI function tools: {"type": "function", "function": {name, ...}}
    tool_mode: str = "none"  # one of TOOL_MODES
    forced_tool: str | None = None  # the tool a "named" tool_mode calls
    parallel_tool_calls: bool = True  # False: the answer ends after its first call
    thinking: bool = False  # Gemma's thought channel on
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # further chat-template variables
    sampling: SamplingOptions = SamplingOptions()
    output_format: OutputFormat | None = None
    guided: OutputFormat | None = None  # vLLM's guided decoding (structured_outputs, guided_*)
    stop: list[str] = field(default_factory=list)  # stop strings (not part of the answer)
    stop_token_ids: tuple[int, ...] = ()  # vLLM's: more stop ids (their text is left out)
    ignore_eos: bool = False  # vLLM's: the checkpoint's EOS / end-of-turn ids do not stop the answer
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last N tokens (-1: the context length)
    max_tokens: int | None = None  # None: up to the context (or `default_max_tokens`)
    default_max_tokens: int | None = None  # the budget when max_tokens is absent (completions: 16), capped
    n: int = 1  # choices per prompt
    parse_output: bool = True  # reasoning and tool calls parsed out of the text (False: completions)
    echo: bool = False  # completions: the prompt text ahead of the output
    score_only: bool = False  # completions max_tokens 0: the prompt is scored, nothing is generated
    return_token_ids: bool = False  # vLLM's: token ids along with the text
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    # the text the answer continues (Anthropic's prefilled final assistant turn): it follows the generation prompt
    assistant_prefill: str | None = None
    # the wire names errors give the prompt and the token budget (Responses: input, max_output_tokens)
    prompt_field: str = "messages"
    max_tokens_field: str = "max_tokens"

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompts is None):
            raise ValueError("a GenerationRequest has messages or prompts, not both or neither")
        if self.tool_mode not in TOOL_MODES:
            raise ValueError(f"tool_mode {self.tool_mode!r} is not one of {TOOL_MODES}")
