"""Serve stage: the one output parser: generated token ids -> ordered neutral events (text, reasoning, tool calls).

Control tokens are recognised by id (never by matching decoded text), so a delimiter can never be split across
stream chunks; ordinary text goes through the runtime's incremental UTF-8-safe decoder per segment. Every API
(chat, completions, Messages, Responses), streamed or not, runs this one state machine, and it yields the same
events for any split of the tokens into steps (adjacent text events of one kind merged), so the final messages
agree by construction.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..runtime.text.tokenizer import IncrementalDecoder
from .events import OutputEvent, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallBegin, ToolCallEnd

STR_DELIM = '<|"|>'


@dataclass(frozen=True)
class ControlIds:
    """Ids of Gemma-4's control tokens (MODEL_FACTS §4.2); `hidden` = other specials dropped from the text."""

    channel_open: int = 100
    channel_close: int = 101
    tool_call_open: int = 48
    tool_call_close: int = 49
    string_delim: int = 52
    stops: frozenset[int] = frozenset({1, 106, 50})
    hidden: frozenset[int] = frozenset()


def _add_text(out: list[OutputEvent], event: TextDelta | ReasoningDelta) -> None:
    """Append, merging into the last event when it is text of the same kind (so any split reads alike)."""
    if not event.text:
        return
    last = out[-1] if out else None
    if isinstance(last, (TextDelta, ReasoningDelta)) and type(last) is type(event):
        out[-1] = type(event)(last.text + event.text)
    else:
        out.append(event)


