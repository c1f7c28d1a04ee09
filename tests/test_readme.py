"""The README's examples work as written: every fenced Python and shell block runs against the demo server that
`thorgen serve` starts (its address put in for http://127.0.0.1:8080, a photo.png / photo.jpg beside it) and must
exit cleanly; a block says why it is not run in an HTML comment just above it. The quickstart block is what .ci/run
runs, command for command, and the demo's context holds the Messages example beside a realistic tool set."""

from __future__ import annotations

import io
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
README_URL = "http://127.0.0.1:8080"
BLOCK = re.compile(r"(?:<!--(?P<note>.*?)-->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)```", re.S)


def blocks() -> list[tuple[str, str, str]]:
    """(language, code, the note just above it) of each fenced python / bash block, in order."""
    return [(m["lang"], m["code"], (m["note"] or "").strip()) for m in BLOCK.finditer(README.read_text())]


def runnable() -> list[tuple[str, str]]:
    return [(lang, code) for lang, code, note in blocks() if not note]


def test_every_block_is_run_or_says_why_not() -> None:
    found = blocks()
    assert len(found) >= 5 and len(runnable()) >= 3
    for lang, code, note in found:
        assert not note or "not run by tests/test_readme.py:" in note or ".ci/run runs this block" in note, note


def test_ci_runs_the_quickstart_command_for_command() -> None:
    quickstart = next(code for _, code, note in blocks() if ".ci/run runs this block" in note)
    ci = CI.read_text()
    for line in quickstart.splitlines():
        command = line.split("  #", 1)[0].strip()
        for part in (p.strip() for p in command.split("&&")):
            assert part in ci, f".ci/run does not run the quickstart's `{part}`"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(URL, working folder) of `thorgen serve` on the demo model, as the quickstart starts it (another port)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("PIL")
    home = tmp_path_factory.mktemp("readme")
    port = _free_port()
    env = dict(os.environ, THORGEN_CACHE_DIR=str(home / "cache"))
    log = (home / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "thorgen.cli", "serve", "--port", str(port)], env=env, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"the demo server did not come up: {(home / 'serve.log').read_text()[-2000:]}")
        _photos(home)
        yield url, home
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _photos(folder: Path) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)
    for name, kind in (("photo.png", "PNG"), ("photo.jpg", "JPEG")):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format=kind)
        (folder / name).write_bytes(buf.getvalue())


@pytest.mark.parametrize("index", range(len(runnable())))
def test_readme_block_runs(demo, index) -> None:
    url, home = demo
    lang, code = runnable()[index]
    code = code.replace(README_URL, url)
    command = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(command, cwd=home, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        f"README {lang} block {index} failed:\n{code}\n--- stdout\n{done.stdout[-3000:]}"
        f"\n--- stderr\n{done.stderr[-3000:]}"
    )


def _tools() -> list[dict]:
    """Four tools as a newcomer writes them with pydantic: nested models, lists, enums, optional fields."""
    pydantic = pytest.importorskip("pydantic")
    from datetime import date
    from enum import Enum
    from typing import Literal, Optional

    class Unit(str, Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Weather(pydantic.BaseModel):
        """Current weather and a forecast for a place."""

        city: str = pydantic.Field(description="City name, e.g. 'Paris'")
        country: Optional[str] = pydantic.Field(None, description="ISO 3166 country code")
        unit: Unit = Unit.celsius
        days: int = pydantic.Field(1, ge=1, le=14, description="Days of forecast")

    class Attendee(pydantic.BaseModel):
        email: str = pydantic.Field(description="Their email address")
        optional: bool = False

    class Event(pydantic.BaseModel):
        """Create a calendar event."""

        title: str
        day: date
        start: str = pydantic.Field(description="Start time, HH:MM")
        minutes: int = pydantic.Field(30, ge=5, le=480)
        attendees: list[Attendee] = []
        reminders: dict[str, int] = pydantic.Field(default_factory=dict, description="Channel -> minutes before")

    class Search(pydantic.BaseModel):
        """Search the web."""

        query: str
        site: Optional[str] = None
        freshness: Literal["day", "week", "month", "any"] = "any"
        tags: set[str] = set()

    class Email(pydantic.BaseModel):
        """Send an email."""

        to: list[str]
        subject: str = pydantic.Field(max_length=120)
        body: str
        cc: list[str] = []
        priority: Literal["low", "normal", "high"] = "normal"

    return [
        {"name": m.__name__.lower(), "description": m.__doc__ or m.__name__, "input_schema": m.model_json_schema()}
        for m in (Weather, Event, Search, Email)
    ]


def test_the_demo_context_holds_the_examples_beside_four_tools(demo) -> None:
    anthropic = pytest.importorskip("anthropic")
    httpx = pytest.importorskip("httpx")
    url, _ = demo
    ctx = httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=300)
    ask = [{"role": "user", "content": "Plan my Tuesday in Paris and email the team."}]
    prompt = client.messages.count_tokens(model="thorgen", tools=_tools(), messages=ask).input_tokens
    assert prompt > 1000 and prompt + 2048 <= ctx, (prompt, ctx)  # the README's max_tokens, with room to spare
    msg = client.messages.create(model="thorgen", max_tokens=8, tools=_tools(), messages=ask)
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
