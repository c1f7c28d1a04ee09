"""Serve stage (`thorgen bench soak`): the soak's request kinds, each one request built and its answer read: status,
when text arrived, whether a stream ended with its API's final event, and whether a hostile body was refused.

Kinds: chat (whole and streamed), tools (tool_choice auto, streamed; a forced function, whole), json_schema,
image (a generated PNG as a data URL), Anthropic Messages (whole and streamed), Responses (whole and streamed),
abort (a chat stream whose client closes the connection after two text events) and hostile (bodies the server must
refuse with a 4xx: malformed JSON, wrong types, a huge max_tokens, bad image data, ...).
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import random
import struct
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

DEFAULT_MIX = (
    "chat=3,stream=4,tools_auto=1,tools_forced=1,json_schema=1,image=1,messages=1,messages_stream=2,responses=1,"
    "responses_stream=2,abort=1,hostile=2"
)
ABORT_AFTER = 2  # text events an abort reads before it closes the connection
# distinct images the soak sends by default (--images), each once in the warm-up: the server's caches of them
# (preprocessed patches, the encoder's rows) fill there, so that RSS growth after the warm-up is growth of something
# else; more than the engine's 8 cached images' rows, so that its LRU evicts during the soak
IMAGE_POOL = 16
CHAT, MESSAGES, RESPONSES = "/v1/chat/completions", "/v1/messages", "/v1/responses"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "integer"}},
    "required": ["answer", "confidence"],
}
TOPICS = ("tides", "bread", "volcanoes", "compilers", "bees", "glaciers", "chess", "rivers", "lighthouses", "owls")
SYSTEM = "You are a concise assistant. Answer in plain sentences."
KINDS = tuple(part.split("=")[0] for part in DEFAULT_MIX.split(","))


@dataclass(frozen=True)
class Settings:
    """What every request of a soak shares: the served model name, the server's context, the output budget."""

    model: str
    max_context: int
    max_tokens: int = 64
    image_tokens: int = 70  # soft tokens an image may take (mm_processor_kwargs.max_soft_tokens)
    images: int = IMAGE_POOL  # distinct images the image requests draw from


@dataclass
class Request:
    kind: str
    path: str
    body: dict | bytes  # bytes: sent as they are (hostile bodies), with a JSON content type
    api: str | None = None  # a stream's API ("chat", "messages", "responses"); None: answered whole
    hostile: str | None = None  # the hostile case's name
    check: Callable[[dict], str | None] | None = None  # a whole answer's problem, if any


@dataclass
class Outcome:
    """One request's result; times in seconds (`sent`: since the soak started)."""

    kind: str
    sent: float
    status: int | None = None  # None: no HTTP answer (a transport error)
    latency: float | None = None
    ttft: float | None = None  # to the first text event (streams)
    gaps: list[float] = field(default_factory=list)  # between text events (streams)
    completed: bool = False  # a stream ended with its final event
    truncated: bool = False  # a 200 stream that ended without its final event or an error event
    stream_error: bool = False  # a 200 stream that ended with an error event
    aborted: bool = False  # the client closed it on purpose
    invalid: str | None = None  # a whole answer that does not hold what was asked for
    error: str | None = None
    hostile: str | None = None
    warmup: bool = False


def png_data_url(width: int = 96, height: int = 64, seed: int = 0) -> str:
    """A generated RGB PNG (a gradient) as a data: URL, encoded with zlib alone (no image library)."""

    def pixel(x: int, y: int) -> bytes:
        return bytes(((x * 3 + seed) % 256, (y * 5 + 40) % 256, (x + y + 80) % 256))

    rows = b"".join(b"\0" + b"".join(pixel(x, y) for x in range(width)) for y in range(height))  # (filter 0)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _prompt(rng: random.Random) -> str:
    """A short question, different each time (a nonce), so that only the shared system prompt is a cache hit."""
    return f"In {rng.randint(2, 5)} sentences, what is worth knowing about {rng.choice(TOPICS)}? #{rng.getrandbits(32)}"


