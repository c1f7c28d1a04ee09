"""Serve stage tests: the web UI end to end in headless Chromium: send, stream, stop, thinking collapsed, tables and
blockquotes, the conversation kept across a reload and left by New; copy, regenerate, edit, the conversation list,
highlighted code and MathML, failed answers never sent back, dark-mode contrast, the favicon, attached images."""

from __future__ import annotations

import base64
import io
import json
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
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ANSWER = (
    "Here is code:\n\n```python\nprint('hi <b>')\n```\n\n| name | n |\n|:-----|--:|\n| a<i> | 1 |\n| b | 22 |\n\n"
    "> quoted **bold**\n> line two\n\nDone **now**."
)


MATH = (
    r"Euler: $e^{i\pi}+1=0$, see [the proof](https://example.com/euler) and `code`."
    + "\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```python\ndef f():\n    return 1\n```"
)


def scripted_reply(tok: Tokenizer, prompt: list[int]) -> list[int]:
    """The answer to the last user turn: endless words for "forever", math for "math", an echo for "echo: X",
    else thinking and ANSWER."""
    last = tok.decode(prompt).rsplit("<|turn>user", 1)[-1]
    if "forever" in last:
        return tok.encode("word " * 5000)
    if "math" in last:
        return tok.encode(MATH)
    if "echo:" in last:
        return tok.encode("you said " + last.split("echo:", 1)[1].split("<turn|>", 1)[0].strip())
    return tok.encode("<|channel>thought\nThe user wants code.<channel|>" + ANSWER)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, engine, tokenizer, state, browser): one scripted server and one headless Chromium for the module."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not (Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium)")
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path_factory.mktemp("webui") / "tokenizer.json"))
    engine = ScriptedBackend(lambda prompt: scripted_reply(tok, prompt), chunk=1, delay=0.01)
    state = scripted_state(engine, tok, ChatTemplate(TEMPLATE.read_text()))
    with running_server(create_app(state)) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield url, engine, tok, state, browser
        finally:
            browser.close()


def open_page(served, **context):
    url, _, _, state, browser = served
    page = browser.new_context(**context).new_page()
    page.goto(url + "/")
    page.get_by_test_id("model").filter(has_text=state.model_id).wait_for(timeout=10000)
    return page