class StopMatcher:
    """Finds stop strings in streamed text; holds back any tail that could still begin one."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.hit = False
        self.matched: str | None = None  # the stop string that ended the text

    def push(self, text: str) -> str:
        if self.hit:
            return ""
        if not self.stops:
            return text
        self._buf += text
        found = [(i, s) for s in self.stops if (i := self._buf.find(s)) >= 0]
        if found:
            cut, self.matched = min(found, key=lambda f: f[0])
            self.hit = True
            out, self._buf = self._buf[:cut], ""
            return out
        # emit all but the longest tail that is a prefix of some stop string
        keep = len(self._buf)
        for k in range(min(self._hold, len(self._buf)), 0, -1):
            if any(s.startswith(self._buf[-k:]) for s in self.stops):
                keep = len(self._buf) - k
                break
        out, self._buf = self._buf[:keep], self._buf[keep:]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.hit else self._buf), ""
        return out


class ToolSyntaxError(ValueError):
    pass


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


_NUMBER = re.compile(r"-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _bare(token: str) -> bool | int | float | str | None:
    """A value written without delimiters: booleans, null, numbers; anything else is kept as a string."""
    low = token.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none"):
        return None
    if _NUMBER.fullmatch(token):
        try:
            return int(token)
        except ValueError:
            return float(token)
    return token


def _parse_value(s: str, i: int) -> tuple[Any, int]:
    """The value (JSON-like: str, number, bool, None, dict, list) starting at s[i], and where it ends."""
    i = _skip_ws(s, i)
    if s.startswith(STR_DELIM, i):
        end = s.find(STR_DELIM, i + len(STR_DELIM))
        if end < 0:
            raise ToolSyntaxError("unterminated string")
        return s[i + len(STR_DELIM) : end], end + len(STR_DELIM)
    if i < len(s) and s[i] in "{[":
        closer = "}" if s[i] == "{" else "]"
        out: dict[str, Any] | list[Any] = {} if closer == "}" else []
        i = _skip_ws(s, i + 1)
        if i < len(s) and s[i] == closer:
            return out, i + 1
        while True:
            if closer == "}":
                i = _skip_ws(s, i)
                if s.startswith(STR_DELIM, i):
                    key, i = _parse_value(s, i)
                    i = _skip_ws(s, i)
                else:
                    colon = s.find(":", i)
                    if colon < 0:
                        raise ToolSyntaxError("object key without ':'")
                    key, i = s[i:colon].strip(), colon
                if i >= len(s) or s[i] != ":" or not key:
                    raise ToolSyntaxError("bad object key")
                value, i = _parse_value(s, i + 1)
                out[key] = value
            else:
                value, i = _parse_value(s, i)
                out.append(value)  # type: ignore[union-attr]
            i = _skip_ws(s, i)
            if i < len(s) and s[i] == ",":
                i += 1
                continue
            if i < len(s) and s[i] == closer:
                return out, i + 1
            raise ToolSyntaxError(f"expected ',' or '{closer}'")
    j = i
    while j < len(s) and s[j] not in ",}]":
        j += 1
    token = s[i:j].strip()
    if not token:
        raise ToolSyntaxError("empty value")
    return _bare(token), j


def parse_tool_call(body: str) -> tuple[str, dict[str, Any]]:
    """`call:NAME{k:v,...}` (the text between <|tool_call> and <tool_call|>) -> (NAME, arguments dict)."""
    body = body.strip()
    if not body.startswith("call:"):
        raise ToolSyntaxError("tool call does not start with 'call:'")
    brace = body.find("{")
    if brace < 0:
        raise ToolSyntaxError("tool call without arguments")
    name = body[5:brace].strip()
    if not re.fullmatch(r"[\w\-.]+", name):
        raise ToolSyntaxError(f"bad tool name {name!r}")
    args, end = _parse_value(body, brace)
    if body[end:].strip():
        raise ToolSyntaxError("text after the arguments")
    return name, args


class OutputParser:
    """Feed token ids (any grouping), get the events they complete, in output order; `finish()` flushes. A tool
    call comes whole (begin, its arguments as JSON, end) once its closing token arrives. Set `prefill_tool` when
    the prompt already opened a tool call (tool_choice required/named) so the output starts inside `call:...`."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        ids: ControlIds = ControlIds(),
        *,
        parse_tools: bool = True,
        stop: Iterable[str] = (),
        prefill_tool: str | None = None,
        call_id_prefix: str | None = None,
        max_calls: int | None = None,
    ) -> None:
        self.ids = ids
        self.max_calls = max_calls  # parallel_tool_calls=false: the answer ends after the first call
        self.parse_tools = parse_tools
        self._decoder = IncrementalDecoder(decode)
        self._stop = StopMatcher(stop)
        self._mode = "tool" if prefill_tool is not None else "content"
        self._body = prefill_tool or ""
        self._label: str | None = None  # pending channel label ("thought\n") while not yet complete
        self._prefix = call_id_prefix or uuid.uuid4().hex[:16]  # call ids: f"{prefix}_{n}"
        self.n_calls = 0
        self.n_reasoning_tokens = 0  # tokens inside the thought channel, its delimiters included
        self.stopped = False  # a stop string was found: the caller ends the generation

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the answer, if one did."""
        return self._stop.matched

    # --- routing -------------------------------------------------------------------------------------------
    def _route(self, text: str, out: list[OutputEvent]) -> None:
        if not text:
            return
        if self._mode == "tool":
            self._body += text
        elif self._mode == "thought":
            if self._label is not None:
                self._label += text
                nl = self._label.find("\n")
                if nl < 0 and len(self._label) < 32:
                    return
                # no newline within 32 chars: it was not a channel label after all, keep it as reasoning
                text, self._label = (self._label[nl + 1 :] if nl >= 0 else self._label), None
            _add_text(out, ReasoningDelta(text))
        else:
            _add_text(out, TextDelta(self._stop.push(text)))
            self.stopped = self._stop.hit

    def _switch(self, mode: str, out: list[OutputEvent]) -> None:
        self._route(self._decoder.flush(), out)
        self._mode = mode

    def _close_call(self, out: list[OutputEvent]) -> None:
        body, self._body = self._body, ""
        self._mode = "content"
        try:
            name, args = parse_tool_call(body)
        except ToolSyntaxError:
            # malformed call syntax: return what the model wrote rather than guessing arguments
            self._route("<|tool_call>" + body + "<tool_call|>", out)
            return
        call_id = f"{self._prefix}_{self.n_calls}"
        out += [
            ToolCallBegin(call_id, name),
            ToolCallArguments(call_id, json.dumps(args, ensure_ascii=False)),
            ToolCallEnd(call_id),
        ]
        self.n_calls += 1
        if self.max_calls is not None and self.n_calls >= self.max_calls:
            self.stopped = True

    # --- public --------------------------------------------------------------------------------------------
    def feed(self, token_ids: Iterable[int]) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        ids = self.ids
        for t in token_ids:
            if self.stopped:
                break
            if t in ids.stops:
                continue
            if self._mode == "thought" or t == ids.channel_open:
                self.n_reasoning_tokens += 1
            if t == ids.channel_open:
                self._switch("thought", out)
                self._label = ""
            elif t == ids.channel_close:
                self._switch("content" if self._mode == "thought" else self._mode, out)
                self._label = None
            elif t == ids.tool_call_open and self.parse_tools:
                if self._mode == "tool":  # a new call opens before the last one closed: keep the old as text
                    self._switch("content", out)
                    self._route("<|tool_call>" + self._body, out)
                    self._body = ""
                self._switch("tool", out)
                self._label = None
            elif t == ids.tool_call_close and self.parse_tools and self._mode == "tool":
                self._switch("tool", out)
                self._close_call(out)
            elif t == ids.string_delim:
                self._route(self._decoder.flush(), out)
                self._route(STR_DELIM, out)
            elif t in ids.hidden:
                self._route(self._decoder.flush(), out)
            else:
                self._route(self._decoder.push(t), out)
        return out

    def finish(self) -> list[OutputEvent]:
        out: list[OutputEvent] = []
        if not self.stopped:
            self._route(self._decoder.flush(), out)
            if self._mode == "tool":  # unterminated call (max_tokens): hand back the raw text as content
                self._mode = "content"
                self._route("<|tool_call>" + self._body, out)
                self._body = ""
        _add_text(out, TextDelta(self._stop.flush()))
        return out
