"""Serve stage tests: image input through HTTP on the reference backend with the tiny checkpoint (which has a vision
tower): OpenAI content parts (data URLs, several images, http URLs from an allowed host), Anthropic image blocks,
Responses input_image items, each refusal as a 400 with the server healthy after, and a long prompt whose image
span crosses the reference engine's prefill chunk."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from thorgen.runtime.media.images import load_image  # noqa: E402
from thorgen.runtime.reference.runner import PREFILL_CHUNK  # noqa: E402
from thorgen.serve.media import MediaOptions  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402

MAX_IMAGES = 3


def png(seed: int, size=(40, 60), mode="RGB") -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).convert(mode).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


class Files(http.server.BaseHTTPRequestHandler):
    """Image files for the http(s) URL tests: /red.png, /moved (a redirect), /big.png (over the cap), /slow.png."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/red.png")
            self.end_headers()
            return
        if self.path == "/slow.png":
            time.sleep(2)
        body = self.files.get(self.path.replace("/slow.png", "/red.png"))
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def files_url():
    Files.files = {"/red.png": png(7), "/big.png": png(8, size=(400, 400))}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    media = MediaOptions(
        budget=70, max_images=MAX_IMAGES, allowed_domains=("127.0.0.1",), fetch_timeout_s=1.0, max_fetch_bytes=100_000
    )
    with tiny_server(tiny_checkpoint, 2048, media=media) as (url, state):
        submitted = []
        original = state.client.submit

        def recording(*args, **kwargs):
            submitted.append((args[0], kwargs.get("images", ())))
            return original(*args, **kwargs)

        state.client.submit = recording
        yield url, state, submitted


def expected_prompt(state, messages: list[dict], images: list[bytes], budget: int = 70) -> tuple[list[int], list]:
    """The prompt the server should submit: the template with {"type": "image"} parts, tokenized, expanded."""
    from thorgen.runtime.media.prompts import expand_image_tokens

    ctx = state.context
    ids = ctx.tokenizer.encode(ctx.template.render(messages, add_generation_prompt=True, enable_thinking=False))
    vision = state.caps.vision
    return expand_image_tokens(ids, [load_image(b, vision, budget) for b in images], vision)


def test_one_data_url_image(served):
    url, state, submitted = served
    red = png(1)
    reply = openai_client(url).chat.completions.create(
        model="tiny",
        max_tokens=4,
        messages=[{"role": "user", "content": [image_part(data_url(red)), {"type": "text", "text": "What is this?"}]}],
    )
    ids, spans = expected_prompt(
        state, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}], [red]
    )
    sent_ids, sent_spans = submitted[-1]
    assert sent_ids == ids and [(s.offset, s.image.hash) for s in sent_spans] == [
        (s.offset, s.image.hash) for s in spans
    ]
    assert reply.usage.prompt_tokens == len(ids)  # the image's soft tokens, boi and eoi count
    tokenized = httpx.post(
        url + "/tokenize",
        json={
            "messages": [
                {"role": "user", "content": [image_part(data_url(red)), {"type": "text", "text": "What is this?"}]}
            ]
        },
    ).json()
    assert tokenized["tokens"] == ids
    assert spans[0].image.soft_tokens > 10 and reply.choices[0].finish_reason == "length"


def test_two_images_and_budgets(served):
    url, state, submitted = served
    first, second = png(2), png(3, size=(90, 30))
    messages = [
        {
            "role": "user",
            "content": [
                image_part(data_url(first)),
                {"type": "text", "text": "and"},
                {"type": "image", "url": data_url(second)},
            ],
        }
    ]
    client = openai_client(url)
    client.chat.completions.create(
        model="tiny", max_tokens=2, messages=messages, extra_body={"mm_processor_kwargs": {"max_soft_tokens": 140}}
    )
    spans = submitted[-1][1]
    assert [s.image.hash for s in spans] == [load_image(b, state.caps.vision, 140).hash for b in (first, second)]
    assert spans[1].offset > spans[0].end
    messages[0]["content"][0]["image_url"]["detail"] = "low"  # low: the smallest budget, 70
    stream = client.chat.completions.create(
        model="tiny",
        max_tokens=3,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"mm_processor_kwargs": {"max_soft_tokens": 140}},
    )
    usage = [c.usage for c in stream if c.usage][-1]
    ids, spans = submitted[-1]
    assert spans[0].image.hash == load_image(first, state.caps.vision, 70).hash and usage.prompt_tokens == len(ids)


def test_image_url_from_an_allowed_host(served, files_url):
    url, state, submitted = served
    client = openai_client(url)
    client.chat.completions.create(
        model="tiny",
        max_tokens=2,
        messages=[{"role": "user", "content": [image_part(files_url + "/red.png"), {"type": "text", "text": "hi"}]}],
    )
    assert submitted[-1][1][0].image.hash == load_image(Files.files["/red.png"], state.caps.vision, 70).hash


