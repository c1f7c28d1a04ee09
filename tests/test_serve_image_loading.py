"""Serve stage tests: how a request's images are read (serve/image_loader.py), on the reference backend with the tiny
checkpoint: decoding runs off the event loop (another stream flows while an image decode is held), the images of
one request and of concurrent requests are decoded side by side, an image sent again is neither decoded nor
encoded, concurrent requests share one decode of a new image, a prefetched decode starts at once and is the one
load takes, and the base64 reader and the cache's bound."""

from __future__ import annotations

import asyncio
import base64
import io
import threading

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
Image = pytest.importorskip("PIL.Image")

from thorgen.model_spec.presets import get_preset  # noqa: E402
from thorgen.runtime.media.images import ImageError, load_image  # noqa: E402
from thorgen.serve import image_loader, media  # noqa: E402
from thorgen.serve.image_loader import ImageLoader, PreprocessedImages  # noqa: E402
from thorgen.serve.media import MediaOptions, b64_bytes  # noqa: E402
from thorgen.serve.request import ImageSource  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402

WAIT_S = 60  # only a failing test waits this long: every wait below ends as soon as the event it waits for happens


def png(seed: int, size=(40, 60)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def image_message(data: bytes, text: str = "What is this?") -> list[dict]:
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return [
        {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
    ]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    with tiny_server(tiny_checkpoint, 2048, media=MediaOptions(budget=70, workers=4)) as (url, state):
        yield url, state


@pytest.fixture
def decodes(monkeypatch):
    """Every image decode the server starts, as the bytes it decodes; `hold` (a threading.Event, set) gates them and
    `on_decode` runs first in each."""

    class Decodes(list):
        hold = threading.Event()
        on_decode = staticmethod(lambda: None)

    seen = Decodes()
    seen.hold.set()

    def gated(data, vision, budget):
        seen.append(data)
        seen.on_decode()
        assert seen.hold.wait(WAIT_S), "the held decode was never released"
        return load_image(data, vision, budget)

    monkeypatch.setattr(image_loader, "load_image", gated)
    return seen


def test_a_stream_flows_while_an_image_is_decoded(served, decodes):
    url, state = served
    entered = threading.Event()
    decodes.on_decode, decodes.hold = entered.set, threading.Event()
    client = openai_client(url)
    stream = client.completions.create(  # (ignore_eos: the random model's text must not end it before 12)
        model="tiny", prompt="hello there", max_tokens=12, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))  # the stream is running before the image request comes
    answers = []
    image_request = threading.Thread(
        target=lambda: answers.append(
            client.chat.completions.create(model="tiny", max_tokens=2, messages=image_message(png(101)))
        )
    )
    image_request.start()
    try:
        assert entered.wait(WAIT_S)  # the image's decode has begun, and is held
        rest = list(stream)  # ... while the other stream runs to its end and /health answers
        assert httpx.get(url + "/health", timeout=WAIT_S).status_code == 200
        assert not decodes.hold.is_set() and image_request.is_alive()
    finally:
        decodes.hold.set()
        image_request.join(WAIT_S)
    assert first.choices and rest[-1].choices[0].finish_reason == "length"
    assert answers and answers[0].choices[0].finish_reason == "length"


def test_the_images_of_a_request_are_decoded_side_by_side(served, decodes):
    url, _ = served
    both = threading.Barrier(2, timeout=WAIT_S)  # broken unless the two decodes are under way at once
    decodes.on_decode = both.wait
    messages = image_message(png(102))
    messages[0]["content"].append({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}})
    messages[0]["content"][-1]["image_url"]["url"] += base64.b64encode(png(103)).decode()
    reply = openai_client(url).chat.completions.create(model="tiny", max_tokens=2, messages=messages)
    assert reply.choices[0].finish_reason == "length" and len(decodes) == 2


def test_concurrent_requests_decode_side_by_side(served, decodes):
    url, _ = served
    both = threading.Barrier(2, timeout=WAIT_S)
    decodes.on_decode = both.wait
    client, answers = openai_client(url), []

    def ask(seed: int) -> None:
        answers.append(client.chat.completions.create(model="tiny", max_tokens=2, messages=image_message(png(seed))))

    requests = [threading.Thread(target=ask, args=(seed,)) for seed in (104, 105)]
    for r in requests:
        r.start()
    for r in requests:
        r.join(WAIT_S)
    assert len(answers) == 2 and len(decodes) == 2


def test_an_image_sent_again_is_neither_decoded_nor_encoded(served, decodes):
    url, state = served
    client, data = openai_client(url), png(106)
    tower = state.client.backend.encoder_cache
    client.chat.completions.create(model="tiny", max_tokens=2, messages=image_message(data, "First question?"))
    encoded, loader = tower.encoded, state.context.images
    assert len(decodes) == 1 and data in decodes
    # other text ahead of the image: the prefix cache cannot serve it, the encoder cache must
    reply = client.chat.completions.create(model="tiny", max_tokens=2, messages=image_message(data, "Another one?"))
    counted = httpx.post(url + "/tokenize", json={"messages": image_message(data, "A third?")}).json()
    assert len(decodes) == 1 and tower.encoded == encoded  # no decode, no preprocessing, no encode
    assert reply.choices[0].finish_reason == "length" and counted["tokens"] and len(loader.cache) >= 1


