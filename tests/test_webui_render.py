"""Serve stage tests: the web UI's render endpoint (markdown, Pygments highlighting, MathML) makes safe HTML, and
the stylesheet and favicon routes answer."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from html.parser import HTMLParser
from urllib.parse import urlsplit

import pytest

pytest.importorskip("markdown_it")
pytest.importorskip("latex2mathml")
pytest.importorskip("pygments")
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from thorgen.serve import render  # noqa: E402


class Elements(HTMLParser):
    """Every start tag and its attributes, as a browser's tokenizer would see them."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def no_active_content(html: str) -> None:
    for tag, attrs in Elements(html).tags:
        assert tag not in ("script", "iframe", "object", "embed", "style", "img", "svg"), (tag, html)
        for name, value in attrs.items():
            assert not name.startswith("on") and name not in ("style", "srcdoc"), (tag, name, html)
            if name == "href":  # relative links are harmless; no script-running scheme
                assert urlsplit(value.strip()).scheme in ("", "http", "https", "mailto"), (value, html)
            if name == "style":
                assert value.startswith("text-align:"), html


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(render.router)
    return TestClient(app)


def post(client, markdown) -> str:
    answer = client.post("/ui/render", json={"markdown": markdown})
    assert answer.status_code == 200, answer.text
    return answer.json()["html"]


@pytest.mark.parametrize(
    "markdown",
    [
        "<script>alert(1)</script>",
        "<img src=x onerror=alert(1)>",
        "[x](javascript:alert(1)) ![y](javascript:alert(2)) [z](vbscript:x) [w](data:text/html,<script>1</script>)",
        r"$\text{<script>alert(1)</script>}$ and $\text{a<b}$",
        r"$\href{javascript:alert(1)}{click}$ $\style{background:url(x)}{y}$ $\color{red\" onclick=\"x}{z}$",
        '```"><script>alert(1)</script>\n<b>code</b>\n```',
        "| <b>h</b> |\n|---|\n| <svg onload=alert(1)> |",
        r"\[ <!DOCTYPE x [<!ENTITY a 'b'>]> \]",
    ],
)
def test_model_output_cannot_inject_markup(client, markdown):
    html = post(client, markdown)
    no_active_content(html)


def test_script_in_markdown_is_text(client):
    html = post(client, "hello <script>alert('x')</script> **bold**")
    assert "&lt;script&gt;alert(" in html and "<strong>bold</strong>" in html


def test_code_block_highlighted_with_pygments_classes(client):
    html = post(client, "```python\ndef f(x):\n    return 'hi <b>'\n```")
    assert '<pre class="hl"><code class="language-python">' in html
    assert '<span class="k">def</span>' in html and '<span class="nf">f</span>' in html
    assert "&lt;b&gt;" in html and "<b>" not in html
    unknown = post(client, "```no-such-language\nx < y\n```")
    assert 'class="language-no-such-language"' in unknown and "x &lt; y" in unknown


@pytest.mark.parametrize(
    "markdown,display",
    [
        (r"Euler: $e^{i\pi}+1=0$.", "inline"),
        (r"Euler: \(e^{i\pi}+1=0\).", "inline"),
        ("$$\ne^{i\\pi}+1=0\n$$", "block"),
        (r"\[e^{i\pi}+1=0\]", "block"),
        (r"so $$e^{i\pi}+1=0$$ holds", "block"),
    ],
)
def test_math_becomes_mathml(client, markdown, display):
    html = post(client, markdown)
    start = html.index("<math")
    math = ElementTree.fromstring(html[start : html.index("</math>") + len("</math>")])
    assert math.get("display") == display
    ns = "{http://www.w3.org/1998/Math/MathML}"
    assert [e.text for e in math.iter(ns + "mi")] == ["e", "i", "π"]
    assert [e.text for e in math.iter(ns + "mn")] == ["1", "0"]


def test_dollars_that_are_money_or_broken_math_stay_text(client):
    assert "<math" not in post(client, "It costs $5 and $10 today.")
    broken = post(client, r"bad $\frac{1}{$ formula")
    assert "<math" not in broken and r"\frac{1}{" in broken
    assert "<math" not in post(client, "`$x$` and\n\n    $y$\n")  # code spans and indented code keep dollars


def test_tables_and_links(client):
    html = post(client, "| a | b |\n|:--|--:|\n| 1 | 2 |\n\n[site](https://example.com)")
    assert '<td style="text-align:right">2</td>' in html
    assert '<a href="https://example.com" target="_blank" rel="noopener noreferrer">site</a>' in html


def test_bad_requests_get_400_style_errors(client):
    assert client.post("/ui/render", json={"text": "x"}).status_code == 422  # the app's handler makes it 400
    assert client.post("/ui/render", json={"markdown": "x" * (render.MAX_MARKDOWN_CHARS + 1)}).status_code == 422
    too_long = "$" + "x+" * render.MAX_FORMULA_CHARS + "$"
    assert "<math" not in post(client, too_long)
    nested = "$" + "{" * 3000 + "x" + "}" * 3000 + "$"
    no_active_content(post(client, nested))  # deep nesting (latex2mathml recurses) still answers


def test_render_through_the_app_answers_400(tmp_path):
    scripted_backend = pytest.importorskip("scripted_backend")
    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate
    from pathlib import Path

    template = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
    tok = Tokenizer.from_file(scripted_backend.write_test_tokenizer(tmp_path / "tokenizer.json"))
    engine = scripted_backend.ScriptedBackend(lambda prompt: [])
    app = create_app(scripted_backend.scripted_state(engine, tok, ChatTemplate(template.read_text())))
    with TestClient(app) as http:
        bad = http.post("/ui/render", json={"markdown": 5})
        assert bad.status_code == 400 and "markdown" in bad.json()["error"]["message"]
        assert http.post("/ui/render", content=b"{not json").status_code == 400
        assert http.post("/ui/render", json={"markdown": "**x**"}).json() == {"html": "<p><strong>x</strong></p>\n"}
        icon = http.get("/favicon.ico")
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
        assert ElementTree.fromstring(icon.text).tag == "{http://www.w3.org/2000/svg}svg"
        css = http.get("/ui/highlight.css")
        assert css.headers["content-type"].startswith("text/css")
        assert "prefers-color-scheme: dark" in css.text and ".hl .k {" in css.text
        assert "/ui/render" not in http.get("/openapi.json").json()["paths"]  # the UI's routes are not the API


def test_any_text_renders_to_safe_html():
    hypothesis = pytest.importorskip("hypothesis")
    strategies = pytest.importorskip("hypothesis.strategies")
    pieces = strategies.sampled_from(
        [
            "$",
            "$$",
            "\\(",
            "\\)",
            "\\[",
            "\\]",
            "\\text{",
            "\\href{",
            "}",
            "{",
            "<",
            ">",
            "<script>",
            "```",
            "`",
            "|",
            "---",
            "\n",
            "\n\n",
            "> ",
            "- ",
            "[a](",
            ")",
            "javascript:",
            "x",
            " ",
            "\\frac",
            "&",
            '"',
            "![i](",
            "\\\\",
        ]
    )

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(strategies.lists(pieces, max_size=40).map("".join))
    def safe(markdown):
        no_active_content(render.render_markdown(markdown))

    safe()