def requests_of(page) -> list[dict]:
    """The bodies of the chat requests the page sends, in order (filled as it sends them)."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    return bodies


def answered(page, count: int) -> None:
    """Wait until the log holds `count` answers and the last is complete (rendered)."""
    page.wait_for_function(
        "n => { const a = document.querySelectorAll('[data-testid=assistant-message]'); "
        "return a.length === n && a[n - 1].dataset.done === '1' && "
        "getComputedStyle(document.getElementById('send')).display !== 'none'; }",
        arg=count,
        timeout=20000,
    )


def send(page, text: str, answers: int) -> None:
    page.get_by_test_id("input").fill(text)
    page.get_by_test_id("send").click()
    answered(page, answers)


def test_webui_send_stream_stop(served):
    url, engine, tok, state, browser = served
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
    page.wait_for_function(
        "() => document.querySelector('[data-testid=assistant-message] [data-testid=content]')?.textContent.length > 0"
    )
    partial = reply.get_by_test_id("content").text_content()
    page.locator("[data-testid=assistant-message][data-done='1']").wait_for(timeout=20000)
    assert 0 < len(partial) < len(reply.get_by_test_id("content").text_content())  # it arrived in pieces
    code = reply.locator("pre code")
    assert code.text_content() == "print('hi <b>')"  # markdown code block, HTML escaped
    assert reply.locator("p strong").last.text_content() == "now"
    cells = reply.locator("table tbody tr").all()
    assert [[td.text_content() for td in row.locator("td").all()] for row in cells] == [["a<i>", "1"], ["b", "22"]]
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
    page.wait_for_function(
        "() => document.querySelectorAll('[data-testid=assistant-message] "
        "[data-testid=content]')[1]?.textContent.length > 20"
    )
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


def test_copy_regenerate_and_edit(served):
    page = open_page(served, permissions=["clipboard-read", "clipboard-write"])
    bodies = requests_of(page)
    send(page, "show me code", 1)
    reply = page.get_by_test_id("assistant-message").last
    assert reply.locator("pre.hl code span.nb").first.text_content() == "print"  # Pygments' classes
    assert reply.locator("pre.hl code span.nb").first.evaluate("e => getComputedStyle(e).color") != reply.locator(
        "pre.hl code"
    ).evaluate("e => getComputedStyle(e).color")  # and the stylesheet colours them
    reply.get_by_test_id("copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == ANSWER  # the reply's markdown, thinking excluded
    reply.get_by_test_id("copy-code").click()
    assert page.evaluate("navigator.clipboard.readText()") == "print('hi <b>')"
    page.get_by_test_id("user-message").get_by_test_id("copy").click()
    assert page.evaluate("navigator.clipboard.readText()") == "show me code"

    page.get_by_test_id("regenerate").click()
    answered(page, 1)
    assert len(bodies) == 2 and bodies[1]["messages"] == bodies[0]["messages"] == [
        {"role": "user", "content": "show me code"}
    ]  # the old answer is not sent back
    assert page.get_by_test_id("user-message").count() == 1

    send(page, "echo: second", 2)
    page.get_by_test_id("user-message").first.get_by_test_id("edit").click()
    page.get_by_test_id("edit-input").fill("echo: edited first")
    page.get_by_test_id("edit-save").click()
    answered(page, 1)  # everything after the edited turn is gone
    assert bodies[-1]["messages"] == [{"role": "user", "content": "echo: edited first"}]
    assert page.get_by_test_id("assistant-message").get_by_test_id("content").text_content() == "you said edited first"
    page.reload()
    answered(page, 1)
    assert page.locator("[data-testid=user-message] [data-testid=content]").all_text_contents() == [
        "echo: edited first"
    ]


def test_conversation_list_switch_and_delete(served):
    page = open_page(served)
    bodies = requests_of(page)
    send(page, "echo: first topic", 1)
    page.get_by_test_id("new").click()
    assert page.get_by_test_id("assistant-message").count() == 0
    send(page, "echo: second topic", 1)
    titles = page.locator("[data-testid=conversation] .title")
    assert titles.all_text_contents() == ["echo: second topic", "echo: first topic"]  # newest first
    titles.nth(1).click()
    answered(page, 1)
    assert page.get_by_test_id("assistant-message").get_by_test_id("content").text_content() == "you said first topic"
    send(page, "echo: more", 2)
    assert [m["content"] for m in bodies[-1]["messages"]] == ["echo: first topic", "you said first topic", "echo: more"]
    assert titles.all_text_contents() == ["echo: first topic", "echo: second topic"]
    page.locator("[data-testid=conversation]", has_text="second topic").get_by_test_id("delete-conversation").click()
    assert titles.all_text_contents() == ["echo: first topic"]
    page.reload()
    answered(page, 2)
    assert page.locator("[data-testid=user-message] [data-testid=content]").all_text_contents() == [
        "echo: first topic",
        "echo: more",
    ]
    page.get_by_test_id("delete-conversation").click()  # the current one: an empty conversation remains
    assert page.get_by_test_id("conversation").count() == 0 and page.get_by_test_id("user-message").count() == 0


def test_failed_turn_is_shown_but_never_sent_again(served):
    page = open_page(served)
    bodies = requests_of(page)
    failures = []

    def fail_once(route):
        if failures:
            return route.continue_()
        failures.append(route.request.post_data_json)
        route.fulfill(
            status=500,
            content_type="application/json",
            body=json.dumps({"error": {"message": "engine fell over", "type": "server_error"}}),
        )

    page.route("**/v1/chat/completions", fail_once)
    send(page, "echo: one", 1)
    assert page.get_by_test_id("error").text_content() == "Error: engine fell over"
    send(page, "echo: two", 2)
    assert bodies[-1]["messages"] == [
        {"role": "user", "content": "echo: one"},
        {"role": "user", "content": "echo: two"},
    ]
    assert page.get_by_test_id("assistant-message").last.get_by_test_id("content").text_content() == "you said two"
    page.reload()  # the failed attempt was not saved either
    answered(page, 1)
    assert page.get_by_test_id("error").count() == 0
    assert page.get_by_test_id("user-message").count() == 2

    page.evaluate("""() => {  // a conversation whose answer was stopped before any output
        const turns = [{role: 'user', content: 'echo: a'}, {role: 'assistant', content: '', stopped: true}];
        localStorage.setItem('thorgen.conversation.stopped', JSON.stringify(turns));
        localStorage.setItem('thorgen.conversations', JSON.stringify([{id: 'stopped', title: 'a', updated: 1}]));
        localStorage.setItem('thorgen.current', 'stopped');
    }""")
    page.reload()
    answered(page, 1)
    assert page.get_by_test_id("stopped").text_content() == "(stopped before any output)"
    send(page, "echo: b", 2)
    assert bodies[-1]["messages"] == [{"role": "user", "content": "echo: a"}, {"role": "user", "content": "echo: b"}]


def luminance(rgb: str) -> float:
    channels = [int(c) / 255 for c in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3]]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(fg: str, bg: str) -> float:
    """WCAG 2 contrast ratio of two computed CSS colours (rgb(...) strings)."""
    hi, lo = sorted((luminance(fg), luminance(bg)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


BACKGROUND = """e => { for (; e; e = e.parentElement) { const c = getComputedStyle(e).backgroundColor;
                       if (c !== 'rgba(0, 0, 0, 0)' && c !== 'transparent') return c; }
                     return 'rgb(255, 255, 255)'; }"""  # the first opaque background up the tree


def test_math_code_and_dark_mode_contrast_and_favicon(served):
    page = open_page(served, color_scheme="dark")
    send(page, "math please", 1)
    reply = page.get_by_test_id("assistant-message").last
    math = reply.locator("math")
    assert math.count() == 1 and math.get_attribute("display") == "inline"
    assert [mi.text_content() for mi in math.locator("mi").all()] == ["e", "i", "π"]
    assert math.evaluate("e => e.getBoundingClientRect().width") > 20  # the browser lays MathML out
    assert luminance(page.locator("body").evaluate("e => getComputedStyle(e).backgroundColor")) < 0.05  # dark
    readable = {
        "link": reply.locator("a"),
        "inline code": reply.locator("p code"),
        "table header": reply.locator("th").first,
        "table cell": reply.locator("td").first,
        "keyword": reply.locator("pre.hl span.k").first,
        "number": reply.locator("pre.hl span.mi").first,
    }
    for what, element in readable.items():
        ratio = contrast(element.evaluate("e => getComputedStyle(e).color"), element.evaluate(BACKGROUND))
        assert ratio >= 4.5, (what, ratio)
    assert reply.locator("a").get_attribute("href") == "https://example.com/euler"
    url = served[0]
    icon = page.request.get(url + "/favicon.ico")
    assert icon.ok and icon.headers["content-type"].startswith("image/svg+xml") and b"<svg" in icon.body()
    linked = page.locator("link[rel=icon]").get_attribute("href")
    assert page.request.get(url + linked).body() == icon.body()


PNG = "data:image/png;base64,"


def png_bytes(colour: str) -> bytes:
    image_module = pytest.importorskip("PIL.Image")
    out = io.BytesIO()
    image_module.new("RGB", (4, 3), colour).save(out, format="PNG")
    return out.getvalue()


def test_attached_images_are_sent_as_image_url_parts(served):
    page = open_page(served)
    bodies = []

    def answer(route):  # the scripted engine has no vision tower: the page's request is what is checked here
        bodies.append(route.request.post_data_json)
        chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Seen."}}]}
        route.fulfill(
            status=200, content_type="text/event-stream", body=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"
        )

    page.route("**/v1/chat/completions", answer)
    red, green, blue = png_bytes("red"), png_bytes("green"), png_bytes("blue")
    page.get_by_test_id("file").set_input_files([{"name": "red.png", "mimeType": "image/png", "buffer": red}])
    page.get_by_test_id("thumbnail").wait_for()
    send(page, "what is this?", 1)
    assert bodies[0]["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": PNG + base64.b64encode(red).decode()}},
                {"type": "text", "text": "what is this?"},
            ],
        }
    ]
    assert page.get_by_test_id("thumbnail").count() == 0  # sent: the tray is empty
    assert page.get_by_test_id("user-message").get_by_test_id("image").count() == 1
    assert "base64" not in page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
    saved = page.evaluate(
        "Object.keys(localStorage).filter(k => k.startsWith('thorgen.conversation.'))"
        ".map(k => JSON.parse(localStorage.getItem(k)))"
    )
    assert saved == [
        [{"role": "user", "content": "what is this?", "imageCount": 1}, {"role": "assistant", "content": "Seen."}]
    ]

    for event, data in (("paste", green), ("drop", blue)):  # paste into the box, drop onto the chat
        page.evaluate(
            """([event, bytes]) => {
            const files = new DataTransfer();
            files.items.add(new File([new Uint8Array(bytes)], 'x.png', {type: 'image/png'}));
            const target = document.getElementById(event === 'paste' ? 'input' : 'chat');
            target.dispatchEvent(event === 'paste' ? new ClipboardEvent('paste', {clipboardData: files, bubbles: true})
                                                   : new DragEvent('drop', {dataTransfer: files, bubbles: true,
                                                                           cancelable: true}));
        }""",
            [event, list(data)],
        )
    page.wait_for_function("() => document.querySelectorAll('[data-testid=thumbnail]').length === 2")
    send(page, "and these?", 2)
    last = bodies[-1]["messages"]
    assert [part["image_url"]["url"] for part in last[-1]["content"][:2]] == [
        PNG + base64.b64encode(green).decode(),
        PNG + base64.b64encode(blue).decode(),
    ]
    assert last[0]["content"][0]["type"] == "image_url"  # still in memory: the earlier image goes along

    page.reload()  # saved history kept only a placeholder
    answered(page, 2)
    assert page.get_by_test_id("image-note").first.text_content().startswith("[image]")
    send(page, "and now?", 3)
    assert bodies[-1]["messages"][0] == {"role": "user", "content": "[image]\nwhat is this?"}
    assert bodies[-1]["messages"][2]["content"] == "[image]\n[image]\nand these?"


def test_attached_image_reaches_the_model_and_the_answer_streams(served, tiny_checkpoint):
    """The tiny checkpoint (with a vision tower) on the reference backend: the page's image part is read,
    expanded into its soft tokens and answered as a stream."""
    from tiny_server import tiny_server

    browser = served[4]
    with tiny_server(tiny_checkpoint, 1024) as (url, state):
        spans = []
        original = state.client.submit

        def recording(*args, **kwargs):
            spans.append(kwargs.get("images", ()))
            return original(*args, **kwargs)

        state.client.submit = recording
        page = browser.new_context().new_page()
        page.goto(url + "/")
        page.get_by_test_id("model").filter(has_text="tiny").wait_for(timeout=10000)
        page.get_by_test_id("settings-toggle").click()
        page.get_by_test_id("max-tokens").fill("6")
        chunks = []
        page.on(
            "response",
            lambda r: (
                chunks.append(r.headers.get("content-type", "")) if r.url.endswith("/v1/chat/completions") else None
            ),
        )
        photo = png_bytes("orange")
        page.get_by_test_id("file").set_input_files([{"name": "o.png", "mimeType": "image/png", "buffer": photo}])
        page.get_by_test_id("thumbnail").wait_for()
        send(page, "what is this?", 1)
        assert len(spans) == 1 and len(spans[0]) == 1 and spans[0][0].image.soft_tokens > 0
        assert chunks and chunks[0].startswith("text/event-stream")  # streamed
        answer = page.get_by_test_id("assistant-message").last
        assert answer.get_attribute("data-done") == "1" and "error" not in (answer.get_attribute("class") or "")
        page.context.close()


@pytest.mark.parametrize("wait_for_header", [True, False])
def test_the_api_key_from_settings_is_used_from_the_next_request(served, wait_for_header):
    """A server with --api-key: the page loads without the key (its /v1/models is a 401), then the key entered in
    Settings names the model and answers the very next message, with no reload."""
    _, engine, tok, state, browser = served
    with running_server(create_app(state, api_key="sekrit")) as keyed:
        page = browser.new_context().new_page()
        bodies = requests_of(page)
        page.goto(keyed + "/")
        page.get_by_test_id("model").filter(has_text="API key").wait_for(timeout=10000)
        page.get_by_test_id("settings-toggle").click()
        page.get_by_test_id("api-key").fill("sekrit")
        page.get_by_test_id("api-key").press("Tab")  # (a change event, as leaving the field gives)
        if wait_for_header:
            page.get_by_test_id("model").filter(has_text=state.model_id).wait_for(timeout=10000)
        send(page, "echo: with a key", 1)
        assert page.get_by_test_id("error").count() == 0
        content = page.get_by_test_id("assistant-message").last.get_by_test_id("content").text_content()
        assert content == "you said with a key"
        assert bodies[-1]["model"] == state.model_id
        page.context.close()


def test_attached_video_is_sent_as_a_video_url_part_and_reaches_the_model(served, tiny_checkpoint):
    """The tiny checkpoint on the reference backend: a video attached on the page goes as a video_url part, its
    frames reach the engine, and after a reload the turn keeps a [video] placeholder only."""
    pytest.importorskip("av")
    from tiny_server import tiny_server
    from video_clips import mp4

    browser = served[4]
    with tiny_server(tiny_checkpoint, 2048) as (url, state):
        spans = []
        original = state.client.submit

        def recording(*args, **kwargs):
            spans.append(kwargs.get("images", ()))
            return original(*args, **kwargs)

        state.client.submit = recording
        page = browser.new_context().new_page()
        page.goto(url + "/")
        page.get_by_test_id("model").filter(has_text="tiny").wait_for(timeout=10000)
        page.get_by_test_id("settings-toggle").click()
        page.get_by_test_id("max-tokens").fill("4")
        bodies = requests_of(page)
        clip = mp4(frames=3)
        page.get_by_test_id("file").set_input_files([{"name": "c.mp4", "mimeType": "video/mp4", "buffer": clip}])
        page.get_by_test_id("thumbnail").wait_for()
        send(page, "what moves?", 1)
        part = bodies[0]["messages"][-1]["content"][0]
        assert part == {
            "type": "video_url",
            "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(clip).decode()},
        }
        assert len(spans) == 1 and len(spans[0]) == 3  # one span per frame
        assert page.get_by_test_id("user-message").get_by_test_id("video").count() == 1
        page.reload()
        answered(page, 1)
        assert page.get_by_test_id("image-note").first.text_content().startswith("[video]")
        page.context.close()
