"""Serve stage tests: `thorgen serve` from a fresh cache answers the openai client; `thorgen chat` talks to it."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from thorgen.runtime.text.tokenizer import Tokenizer
from thorgen.serve.app import create_app
from thorgen.serve.tools.chat import run_chat
from thorgen.serve.chat_template import ChatTemplate
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer

TEMPLATE = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_demo_model_from_fresh_cache(tmp_path):
    openai = pytest.importorskip("openai")
    port = _free_port()
    env = dict(os.environ, THORGEN_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "thorgen.cli", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline, status = time.monotonic() + 90, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(url + "/health", timeout=2).status_code
            except httpx.HTTPError:
                status = None
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200, f"server not healthy (exit {proc.poll()})"
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        assert "not-gemma" in model and "demo" in model
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert (tmp_path / "cache" / "demo-tiny" / "config.json").exists()
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "random weights" in out


def test_chat_client_multi_turn_and_new(tmp_path):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = ScriptedBackend(lambda p: tok.encode("<|channel>thought\npondering<channel|>Reply!"), chunk=2)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    lines = iter(["hello", "second", "/new", "third", "/quit"])
    out = io.StringIO()
    with running_server(create_app(state)) as url:
        run_chat(url, think=True, temperature=0.5, read=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert "connected to scripted-test-engine" in text and text.count("Reply!") == 3
    assert "pondering" in text and "tok/s" in text
    prompts = [tok.decode(c["prompt"]) for c in engine.calls]
    assert "hello" in prompts[1] and "Reply!" in prompts[1]  # multi-turn: history went back to the server
    assert "hello" not in prompts[2] and "third" in prompts[2]  # /new reset it
    assert all("<|think|>" in p for p in prompts) and engine.calls[0]["sampling"].temperature == 0.5


def test_cli_help():
    for cmd in ("serve", "chat"):
        r = subprocess.run([sys.executable, "-m", "thorgen.cli", cmd, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "Usage" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "thorgen.cli", "serve", "--model", "/nonexistent/dir"], capture_output=True, text=True
    )
    assert r.returncode != 0 and "config.json" in r.stderr


def test_chat_client_strips_control_characters(tmp_path):
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    evil = "safe\x1b]0;pwned\x07 text\x1b[2J\rover\u202eevil\x00 end"
    engine = ScriptedBackend(lambda p: tok.encode(evil), chunk=3)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    lines = iter(["hello", "again", "/quit"])
    out = io.StringIO()
    with running_server(create_app(state)) as url:
        run_chat(url, read=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07\x00\r\u202e")
    assert text.count("safe]0;pwned text[2J\noverevil end") == 2
    assert evil in tok.decode(engine.calls[1]["prompt"])  # the history sent back is what the model said


def test_chat_line_editor_with_history(tmp_path, monkeypatch):
    pytest.importorskip("prompt_toolkit")
    from prompt_toolkit.history import FileHistory

    from thorgen.serve.tools import chat as chat_client

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False)
    assert chat_client.line_reader() is input  # piped input: plain lines
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    read = chat_client.line_reader()
    history = read.__self__.history
    assert isinstance(history, FileHistory) and Path(history.filename) == tmp_path / "thorgen" / "chat_history"


def test_serve_load_error_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cmd = [sys.executable, "-m", "thorgen.cli", "serve", "--model", str(tmp_path), "--port", str(_free_port())]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr + r.stdout
    errors = [line for line in r.stderr.splitlines() if "failed to load" in line]
    assert len(errors) == 1 and "config.json" in errors[0]
    r = subprocess.run(cmd + ["--log-level", "debug"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" in r.stderr
