"""Serve stage: a chat request's messages and tools checked and turned into what the chat template renders
(content strings or text + image and video parts, tool calls, tool definitions), with the media's sources
collected."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from ..runtime.media.images import SOFT_TOKEN_BUDGETS
from .protocol import APIError, ContentPart, Message, Tool, ToolCallIn
from .request import ImageSource, VideoSource
from .tool_schemas import check_shapes

S = TypeVar("S", ImageSource, VideoSource)  # an image's or a video's source
ROLES = ("system", "developer", "user", "assistant", "tool")
_TOOL_NAME = re.compile(r"[A-Za-z0-9_\-.]{1,64}")
# image_url.detail: "low" takes the smallest soft-token budget, "auto" and "high" the request's (or the server's)
DETAIL_BUDGETS = {"auto": None, "high": None, "low": SOFT_TOKEN_BUDGETS[0]}


def image_source(url: Any, detail: Any, where: str, param: str = "messages") -> ImageSource:
    """An image part's URL and detail, checked (its bytes are read later, once per request)."""
    if not isinstance(url, str) or not url:
        raise APIError(f"{where}: the image URL must be a non-empty string", param=param)
    colon = url.find(":", 0, 8)  # (a data URL can be megabytes long: nothing past its scheme is copied)
    scheme = url[:colon].lower() if colon > 0 else ""
    if scheme not in ("data", "http", "https"):
        raise APIError(
            f"{where}: an image URL is a data: URL (data:image/png;base64,...) or an http(s) URL; got {url[:40]!r}",
            param=param,
        )
    if detail is not None and detail not in DETAIL_BUDGETS:
        raise APIError(f"{where}: detail must be one of {', '.join(DETAIL_BUDGETS)}; got {detail!r}", param=param)
    return ImageSource(url, where, DETAIL_BUDGETS.get(detail))


def video_source(url: Any, where: str, param: str = "messages") -> VideoSource:
    """A video part's URL, checked (its bytes are read later, once per request)."""
    if not isinstance(url, str) or not url:
        raise APIError(f"{where}: the video URL must be a non-empty string", param=param)
    colon = url.find(":", 0, 8)
    if (url[:colon].lower() if colon > 0 else "") not in ("data", "http", "https"):
        raise APIError(
            f"{where}: a video URL is a data: URL (data:video/mp4;base64,...) or an http(s) URL; got {url[:40]!r}",
            param=param,
        )
    return VideoSource(url, where)


def _media_of(part: ContentPart, where: str) -> ImageSource | VideoSource | None:
    """The image or video a part names, or None for a text part; a 400 for any other part."""
    if part.type == "text" and part.text is not None:
        return None
    if part.type == "image_url" and part.image_url is not None:
        url = part.image_url if isinstance(part.image_url, str) else part.image_url.url
        return image_source(url, None if isinstance(part.image_url, str) else part.image_url.detail, where)
    if part.type == "image" and (part.url or part.image):
        return image_source(part.url or part.image, None, where)
    if part.type == "video_url" and part.video_url is not None:
        return video_source(part.video_url if isinstance(part.video_url, str) else part.video_url.url, where)
    if part.type == "video" and (part.url or part.video):
        return video_source(part.url or part.video, where)
    raise APIError(
        f"{where}: a content part is text ({{'type': 'text', 'text': ...}}), an image "
        f"({{'type': 'image_url', 'image_url': {{'url': ...}}}}) or a video "
        f"({{'type': 'video_url', 'video_url': {{'url': ...}}}}); got type {part.type!r}",
        param="messages",
    )


def _collect(kind: str, found: list[S], sink: list[S] | None, role: str) -> None:
    """A message's images (or videos) appended to `sink`; a 400 where this endpoint (sink None) or the role
    takes none."""
    if not found:
        return
    if sink is None:
        raise APIError(f"{found[0].where}: this endpoint does not take {kind}s", param="messages")
    if role != "user":
        raise APIError(f"{found[0].where}: {kind}s are accepted in user messages only (not {role!r})", param="messages")
    sink += found


