"""Serve stage: OpenAI's chat and completions shapes over the answer skeleton (serve/answer.py): a request's choices
as one JSON body or as SSE chunks (one per engine step and choice, then each choice's finish), with OpenAI's ids,
finish reasons, tool calls, logprobs (and vLLM's token ids and prompt logprobs) and usage."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from ..runtime.backend import TokenLogprob
from .answer import Adapter, sse
from .context import ServerContext
from .events import (
    Event,
    Finish,
    FinishReason,
    OutputEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArguments,
    ToolCallBegin,
    ToolCallEnd,
    Tokens,
    Usage,
)
from .generation import Generation
from .logprobs import Logprobs
from .protocol import APIError
from .request import GenerationRequest
from .vllm_extras import prompt_logprobs_json

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.TOOL_CALLS: "tool_calls",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.CANCELLED: "stop",
}


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class _Choice:
    """One choice as it comes: its output events (streamed: those of the step not yet sent; whole: all), its
    calls (id -> (index among its calls, name)), token ids, logprobs, and how it ended."""

    logprobs: Logprobs | None
    events: list[OutputEvent] = field(default_factory=list)
    calls: dict[str, tuple[int, str]] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    prompt_scores: Sequence[TokenLogprob | None] | None = None
    usage: Usage = Usage(0, 0, 0, 0)
    finish: Finish = Finish(FinishReason.STOP)

    def take(self) -> tuple[str, str, list[tuple[int, dict[str, Any]]]]:
        """(text, reasoning, [(index, tool call)]) of the events held, which it lets go."""
        text, reasoning, args = "", "", {}
        for e in self.events:
            if isinstance(e, TextDelta):
                text += e.text
            elif isinstance(e, ReasoningDelta):
                reasoning += e.text
            elif isinstance(e, ToolCallBegin):
                self.calls[e.id] = (len(self.calls), e.name)
                args[e.id] = ""
            elif isinstance(e, ToolCallArguments):
                args[e.id] = args.get(e.id, "") + e.delta
        self.events = []
        calls = [
            (
                self.calls[call_id][0],
                {
                    "id": "call_" + call_id,
                    "type": "function",
                    "function": {"name": self.calls[call_id][1], "arguments": arguments},
                },
            )
            for call_id, arguments in args.items()
        ]
        return text, reasoning, calls


class OpenAIAdapter(Adapter):
    """Chat (`/v1/chat/completions`) or completions (`/v1/completions`) answers of a request's choices."""

    def __init__(self, ctx: ServerContext, gens: list[Generation], req: GenerationRequest) -> None:
        super().__init__(gens, req.stream)
        self.chat = req.messages is not None
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created, self.model, self.decode = int(time.time()), ctx.model_id, ctx.decode
        self.include_usage, self.return_ids = req.include_usage, req.return_token_ids
        self.reports_prompt_logprobs = req.sampling.prompt_logprobs is not None

        def token_text(token: int) -> str:
            return ctx.tokenizer.decode([token])

        self.choices = [
            _Choice(Logprobs(token_text, self.chat) if g.job.sampling.logprobs is not None else None) for g in gens
        ]

    # --- streamed ----------------------------------------------------------------------------------------------
    def _chunk(self, choice: dict[str, Any]) -> bytes:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            body["usage"] = None
        return sse(body)

    def _step(
        self, i: int, finish: str | None = None, ids: tuple[int, ...] = (), logprobs: dict[str, Any] | None = None
    ) -> list[bytes]:
        """The chunk of choice i's held events (none when there is nothing to say)."""
        text, reasoning, calls = self.choices[i].take()
        forced = (self.return_ids and ids) or logprobs is not None  # a chunk even without text
        if self.chat:
            delta: dict[str, Any] = {}
            if reasoning:
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if text:
                delta["content"] = text
            if calls:  # every delta carries index, id, type and name (strict clients need them)
                delta["tool_calls"] = [{**call, "index": index} for index, call in calls]
            if not delta and finish is None and not forced:
                return []
            out = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            if not text and finish is None and not forced:
                return []
            out = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
        if self.return_ids:
            out["token_ids"] = list(ids)
        return [self._chunk(out)]

    def opening(self) -> list[bytes]:
        if not self.chat:
            return []
        return [
            self._chunk(
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            for i in range(len(self.gens))
        ]

    def add(self, choice: int, event: Event) -> list[bytes]:
        c = self.choices[choice]
        if isinstance(event, (TextDelta, ReasoningDelta, ToolCallBegin, ToolCallArguments, ToolCallEnd)):
            c.events.append(event)
        elif isinstance(event, Tokens):
            c.token_ids += event.ids
            if event.prompt_scores is not None:
                c.prompt_scores = event.prompt_scores
            logprobs = c.logprobs.add(event.scored) if c.logprobs is not None and event.scored else None
            if self.streaming:
                return self._step(choice, ids=event.ids, logprobs=logprobs)
        elif isinstance(event, Usage):
            c.usage = event
        elif isinstance(event, Finish):
            c.finish = event
            if self.streaming:
                return self._step(choice) + self._step(choice, FINISH_REASONS[event.reason])
        return []

    def closing(self) -> list[bytes]:
        tail = []
        if self.include_usage:
            tail.append(
                sse(
                    {
                        "id": self.id,
                        "object": "chat.completion.chunk" if self.chat else "text_completion",
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": self._usage(),
                    }
                )
            )
        return tail + [sse("[DONE]")]

    def failure(self, error: APIError) -> list[bytes]:
        return [sse(error.body()), sse("[DONE]")]

    # --- whole -------------------------------------------------------------------------------------------------
    def _usage(self) -> dict[str, Any]:
        """Each prompt once, the completions of every choice (OpenAI's usage for n > 1 and for several prompts)."""
        firsts = [c.usage for g, c in zip(self.gens, self.choices) if g.counts_prompt]
        return usage(
            sum(u.prompt_tokens for u in firsts),
            sum(c.usage.completion_tokens for c in self.choices),
            sum(u.cached_tokens for u in firsts),
        )

    def _prompt_logprobs(self, g: Generation, c: _Choice) -> list[dict[str, Any] | None] | None:
        return prompt_logprobs_json(g.job.prompt_ids, c.prompt_scores, self.decode)

    def body(self) -> dict[str, Any]:
        choices = []
        for i, (g, c) in enumerate(zip(self.gens, self.choices)):
            text, reasoning, calls = c.take()
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
                message["reasoning_content"] = message["reasoning"] = reasoning or None
                if calls:
                    message["tool_calls"] = [call for _, call in calls]
                out: dict[str, Any] = {"index": i, "message": message}
            else:
                out = {"index": i, "text": text}
            out.update(
                logprobs=c.logprobs.total() if c.logprobs is not None else None,
                finish_reason=FINISH_REASONS[c.finish.reason],
            )
            if self.return_ids:
                out.update(token_ids=c.token_ids, prompt_token_ids=list(g.job.prompt_ids))
            if self.reports_prompt_logprobs and not self.chat:
                out["prompt_logprobs"] = self._prompt_logprobs(g, c)
            choices.append(out)
        body: dict[str, Any] = {
            "object": "chat.completion" if self.chat else "text_completion",
            "id": self.id,
            "created": self.created,
            "model": self.model,
            "usage": self._usage(),
            "choices": choices,
        }
        if self.reports_prompt_logprobs and self.chat:  # vLLM's chat answer carries them once, at the top
            body["prompt_logprobs"] = self._prompt_logprobs(self.gens[0], self.choices[0])
        return body
