"""Serve stage: the web UI's server side: model output as safe HTML (markdown, highlighted code, MathML), the
highlighting stylesheet and the favicon.

markdown-it-py parses with raw HTML off (so model output can never inject markup), Pygments highlights fenced code,
latex2mathml turns `$..$`, `\\(..\\)`, `$$..$$` and `\\[..\\]` into MathML, which browsers render natively. Its
MathML is rebuilt through an allowlist of elements and attributes, because latex2mathml passes `\\text{..}`
through unescaped and `\\href`/`\\style` into attributes.
"""

from __future__ import annotations

import html
import xml.etree.ElementTree as ElementTree

from fastapi import APIRouter
from fastapi.responses import Response
from latex2mathml.converter import convert as latex_to_mathml
from markdown_it import MarkdownIt
from markdown_it.rules_block import StateBlock
from markdown_it.rules_inline import StateInline
from pydantic import BaseModel, ConfigDict, Field
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.util import ClassNotFound

MAX_MARKDOWN_CHARS = 1_000_000  # well above the longest reply a 64k-token context can hold
MAX_FORMULA_CHARS = 4_000  # longer formulas are shown as their source: latex2mathml recurses per brace
LIGHT_STYLE, DARK_STYLE = "default", "github-dark"  # Pygments styles for prefers-color-scheme light / dark
MATHML = "{http://www.w3.org/1998/Math/MathML}"
MATHML_ELEMENTS = {
    "math",
    "mrow",
    "mi",
    "mn",
    "mo",
    "ms",
    "mtext",
    "mspace",
    "msup",
    "msub",
    "msubsup",
    "mfrac",
    "msqrt",
    "mroot",
    "mover",
    "munder",
    "munderover",
    "mtable",
    "mtr",
    "mtd",
    "mstyle",
    "mpadded",
    "mphantom",
    "menclose",
    "merror",
    "semantics",
    "annotation",
    "mmultiscripts",
    "mprescripts",
    "none",
    "mlabeledtr",
}
MATHML_ATTRIBUTES = {
    "display",
    "mathvariant",
    "mathsize",
    "mathcolor",
    "mathbackground",
    "stretchy",
    "fence",
    "separator",
    "form",
    "lspace",
    "rspace",
    "minsize",
    "maxsize",
    "movablelimits",
    "accent",
    "accentunder",
    "largeop",
    "symmetric",
    "linethickness",
    "columnalign",
    "rowalign",
    "columnspacing",
    "rowspacing",
    "columnlines",
    "rowlines",
    "frame",
    "width",
    "height",
    "depth",
    "displaystyle",
    "scriptlevel",
    "notation",
    "encoding",
}
FAVICON_SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    '<rect width="32" height="32" rx="7" fill="#2f6fde"/>'
    '<path d="M9 9h14v4h-5v12h-4V13H9z" fill="#fff"/></svg>'
)


def _safe_mathml_element(node: ElementTree.Element) -> str:
    tag = node.tag.removeprefix(MATHML)
    inner = html.escape(node.text or "", quote=False)
    inner += "".join(_safe_mathml_element(child) + html.escape(child.tail or "", quote=False) for child in node)
    if tag not in MATHML_ELEMENTS:  # anything else (script, a, ...) keeps only its text
        return inner
    attrs = "".join(
        f' {name}="{html.escape(value)}"' for name, value in node.attrib.items() if name in MATHML_ATTRIBUTES
    )
    if tag == "math":
        attrs = ' xmlns="http://www.w3.org/1998/Math/MathML"' + attrs
    return f"<{tag}{attrs}>{inner}</{tag}>"


def formula(latex: str, display: bool) -> str:
    """LaTeX as MathML, or (too long, or not LaTeX latex2mathml can read) its source in <code>."""
    source = html.escape(latex)
    if len(latex) > MAX_FORMULA_CHARS:
        return f'<code class="math-source">{source}</code>'
    try:
        mathml = latex_to_mathml(latex, display="block" if display else "inline")
        if "<!" in mathml:  # no doctype/entity declarations reach the XML parser
            raise ValueError("markup declaration in MathML")
        return _safe_mathml_element(ElementTree.fromstring(mathml))
    except Exception:  # noqa: BLE001 - latex2mathml raises many kinds (its own, IndexError, RecursionError)
        return f'<code class="math-source" title="not renderable as math">{source}</code>'


def _closing(src: str, start: int, close: str) -> int:
    """Index of `close` at or after start, or -1; a `\\$` is a literal dollar, not a closing one."""
    end = src.find(close, start)
    while close.startswith("$") and end > 0 and src[end - 1] == "\\":
        end = src.find(close, end + 1)
    return end


def math_inline(state: StateInline, silent: bool) -> bool:
    """`$x$`, `\\(x\\)` inline; `$$x$$`, `\\[x\\]` inside a paragraph as display math."""
    src, pos = state.src, state.pos
    for opener, close, display in (("$$", "$$", True), ("\\[", "\\]", True), ("\\(", "\\)", False), ("$", "$", False)):
        if src.startswith(opener, pos):
            break
    else:
        return False
    begin = pos + len(opener)
    end = _closing(src, begin, close)
    if end <= begin:
        return False
    latex = src[begin:end]
    if opener == "$" and (latex[0].isspace() or latex[-1].isspace() or src[end + 1 : end + 2].isdigit()):
        return False  # "$5 and $10" is money, not math: pandoc's rule
    if not silent:
        token = state.push("math_block_inline" if display else "math_inline", "math", 0)
        token.content, token.markup = latex, opener
    state.pos = end + len(close)
    return True