def _content(
    m: Message, i: int, images: list[ImageSource] | None, videos: list[VideoSource] | None = None
) -> str | list[dict] | None:
    """A message's content for the template: a string, or (a user message with images or videos) text,
    {"type": "image"} and {"type": "video"} parts in order, each source appended to `images` or `videos` (None:
    that kind is refused here)."""
    if not isinstance(m.content, list):
        return m.content
    parts = [(part, _media_of(part, f"messages[{i}].content[{j}]")) for j, part in enumerate(m.content)]
    found = [source for _, source in parts if source is not None]
    if not found:
        return "".join(part.text for part, _ in parts)
    _collect("image", [s for s in found if isinstance(s, ImageSource)], images, m.role)
    _collect("video", [s for s in found if isinstance(s, VideoSource)], videos, m.role)
    return [
        {"type": "text", "text": part.text}
        if source is None
        else {"type": "image" if isinstance(source, ImageSource) else "video"}
        for part, source in parts
    ]


def validate_tools(tools: list[Tool] | None) -> list[dict] | None:
    if not tools:
        return None
    seen = set()
    out = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if not _TOOL_NAME.fullmatch(fn.name):
            raise APIError(f"tools[{i}].function.name {fn.name!r} must match [A-Za-z0-9_.-]{{1,64}}", param="tools")
        if fn.name in seen:
            raise APIError(f"tool name {fn.name!r} is declared twice", param="tools")
        seen.add(fn.name)
        params = fn.parameters
        if params is not None:
            if params.get("type", "object") != "object":
                raise APIError(f"tools[{i}].function.parameters must be a JSON schema of type 'object'", param="tools")
            check_shapes(params, f"tools[{i}].function.parameters")
        d = {"name": fn.name, "description": fn.description or ""}
        if params is not None:
            d["parameters"] = params
        out.append({"type": "function", "function": d})
    return out


def tool_choice_mode(choice: str | dict | None, tools: list[dict] | None) -> tuple[str, str | None]:
    """-> (mode, forced name) with mode in none/auto/required/named."""
    names = [t["function"]["name"] for t in tools or []]
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError("tool_choice must be 'none', 'auto', 'required' or a named function", param="tool_choice")
        if choice == "required" and not names:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return (choice if names else "none"), None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise APIError("a named tool_choice is {'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not among the declared tools", param="tool_choice")
    return "named", name


def _arguments(call: ToolCallIn, i: int) -> dict | str:
    args = call.function.arguments
    if isinstance(args, dict):
        return args
    try:
        parsed = json.loads(args) if args.strip() else {}
    except ValueError:
        raise APIError(
            f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not valid JSON", param="messages"
        ) from None
    if not isinstance(parsed, dict):
        raise APIError(f"messages[{i}].tool_calls: arguments must be a JSON object", param="messages")
    return parsed


def template_messages(
    messages: list[Message], images: list[ImageSource] | None = None, videos: list[VideoSource] | None = None
) -> list[dict]:
    """OpenAI messages -> the dicts Gemma's template expects: text parts joined (or, in a user message with
    images or videos, text, {"type": "image"} and {"type": "video"} parts, their sources appended to `images` and
    `videos`; None refuses that kind),
    tool-call arguments as mappings, and `role: "tool"` results folded into the preceding assistant message as
    `tool_responses` (the form Google's template renders inside the model turn)."""
    if not messages:
        raise APIError("messages must not be empty", param="messages")
    out: list[dict] = []
    owner: dict | None = None  # the assistant message that tool results attach to
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise APIError(f"messages[{i}].role {m.role!r} is not one of {', '.join(ROLES)}", param="messages")
        content = _content(m, i, images, videos)
        if m.role == "tool":
            if owner is None:
                raise APIError(
                    f"messages[{i}]: a 'tool' message must follow an assistant message with tool_calls",
                    param="messages",
                )
            name = m.name or "unknown"
            for call in owner.get("_ids", []):
                if m.tool_call_id is not None and call[0] == m.tool_call_id:
                    name = call[1]
            owner.setdefault("tool_responses", []).append({"name": name, "response": content or ""})
            continue
        if content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(f"messages[{i}].content is required for role {m.role!r}", param="messages")
        d: dict = {"role": m.role, "content": content}
        owner = None
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c, i)}}
                for c in m.tool_calls
            ]
            d["_ids"] = [(c.id, c.function.name) for c in m.tool_calls]
            owner = d
        out.append(d)
    for d in out:
        d.pop("_ids", None)
    return out
