"""Serve stage: the `thorgen chat` terminal client: streaming multi-turn chat against any OpenAI-compatible server."""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, TextIO

import click
import httpx

DIM, RESET, RED = "\x1b[2m", "\x1b[0m", "\x1b[31m"
HELP = (
    "commands: /image PATH, /video PATH (attach an image or a video to the next message), /new (reset the "
    "conversation), /quit (exit); "
    "Ctrl-C stops a reply; Up/Down recall earlier lines"
)
# C0/C1 control characters but newline and tab, and the bidi overrides: model output (or a server) must not be able
# to move the cursor, retitle the terminal or reorder what is shown.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """text without terminal control characters (a lone CR becomes a newline, so no line can overwrite another)."""
    return _CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))


def history_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(state) / "thorgen" / "chat_history"


def line_reader() -> Callable[[str], str]:
    """prompt_toolkit's editor (cursor keys, Emacs bindings, history kept across sessions) on a terminal;
    plain input() when stdin is not a terminal (pipes, tests) or prompt_toolkit is missing."""
    if not sys.stdin.isatty():
        return input
    try:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory
    except ImportError:
        return input
    path = history_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        session = PromptSession(history=FileHistory(str(path)))
    except OSError:  # an unwritable home: editing still works, history lasts until the client exits
        session = PromptSession()
    return session.prompt


def sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """JSON payloads of an OpenAI server-sent event stream (stops at [DONE])."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class ChatSession:
    """Keeps the conversation; `send` streams one reply to `out` and records it in the history."""

    def __init__(
        self,
        url: str,
        think: bool = False,
        temperature: float | None = None,
        max_tokens: int | None = None,
        system: str | None = None,
        api_key: str | None = None,
        out: TextIO = sys.stdout,
        color: bool | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.think, self.temperature, self.max_tokens, self.system = think, temperature, max_tokens, system
        self.out = out
        self.color = out.isatty() if color is None else color
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = client or httpx.Client(headers=headers, timeout=httpx.Timeout(600, connect=10))
        self.history: list[dict] = []
        self.pending: list[dict] = []  # image and video parts attached to the next message
        self.model = "default"

    def _paint(self, style: str, text: str) -> str:
        return f"{style}{text}{RESET}" if self.color and text else text

    def connect(self) -> str:
        r = self.client.get(self.url + "/v1/models")
        r.raise_for_status()
        self.model = r.json()["data"][0]["id"]
        return self.model

    def reset(self) -> None:
        self.history.clear()
        self.pending.clear()

    def attach(self, path: str | Path, media: str = "image") -> None:
        """The image (or video) file goes with the next message, inline as a data: URL (OSError/ValueError if
        unusable)."""
        path = Path(path).expanduser()
        kind = mimetypes.guess_type(path.name)[0] or ""
        if not kind.startswith(f"{media}/"):
            names = ".png, .jpg, .webp, .gif" if media == "image" else ".mp4, .webm, .mov, .mkv"
            raise ValueError(f"{path}: not {'an image' if media == 'image' else 'a video'} file name ({names}, ...)")
        data = base64.b64encode(path.read_bytes()).decode()
        part = f"{media}_url"
        self.pending.append({"type": part, part: {"url": f"data:{kind};base64,{data}"}})

    def send(self, text: str) -> dict:
        content = [*self.pending, {"type": "text", "text": text}] if self.pending else text
        self.history.append({"role": "user", "content": content})
        self.pending = []
        body: dict = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "messages": ([{"role": "system", "content": self.system}] if self.system else []) + self.history,
            "chat_template_kwargs": {"enable_thinking": self.think},
        }
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        content, reasoning, calls, usage = "", "", {}, None
        start = time.perf_counter()
        first = None
        was_reasoning = False
        try:
            with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(r.json().get("error", {}).get("message", r.text))
                for event in sse_events(r.iter_lines()):
                    if "error" in event:
                        raise RuntimeError(event["error"].get("message"))
                    usage = event.get("usage") or usage
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        piece_r, piece_c = delta.get("reasoning_content") or "", delta.get("content") or ""
                        if (piece_r or piece_c or delta.get("tool_calls")) and first is None:
                            first = time.perf_counter()
                        if piece_r:  # shown cleaned; the history keeps what the model said
                            self.out.write(self._paint(DIM, printable(piece_r)))
                            was_reasoning = True
                        if piece_c:
                            if was_reasoning:
                                self.out.write("\n\n")
                                was_reasoning = False
                            self.out.write(printable(piece_c))
                        for call in delta.get("tool_calls") or []:
                            calls[call["index"]] = call
                            fn = call["function"]
                            self.out.write(printable(f"\n[tool call] {fn['name']}({fn['arguments']})"))
                        reasoning += piece_r
                        content += piece_c
                        self.out.flush()
        except KeyboardInterrupt:  # leaving the with-block closed the connection: the server stops generating
            self.out.write(self._paint(DIM, " [stopped]"))
        turn: dict = {"role": "assistant", "content": content}
        if calls:
            turn["tool_calls"] = [calls[i] for i in sorted(calls)]
        self.history.append(turn)
        n = usage["completion_tokens"] if usage else None
        elapsed = time.perf_counter() - (first or start)
        stats = f"{n} tokens" if n is not None else ""
        if n and first and elapsed > 0:
            stats += f", {n / elapsed:.1f} tok/s"
        self.out.write("\n" + self._paint(DIM, f"[{stats}]" if stats else "") + "\n")
        return turn


def run_chat(
    url: str,
    think: bool = False,
    temperature: float | None = None,
    max_tokens: int | None = None,
    system: str | None = None,
    api_key: str | None = None,
    read: Callable[[str], str] | None = None,
    out: TextIO = sys.stdout,
    images: tuple[Path, ...] = (),
    videos: tuple[Path, ...] = (),
) -> None:
    session = ChatSession(url, think, temperature, max_tokens, system, api_key, out=out)
    for media, paths in (("image", images), ("video", videos)):
        for path in paths:
            try:
                session.attach(path, media)
            except (OSError, ValueError) as exc:
                out.write(printable(f"cannot attach {'an image' if media == 'image' else 'a video'}: {exc}") + "\n")
                raise SystemExit(1) from None
    read = read or line_reader()
    try:
        model = session.connect()
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        out.write(printable(f"cannot reach a server at {url}: {exc}") + "\n")
        raise SystemExit(1) from None
    out.write(f"connected to {printable(model)} at {url}" + (" (thinking on)" if think else "") + f"\n{HELP}\n")
    while True:
        try:
            line = read("> ").strip()
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            return
        if not line:
            continue
        if line in ("/quit", "/exit"):
            return
        if line == "/new":
            session.reset()
            out.write("(new conversation)\n")
            continue
        if line.startswith(("/image ", "/video ")):
            media = line[1:6]
            try:
                session.attach(line[len("/image ") :].strip(), media)
                count = sum(1 for part in session.pending if part["type"] == f"{media}_url")
                out.write(f"({count} {media}(s) attached to the next message)\n")
            except (OSError, ValueError) as exc:
                out.write(session._paint(RED, printable(f"error: {exc}")) + "\n")
            continue
        if line.startswith("/"):
            out.write(HELP + "\n")
            continue
        try:
            session.send(line)
        except (RuntimeError, httpx.HTTPError) as exc:
            session.history.pop()  # the failed user turn
            out.write(session._paint(RED, printable(f"error: {exc}")) + "\n")


@click.command(help="Chat with a running `thorgen serve` in the terminal (streaming; /new resets, /quit exits).")
@click.option("--url", default="http://127.0.0.1:8080", show_default=True, help="Server base URL.")
@click.option("--think/--no-think", default=False, show_default=True, help="Enable the model's thinking.")
@click.option("--temperature", type=click.FloatRange(0, 2), default=None, help="Sampling temperature.")
@click.option("--max-tokens", type=click.IntRange(1), default=None)
@click.option("--system", default=None, help="System prompt.")
@click.option("--api-key", default=None, envvar="THORGEN_API_KEY")
@click.option(
    "--image",
    "images",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="An image file attached to the first message (repeat for several; /image PATH attaches later).",
)
@click.option(
    "--video",
    "videos",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A video file attached to the first message (/video PATH attaches later).",
)
def chat(
    url: str,
    think: bool,
    temperature: float | None,
    max_tokens: int | None,
    system: str | None,
    api_key: str | None,
    images: tuple[Path, ...],
    videos: tuple[Path, ...],
) -> None:
    run_chat(
        url,
        think=think,
        temperature=temperature,
        max_tokens=max_tokens,
        system=system,
        api_key=api_key,
        images=images,
        videos=videos,
    )