def _messages(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": _prompt(rng)}]


def _forced_tool(answer: dict) -> str | None:
    choice = answer["choices"][0]
    if choice.get("finish_reason") == "length":
        return None  # (cut by max_tokens: nothing to check)
    calls = choice["message"].get("tool_calls") or []
    if not calls or calls[0]["function"]["name"] != "get_weather":
        return f"a forced tool call answered {json.dumps(choice['message'])[:200]}"
    try:
        arguments = json.loads(calls[0]["function"]["arguments"])
    except ValueError:
        return f"tool arguments that are not JSON: {calls[0]['function']['arguments'][:200]!r}"
    return None if isinstance(arguments, dict) and "city" in arguments else f"tool arguments {arguments!r:.200}"


def _json_schema(answer: dict) -> str | None:
    choice = answer["choices"][0]
    if choice.get("finish_reason") != "stop":
        return None
    try:
        value = json.loads(choice["message"]["content"])
    except (TypeError, ValueError):
        return f"json_schema content that is not JSON: {choice['message']['content']!r:.200}"
    return None if isinstance(value, dict) and set(SCHEMA["required"]) <= set(value) else f"{value!r:.200}"


def build(kind: str, rng: random.Random, s: Settings) -> Request:
    """One request of `kind`."""
    chat = {"model": s.model, "messages": _messages(rng), "max_tokens": s.max_tokens}
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        return Request(kind, CHAT, chat)
    if kind == "stream":
        return Request(kind, CHAT, chat | stream, api="chat")
    if kind == "tools_auto":
        return Request(kind, CHAT, chat | stream | {"tools": TOOLS, "tool_choice": "auto"}, api="chat")
    if kind == "tools_forced":
        forced = {"type": "function", "function": {"name": "get_weather"}}
        return Request(kind, CHAT, chat | {"tools": TOOLS, "tool_choice": forced}, check=_forced_tool)
    if kind == "json_schema":
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        return Request(kind, CHAT, chat | {"response_format": fmt}, check=_json_schema)
    if kind == "image":
        return _image(rng.randrange(s.images), chat, s)
    if kind in ("messages", "messages_stream"):
        body = {"model": s.model, "system": SYSTEM, "max_tokens": s.max_tokens}
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
        streamed = kind == "messages_stream"
        return Request(kind, MESSAGES, body | {"stream": streamed}, api="messages" if streamed else None)
    if kind in ("responses", "responses_stream"):
        body = {"model": s.model, "instructions": SYSTEM, "input": _prompt(rng), "max_output_tokens": s.max_tokens}
        streamed = kind == "responses_stream"
        return Request(kind, RESPONSES, body | {"stream": streamed}, api="responses" if streamed else None)
    if kind == "abort":
        return Request(kind, CHAT, chat | stream | {"max_tokens": max(s.max_tokens, 4 * ABORT_AFTER)}, api="chat")
    if kind == "hostile":
        name, path, body = rng.choice(hostile_cases(s))
        return Request(kind, path, body, hostile=name)
    raise ValueError(f"unknown request kind {kind!r}")


def _image(seed: int, chat: dict, s: Settings) -> Request:
    parts = [{"type": "image_url", "image_url": {"url": png_data_url(seed=seed)}}]
    parts.append({"type": "text", "text": "What is in this picture?"})
    body = chat | {"messages": [{"role": "user", "content": parts}]}
    return Request("image", CHAT, body | {"mm_processor_kwargs": {"max_soft_tokens": s.image_tokens}})


def warmup(kinds: list[str], rng: random.Random, s: Settings) -> list[Request]:
    """Every distinct payload the soak will send, once: each kind (a grammar compiled per schema and tool set),
    each of the `s.images` images and each hostile case; the other kinds differ only in their prompts' text. Each
    asks for one token (an abort for the few it reads): the payloads matter here, not the outputs."""
    one = dataclasses.replace(s, max_tokens=1)
    out: list[Request] = []
    for kind in kinds:
        if kind == "image":
            out += [_image(seed, {"model": s.model, "max_tokens": 1}, one) for seed in range(s.images)]
        elif kind == "hostile":
            out += [Request(kind, path, body, hostile=name) for name, path, body in hostile_cases(s)]
        else:
            out.append(build(kind, rng, one))
    return out


@functools.cache
def hostile_cases(s: Settings) -> list[tuple[str, str, dict | bytes]]:
    """(name, path, body) of requests the server must refuse with a 4xx (built once per soak: one is 9 MB)."""
    user = [{"role": "user", "content": "hi"}]
    base = {"model": s.model, "messages": user}

    def says(content: Any) -> dict:
        return base | {"messages": [{"role": "user", "content": content}]}

    def image(url: str) -> dict:
        return says([{"type": "image_url", "image_url": {"url": url}}])

    forced = {"type": "function", "function": {"name": "no_such_tool"}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    deep = b'{"messages": ' + b"[" * 50000 + b"]" * 50000 + b"}"
    over = "word " * (s.max_context + 64)  # (at least a token a word)
    return [
        ("malformed_json", CHAT, b'{"messages": [{"role": "user", "content": "hi"'),
        ("not_an_object", CHAT, b"[1, 2, 3]"),
        ("empty_body", CHAT, b""),
        ("invalid_utf8", CHAT, b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
        ("deep_nesting", CHAT, deep),
        ("messages_not_a_list", CHAT, base | {"messages": "hi"}),
        ("max_tokens_a_string", CHAT, base | {"max_tokens": "ten"}),
        ("huge_max_tokens", CHAT, base | {"max_tokens": 10**12}),
        ("negative_max_tokens", CHAT, base | {"max_tokens": -1}),
        ("temperature_out_of_range", CHAT, base | {"temperature": -3}),
        ("nan_temperature", CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        ("bad_image_data", CHAT, image("data:image/png;base64,AAAA")),
        ("bad_image_base64", CHAT, image("data:image/png;base64,!!!!")),
        ("image_from_a_file_url", CHAT, image("file:///etc/passwd")),
        ("unknown_forced_tool", CHAT, base | {"tools": TOOLS, "tool_choice": forced}),
        ("invalid_json_schema", CHAT, base | {"response_format": bad_schema}),
        ("empty_messages", CHAT, base | {"messages": []}),
        ("unknown_role", CHAT, base | {"messages": [{"role": "wizard", "content": "hi"}]}),
        ("prompt_over_the_context", CHAT, says(over)),
        ("token_id_outside_the_vocabulary", "/v1/completions", {"model": s.model, "prompt": [10**9], "max_tokens": 2}),
        ("unknown_model", CHAT, base | {"model": "no-such-model"}),
        ("messages_without_max_tokens", MESSAGES, base),
        ("messages_unknown_block", MESSAGES, says([{"type": "nope"}]) | {"max_tokens": 4}),
        ("responses_previous_response_id", RESPONSES, {"model": s.model, "input": "hi", "previous_response_id": "r"}),
        ("body_over_the_limit", CHAT, says("a" * (9 << 20))),
    ]


# ---- reading an answer ------------------------------------------------------------------------------------------


def _text_event(api: str, event: dict) -> bool:
    if api == "chat":
        keys = ("content", "reasoning_content", "tool_calls")
        return any(any((c.get("delta") or {}).get(k) for k in keys) for c in event.get("choices") or [])
    if api == "messages":
        return event.get("type") == "content_block_delta"
    return str(event.get("type", "")).endswith(".delta")


def _final_event(api: str, event: dict) -> bool:
    if api == "messages":
        return event.get("type") == "message_stop"
    return api == "responses" and event.get("type") in ("response.completed", "response.incomplete")


def _error_event(api: str, event: dict) -> bool:
    if api == "chat":
        return "error" in event
    return event.get("type") in ("error", "response.failed")


async def send(http: Any, url: str, req: Request, t0: float, headers: dict[str, str]) -> Outcome:
    """Send `req` and read its answer into an Outcome (transport errors included: they never raise)."""
    import httpx

    out = Outcome(req.kind, time.perf_counter() - t0, hostile=req.hostile)
    sent = time.perf_counter()
    kwargs: dict[str, Any] = {"headers": headers}
    if isinstance(req.body, bytes):
        kwargs["content"], kwargs["headers"] = req.body, headers | {"content-type": "application/json"}
    else:
        kwargs["json"] = req.body
    try:
        async with http.stream("POST", url + req.path, **kwargs) as r:
            out.status = r.status_code
            if req.api is None or r.status_code != 200:
                body = await r.aread()
                if r.status_code == 200:
                    out.invalid = _checked(req, body)
                elif r.status_code >= 400:
                    out.error = body[:300].decode(errors="replace")
            else:
                await _read_stream(r, req, out, sent)
    except httpx.HTTPError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        out.truncated = out.status == 200 and req.api is not None and not (out.completed or out.stream_error)
    out.latency = time.perf_counter() - sent
    return out


def _checked(req: Request, body: bytes) -> str | None:
    """What is wrong with a whole 200 answer: not JSON, or (for a kind that checks) without what was asked."""
    try:
        answer = json.loads(body)
        return req.check(answer) if req.check is not None else None
    except (ValueError, LookupError, TypeError, AttributeError) as exc:  # (a body not in the API's shape)
        return f"an answer the soak cannot read ({type(exc).__name__}: {exc}): {body[:200]!r}"


async def _read_stream(r: Any, req: Request, out: Outcome, sent: float) -> None:
    api, last, texts = req.api or "chat", None, 0
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.completed = api == "chat"
            continue
        try:
            event = json.loads(data)
        except ValueError:
            out.invalid = f"an event that is not JSON: {data[:200]!r}"
            continue
        if not isinstance(event, dict):
            out.invalid = f"an event that is not a JSON object: {data[:200]!r}"
            continue
        if _error_event(api, event):
            out.stream_error, out.error = True, data[:300]
        elif _final_event(api, event):
            out.completed = True
        elif _text_event(api, event):
            now = time.perf_counter()
            if last is None:
                out.ttft = now - sent
            else:
                out.gaps.append(now - last)
            last, texts = now, texts + 1
            if req.kind == "abort" and texts == ABORT_AFTER:
                out.aborted = True
                return  # (leaving the `async with` closes the connection mid-stream)
    out.truncated = not (out.completed or out.stream_error)
