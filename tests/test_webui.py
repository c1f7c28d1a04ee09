"""Serve stage tests: the web UI end to end in headless Chromium: send, stream, stop, thinking collapsed, tables and
blockquotes, the conversation kept across a reload and cleared by New."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from thorgen.runtime.text.tokenizer import Tokenizer
from thorgen.serve.app import create_app
from thorgen.serve.chat_template import ChatTemplate
from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "model_spec" / "synth" / "chat_template.jinja"
CHROMIUM = os.environ.get("THORGEN_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("THORGEN_TEST_ARTIFACTS", REPO / "tests" / "artifacts"))
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ANSWER = ("Here is code:\n\n```python\nprint('hi <b>')\n```\n\n| name | n |\n|:-----|--:|\n| a<i> | 1 |\n| b | 22 |\n\n"
          "> quoted **bold**\n> line two\n\nDone **now**.")


def test_webui_send_stream_stop(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium)")
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))

    def script(prompt: list[int]) -> list[int]:
        text = tok.decode(prompt)
        if "forever" in text.rsplit("<|turn>user", 1)[-1]:
            return tok.encode("word " * 5000)
        return tok.encode("<|channel>thought\nThe user wants code.<channel|>" + ANSWER)
    engine = ScriptedBackend(script, chunk=1, delay=0.01)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.get_by_test_id("model").filter(has_text=state.model_id).wait_for(timeout=10000)
            page.get_by_test_id("settings-toggle").click()
            page.get_by_test_id("thinking").check()
            page.get_by_test_id("system").fill("Be helpful.")
            page.get_by_test_id("input").fill("show me code")
            page.get_by_test_id("send").click()
            page.get_by_test_id("stop").wait_for(state="visible", timeout=5000)  # streaming has begun
            reply = page.get_by_test_id("assistant-message").last
            page.wait_for_function("() => document.querySelector('[data-testid=assistant-message] "
                                   "[data-testid=content]')?.textContent.length > 0")
            partial = reply.get_by_test_id("content").text_content()
            page.locator("[data-testid=assistant-message][data-done='1']").wait_for(timeout=20000)
            assert 0 < len(partial) < len(reply.get_by_test_id("content").text_content())  # it arrived in pieces
            code = reply.locator("pre code")
            assert code.text_content() == "print('hi <b>')"  # markdown code block, HTML escaped
            assert reply.locator("p strong").last.text_content() == "now"
            cells = reply.locator("table tbody tr").all()
            assert [[td.text_content() for td in row.locator("td").all()] for row in cells] == [["a<i>", "1"],
                                                                                                ["b", "22"]]
            assert reply.locator("table th").first.text_content() == "name"
            assert reply.locator("table td").nth(1).evaluate("e => e.style.textAlign") == "right"
            quote = reply.locator("blockquote")
            assert "quoted bold" in quote.text_content() and quote.locator("strong").text_content() == "bold"
            thinking = reply.get_by_test_id("thinking")
            assert thinking.is_visible() and thinking.get_attribute("open") is None  # collapsed
            assert "The user wants code." in thinking.text_content()
            assert "tok/s" in page.get_by_test_id("stats").text_content()
            assert "Be helpful." in tok.decode(engine.calls[-1]["prompt"])
            assert "<|think|>" in tok.decode(engine.calls[-1]["prompt"])

            page.get_by_test_id("input").fill("talk forever")
            page.get_by_test_id("send").click()
            page.wait_for_function("() => document.querySelectorAll('[data-testid=assistant-message] "
                                   "[data-testid=content]')[1]?.textContent.length > 20")
            page.get_by_test_id("stop").click()
            page.get_by_test_id("send").wait_for(state="visible", timeout=5000)
            deadline = time.monotonic() + 5
            while engine.calls[-1]["end"] is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert engine.calls[-1]["end"] == "cancelled"  # the stop button reached the engine
            stopped = page.get_by_test_id("assistant-message").last.get_by_test_id("stopped")
            assert stopped.text_content() == "(stopped)"

            page.reload()  # the conversation survives, tables and the stopped mark included
            page.locator("[data-testid=assistant-message][data-done='1']").nth(1).wait_for(timeout=10000)
            users = page.locator("[data-testid=user-message] [data-testid=content]")
            assert users.all_text_contents() == ["show me code", "talk forever"]
            again = page.get_by_test_id("assistant-message")
            assert again.first.locator("table tbody tr").count() == 2
            assert again.first.get_by_test_id("thinking").text_content().endswith("The user wants code.")
            assert again.last.get_by_test_id("stopped").is_visible()
            page.get_by_test_id("input").fill("and now?")
            page.get_by_test_id("send").click()
            page.locator("[data-testid=assistant-message][data-done='1']").nth(2).wait_for(timeout=20000)
            prompt = tok.decode(engine.calls[-1]["prompt"])
            assert "show me code" in prompt and "talk forever" in prompt  # the restored history went back
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shot = ARTIFACTS / "webui.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"\nweb UI screenshot: {shot}")
            page.get_by_test_id("new").click()
            page.reload()
            page.get_by_test_id("model").filter(has_text=state.model_id).wait_for(timeout=10000)
            assert page.get_by_test_id("assistant-message").count() == 0
        finally:
            browser.close()