def math_block(state: StateBlock, start_line: int, end_line: int, silent: bool) -> bool:
    """A block opened by `$$` or `\\[` at a line's start, closed by `$$` or `\\]` on it or a later line."""
    if state.sCount[start_line] - state.blkIndent >= 4:
        return False  # indented code
    begin = state.bMarks[start_line] + state.tShift[start_line]
    first = state.src[begin : state.eMarks[start_line]]
    opener = next((o for o in ("$$", "\\[") if first.startswith(o)), None)
    if opener is None:
        return False
    close = "$$" if opener == "$$" else "\\]"
    lines, line, text = [], start_line, first[len(opener) :]
    while True:
        cut = text.find(close)
        if cut >= 0:
            if text[cut + len(close) :].strip():
                return False  # text after the formula: a paragraph with display math, the inline rule's case
            lines.append(text[:cut])
            break
        lines.append(text)
        line += 1
        if line >= end_line:
            return False
        text = state.src[state.bMarks[line] + state.tShift[line] : state.eMarks[line]]
    if not silent:
        token = state.push("math_block", "math", 0)
        token.block, token.content, token.markup = True, "\n".join(lines).strip(), opener
        token.map = [start_line, line + 1]
    state.line = line + 1
    return True


def highlight_code(code: str, lang: str, _attrs: str) -> str:
    """A fenced block as <pre class="hl"><code> with Pygments' token classes (the stylesheet colours them)."""
    try:
        lexer = get_lexer_by_name(lang, stripnl=False, ensurenl=False) if lang else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    code = code.removesuffix("\n")
    body = highlight(code, lexer, HtmlFormatter(nowrap=True))  # it ends each line with "\n", the last too
    body = body if code.endswith("\n") else body.removesuffix("\n")
    language = f' class="language-{html.escape(lang)}"' if lang else ""
    return f'<pre class="hl"><code{language}>{body}</code></pre>'


def _markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": highlight_code})
    md.enable(["table", "strikethrough"])
    md.inline.ruler.before("escape", "math_inline", math_inline)
    md.block.ruler.before("fence", "math_block", math_block, {"alt": ["paragraph", "reference", "blockquote"]})
    md.add_render_rule("math_inline", lambda self, tokens, idx, options, env: formula(tokens[idx].content, False))
    md.add_render_rule("math_block_inline", lambda self, tokens, idx, options, env: formula(tokens[idx].content, True))
    md.add_render_rule("math_block", lambda self, tokens, idx, options, env: formula(tokens[idx].content, True) + "\n")
    default_link = md.renderer.rules.get("link_open") or (
        lambda self, tokens, idx, options, env: self.renderToken(tokens, idx, options, env)
    )

    def link_open(self, tokens, idx, options, env):  # links open outside the chat, without the page's opener
        tokens[idx].attrSet("target", "_blank")
        tokens[idx].attrSet("rel", "noopener noreferrer")
        return default_link(self, tokens, idx, options, env)

    md.add_render_rule("link_open", link_open)

    def image(self, tokens, idx, options, env):  # a link to the image: model output never makes the page fetch
        alt = html.escape(self.renderInlineAsText(tokens[idx].children or [], options, env)) or "image"
        src = html.escape(tokens[idx].attrGet("src") or "")
        return f'<a href="{src}" target="_blank" rel="noopener noreferrer">{alt}</a>'

    md.add_render_rule("image", image)
    return md


MARKDOWN = _markdown()


def render_markdown(text: str) -> str:
    """Model output (markdown with math) as HTML that is safe to put into the page."""
    return MARKDOWN.render(text)


def highlight_css() -> str:
    """Pygments' token colours under .hl: its light style, and its dark one for prefers-color-scheme: dark."""
    parts = []
    for scheme, style in (("light", LIGHT_STYLE), ("dark", DARK_STYLE)):
        formatter = HtmlFormatter(style=style)
        rules = formatter.get_background_style_defs(".hl") + formatter.get_token_style_defs(".hl")
        parts.append(f"@media (prefers-color-scheme: {scheme}) {{\n" + "\n".join(rules) + "\n}")
    return "\n".join(parts) + "\n"


class RenderRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    markdown: str = Field(max_length=MAX_MARKDOWN_CHARS, description="the text to render (model output)")


class RenderedHTML(BaseModel):
    html: str


router = APIRouter(include_in_schema=False)  # the web UI's own routes, not part of the OpenAI-style API
HIGHLIGHT_CSS = highlight_css()


@router.post("/ui/render", response_model=RenderedHTML)
def render(req: RenderRequest) -> RenderedHTML:  # a plain def: FastAPI runs it in its thread pool
    return RenderedHTML(html=render_markdown(req.markdown))


@router.get("/ui/highlight.css")
async def stylesheet() -> Response:
    return Response(HIGHLIGHT_CSS, media_type="text/css", headers={"Cache-Control": "max-age=3600"})


@router.get("/favicon.ico")
@router.get("/favicon.svg")
async def favicon() -> Response:
    return Response(FAVICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})