def refusal(client, content=None, messages=None, **extra) -> str:
    messages = messages or [{"role": "user", "content": content}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=messages, extra_body=extra or None)
    return err.value.body["message"]


def test_bad_images_are_400s_and_the_server_stays_healthy(served, files_url):
    url, state, submitted = served
    client, text = openai_client(url), {"type": "text", "text": "hi"}
    good = image_part(data_url(png(4)))
    huge = io.BytesIO()
    Image.new("1", (8000, 7000)).save(huge, format="PNG")  # 56 M pixels, a few KB: refused from the header
    cases = {
        "not valid base64": [image_part("data:image/png;base64,@@@not-base64"), text],
        "not an image in a format": [image_part(data_url(b"hello, not a picture")), text],
        "not an image type": [image_part(data_url(png(4), "text/plain")), text],
        "at most 50000000": [image_part(data_url(huge.getvalue())), text],
        "not among the allowed": [image_part("http://localhost:1/x.png"), text],
        "redirect": [image_part(files_url + "/moved"), text],
        "larger than 100000 bytes": [image_part(files_url + "/big.png"), text],
        "longer than 1 s": [image_part(files_url + "/slow.png"), text],
        "HTTP 404": [image_part(files_url + "/none.png"), text],
        "data: URL": [image_part("ftp://example.com/x.png"), text],
        "detail must be": [image_part(data_url(png(4)), detail="ultra"), text],
        f"at most {MAX_IMAGES}": [good] * (MAX_IMAGES + 1) + [text],
        "image token": [good, {"type": "text", "text": "look: <|image|>"}],
        "a content part is text": [{"type": "input_audio", "input_audio": {}}, text],
    }
    before = len(submitted)
    for needle, content in cases.items():
        assert needle in refusal(client, content), needle
    assert "user messages only" in refusal(
        client, messages=[{"role": "system", "content": [good]}, {"role": "user", "content": "hi"}]
    )
    assert "user messages only" in refusal(
        client,
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [good, text]},
            {"role": "user", "content": "again"},
        ],
    )
    assert "image token" in refusal(client, messages=[{"role": "user", "content": "typed <|image|> here"}])
    for budget in (100, 0, "280", 2240):
        assert "max_soft_tokens must be one of 70, 140, 280, 560, 1120" in refusal(
            client, [good, text], mm_processor_kwargs={"max_soft_tokens": budget}
        )
    assert "only max_soft_tokens" in refusal(client, [good, text], mm_processor_kwargs={"do_resize": False})
    assert len(submitted) == before  # nothing reached the engine
    assert httpx.get(url + "/health").status_code == 200
    reply = client.chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": [good, text]}]
    )
    assert reply.choices[0].message.content is not None


def test_anthropic_image_block(served):
    anthropic = pytest.importorskip("anthropic")
    url, state, submitted = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    blue = png(5)
    msg = client.messages.create(
        model="tiny",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(blue).decode(),
                        },
                    },
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    )
    ids, spans = submitted[-1]
    assert spans[0].image.hash == load_image(blue, state.caps.vision, 70).hash
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == len(ids)
    count = client.messages.count_tokens(
        model="tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(blue).decode(),
                        },
                    },
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    )
    assert count.input_tokens == len(ids)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="tiny",
            max_tokens=3,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}
                    ],
                }
            ],
        )
    assert "messages[0].content[0]" in err.value.message and "base64" in err.value.message
    with pytest.raises(anthropic.BadRequestError):  # the url source follows the same domain rule
        client.messages.create(
            model="tiny",
            max_tokens=3,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}],
                }
            ],
        )


def _image_block(data: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
    }


WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# request shapes with images whose prompt count_tokens must count exactly as /v1/messages charges it
COUNTED_IMAGES = {
    "one image": {"messages": [{"role": "user", "content": [_image_block(png(5)), {"type": "text", "text": "It?"}]}]},
    "two images, system, tools": {
        "system": "Be brief.",
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": [_image_block(png(5)), {"type": "text", "text": "and"}, _image_block(png(6))]}
        ],
    },
    "a url image, forced tool": {
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": "FILES/red.png"}},
                    {"type": "text", "text": "Where?"},
                ],
            }
        ],
    },
    "an image in an earlier turn": {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": [_image_block(png(5)), {"type": "text", "text": "Weather there?"}]},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "rain"}, _image_block(png(6))],
            },
        ],
    },
}


@pytest.mark.parametrize("shape", COUNTED_IMAGES)
def test_count_tokens_counts_images_as_messages_charges(served, files_url, shape):
    anthropic = pytest.importorskip("anthropic")
    url, _, submitted = served
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)
    body = json.loads(json.dumps({"model": "tiny", **COUNTED_IMAGES[shape]}).replace("FILES/", files_url + "/"))
    counted = client.messages.count_tokens(**body).input_tokens
    msg = client.messages.create(max_tokens=2, **body)
    ids, spans = submitted[-1]
    assert spans and counted == msg.usage.input_tokens + msg.usage.cache_read_input_tokens == len(ids)