def test_concurrent_asks_for_one_new_image_share_its_decode(decodes):
    vision = get_preset("tiny").vision
    loader = ImageLoader(vision, MediaOptions(budget=70, workers=2))
    url = "data:image/png;base64," + base64.b64encode(png(107)).decode()

    async def both():
        return await asyncio.gather(
            loader.load([ImageSource(url, "messages[0].content[0]")], None),
            loader.load([ImageSource(url, "messages[1].content[0]")], None),
        )

    try:
        (a,), (b,) = asyncio.run(both())
    finally:
        loader.close()
    assert a is b and len(decodes) == 1 and loader.decoded == 1 and len(loader.cache) == 1


def test_prefetch_submits_the_decodes_at_once_and_load_takes_them(decodes):
    loader = ImageLoader(get_preset("tiny").vision, MediaOptions(budget=70, workers=2))
    entered = threading.Event()
    decodes.on_decode, decodes.hold = entered.set, threading.Event()
    good = "data:image/png;base64," + base64.b64encode(png(109)).decode()
    sources = [
        ImageSource(good, "messages[0].content[0]"),
        ImageSource("data:text/plain;base64,aGk=", "messages[0].content[1]"),  # left to load, which refuses it
        ImageSource("https://example.com/a.png", "messages[0].content[2]"),  # fetched by load only
    ]

    async def prefetch_then_load():
        loader.prefetch(sources, None)
        started = entered.wait(WAIT_S)  # the event loop held: the decode started with no turn of it
        decodes.hold.set()
        with pytest.raises(Exception, match=r"content\[1\]: the data URL's media type 'text/plain' is not an image"):
            await loader.load(sources, None)
        return started, await loader.load(sources[:1], None)

    try:
        started, (image,) = asyncio.run(prefetch_then_load())
    finally:
        loader.close()
    assert started and len(decodes) == 1 and loader.decoded == 1
    assert np.array_equal(image.patches, load_image(png(109), get_preset("tiny").vision, 70).patches)


def test_a_long_data_url_is_hashed_on_a_worker_and_its_prefetched_decode_is_the_one_load_takes(decodes, monkeypatch):
    monkeypatch.setattr(image_loader, "INLINE_HASH_CHARS", 64)  # every data URL below is "long"
    loader = ImageLoader(get_preset("tiny").vision, MediaOptions(budget=70, workers=2))
    entered = threading.Event()
    decodes.on_decode, decodes.hold = entered.set, threading.Event()
    source = ImageSource("data:image/png;base64," + base64.b64encode(png(110)).decode(), "messages[0].content[0]")

    async def prefetch_then_load():
        loader.prefetch([source], None)
        started = await asyncio.to_thread(entered.wait, WAIT_S)  # load not yet called: the decode started anyway
        decodes.hold.set()
        return started, await loader.load([source], None)

    try:
        started, (image,) = asyncio.run(prefetch_then_load())
    finally:
        loader.close()
    assert started and len(decodes) == 1 and loader.decoded == 1
    assert np.array_equal(image.patches, load_image(png(110), get_preset("tiny").vision, 70).patches)


def test_the_first_bad_image_in_order_is_the_400():
    loader = ImageLoader(get_preset("tiny").vision, MediaOptions(budget=70, workers=2))
    good = "data:image/png;base64," + base64.b64encode(png(108)).decode()
    sources = [
        ImageSource(good, "messages[0].content[0]"),
        ImageSource("data:image/png;base64,@@@", "messages[0].content[1]"),
        ImageSource("data:image/png;base64," + base64.b64encode(b"no picture").decode(), "messages[0].content[2]"),
    ]
    try:
        with pytest.raises(Exception, match=r"content\[1\]: the data URL's payload is not valid base64") as err:
            asyncio.run(loader.load(sources, None))
    finally:
        loader.close()
    assert err.value.status == 400 and err.value.param == "messages"


def test_base64_is_read_in_pieces_like_one_call(monkeypatch):
    monkeypatch.setattr(media, "B64_PIECE", 8)
    data = bytes(range(256)) * 3 + b"tail!"
    text = base64.b64encode(data).decode()
    assert b64_bytes(text) == data and b64_bytes("data:image/png;base64," + text, 22) == data
    assert b64_bytes("\n".join(text[i : i + 76] for i in range(0, len(text), 76))) == data  # MIME line breaks
    for bad in (text[:-1], "QUJD" + "QQ==" + "QUJD", text[:20] + "*" + text[21:], text + "é"):
        with pytest.raises(ImageError, match="not valid base64"):
            b64_bytes(bad)


def test_the_cache_keeps_at_most_its_bytes():
    vision = get_preset("tiny").vision
    images = [load_image(png(110 + i), vision, 70) for i in range(3)]
    one = PreprocessedImages.size(images[0])
    cache = PreprocessedImages(2 * one)
    for i, image in enumerate(images):
        cache.put((f"k{i}", 70), image)
        if i == 1:
            assert cache.get(("k0", 70)) is images[0]  # k0 used last: k1 is the one to go
    assert len(cache) == 2 and cache.bytes == 2 * one
    assert cache.get(("k1", 70)) is None and cache.get(("k0", 70)) is images[0]
    PreprocessedImages(one - 1).put(("big", 70), images[0])  # larger than the whole cache: not kept
