"""Runtime stage: the one backend interface that `generate`, `bench` and the server drive (reference or cuda)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

from ..model_spec import ModelSpec


class BackendError(RuntimeError):
    """A request the backend cannot serve (prompt over the context, no GPU, ...): the message says what to do."""


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy. Filters apply in the order softcap -> temperature -> top-k -> top-p -> min-p."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must lie in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p {self.min_p} must lie in [0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class StepOutput:
    """Tokens committed by one decode (or verify) step; `accepted` is the drafts accepted in a speculative step."""

    token_ids: list[int]
    accepted: int | None = None


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # acc+1 per verify step (1..block_size)
    finish_reason: str = "length"  # "stop" (a stop id was produced), "length", "cancelled"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_s: float = 0.0
    decode_s: float = 0.0


class Backend(Protocol):
    spec: ModelSpec
    max_context: int

    def generate_stream(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                        stop_ids: frozenset[int] = frozenset(), speculative: bool = False,
                        cancelled: Callable[[], bool] | None = None,
                        result: GenerationResult | None = None) -> Iterator[StepOutput]:
        """Yield committed tokens step by step; stops after a stop id (which is yielded), max_tokens, or cancel.
        Fills the caller's `result` as it goes (the caller keeps it: a value per request, never backend state).
        Request mistakes raise BackendError from this call itself, before any work."""
        ...

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int] = frozenset(), speculative: bool = False,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        ...


class StreamingBackend:
    """The part every backend shares: `generate` drains `generate_stream` into one GenerationResult."""

    def generate(self, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams,
                 stop_ids: frozenset[int] = frozenset(), speculative: bool = False,
                 cancelled: Callable[[], bool] | None = None) -> GenerationResult:
        result = GenerationResult()
        for _ in self.generate_stream(prompt_ids, max_tokens, sampling, stop_ids, speculative,  # type: ignore[attr-defined]
                                      cancelled, result):
            pass
        return result