def test_responses_input_image(served):
    url, state, submitted = served
    client = openai_client(url)
    green = png(6)
    r = client.responses.create(
        model="tiny",
        max_output_tokens=3,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What colour?"},
                    {"type": "input_image", "image_url": data_url(green), "detail": "auto"},
                ],
            }
        ],
    )
    ids, spans = submitted[-1]
    assert spans[0].image.hash == load_image(green, state.caps.vision, 70).hash
    assert r.usage.input_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model="tiny",
            max_output_tokens=3,
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}]}],
        )
    assert "input[0].content[0]" in err.value.body["message"]


def test_long_prompt_with_an_image_across_the_prefill_chunk(served):
    url, state, submitted = served
    words = " ".join(f"w{i}" for i in range(100))  # the tiny tokenizer: about a token a character
    reply = openai_client(url).chat.completions.create(
        model="tiny",
        max_tokens=3,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": words[:290]},
                    image_part(data_url(png(9))),
                    {"type": "text", "text": words},
                ],
            }
        ],
    )
    ids, spans = submitted[-1]
    assert spans[0].offset < PREFILL_CHUNK < spans[0].end  # a chunk boundary would fall inside the span
    assert reply.usage.prompt_tokens == len(ids) > 2 * PREFILL_CHUNK and reply.usage.completion_tokens == 3


def test_http_urls_are_off_without_allowed_domains():
    import asyncio

    from thorgen.serve.media import fetch
    from thorgen.serve.protocol import APIError

    with pytest.raises(APIError, match="--allowed-media-domains") as err:
        asyncio.run(fetch("https://example.com/a.png", MediaOptions(), "messages[0].content[0]"))
    assert err.value.status == 400 and err.value.param == "messages"


def test_chat_client_attaches_images(served, tmp_path):
    from thorgen.serve.tools.chat import run_chat

    url, state, submitted = served
    first, second = tmp_path / "first.png", tmp_path / "second.png"
    first.write_bytes(png(10))
    second.write_bytes(png(11))
    lines = iter(["what is this?", f"/image {second}", "/image nope.txt", "and this?", "/quit"])
    out = io.StringIO()
    before = len(submitted)
    run_chat(url, max_tokens=2, read=lambda prompt: next(lines), out=out, images=(first,))
    text = out.getvalue()
    assert "1 image(s) attached" in text and "not an image file name" in text
    hashes = [[s.image.hash for s in spans] for _, spans in submitted[before:]]
    expected = [load_image(p.read_bytes(), state.caps.vision, 70).hash for p in (first, second)]
    assert hashes == [expected[:1], expected]  # the first image stays in the conversation


def test_a_model_without_a_vision_tower_refuses_images(tmp_path):
    from pathlib import Path

    from thorgen.runtime.text.tokenizer import Tokenizer
    from thorgen.serve.app import create_app
    from thorgen.serve.chat_template import ChatTemplate
    from scripted_backend import ScriptedBackend, running_server, scripted_state, write_test_tokenizer

    template = Path(__file__).resolve().parent.parent / "model_spec" / "synth" / "chat_template.jinja"
    tok = Tokenizer.from_file(write_test_tokenizer(tmp_path / "tokenizer.json"))
    state = scripted_state(ScriptedBackend(lambda p: tok.encode("ok")), tok, ChatTemplate(template.read_text()))
    with running_server(create_app(state)) as url:
        message = refusal(openai_client(url), [image_part(data_url(png(1))), {"type": "text", "text": "hi"}])
        assert "no vision tower" in message
        assert (
            openai_client(url)
            .chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            .choices[0]
            .message.content
        )
    state.close()


def test_health_and_metrics_report_the_image_caches_bytes(served):
    url, state, _ = served
    openai_client(url).chat.completions.create(
        model="tiny", max_tokens=2, messages=[{"role": "user", "content": [image_part(data_url(png(31)))]}]
    )
    caches = httpx.get(url + "/health").json()["caches"]
    preprocessed = state.context.images.cache
    assert caches["preprocessed_images_bytes"] == preprocessed.bytes > 0
    assert caches["image_rows_bytes"] > 0  # the encoded image's rows the engine keeps
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    gauges = {s.labels["cache"]: s.value for f in families if f.name == "thorgen_cache_bytes" for s in f.samples}
    assert gauges == {
        "preprocessed_images": preprocessed.bytes,
        "image_rows": caches["image_rows_bytes"],
        "prefix_index": caches["prefix_index_bytes"],  # (the prefix cache's index of the pages finished requests left)
    }
    assert caches["prefix_index_bytes"] > 0
