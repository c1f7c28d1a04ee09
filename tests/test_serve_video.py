"""Serve stage tests: video input through HTTP on the reference backend with the tiny checkpoint, driven by the
official openai client: video_url data URLs and http(s) URLs, the vLLM-style {"type": "video"} part,
mm_processor_kwargs (num_frames, fps, max_soft_tokens), usage counting the frames' tokens, a re-sent clip served
from the caches, /tokenize, each bad input a 400 naming the problem (the server healthy after), and the Messages and
Responses APIs refusing video parts."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
av = pytest.importorskip("av")

from thorgen.runtime.media.prompts import expand_image_tokens, expand_video_text, video_frames  # noqa: E402
from thorgen.runtime.media.video import load_video  # noqa: E402
from thorgen.serve.media import MediaOptions  # noqa: E402
from tiny_server import openai_client, tiny_server  # noqa: E402
from video_clips import clip, mp4  # noqa: E402

MAX_SECONDS = 20.0
MAX_BYTES = 200_000


def data_url(data: bytes, kind: str = "video/mp4") -> str:
    return f"data:{kind};base64," + base64.b64encode(data).decode()


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


TEXT = {"type": "text", "text": "What moves?"}


class Files(http.server.BaseHTTPRequestHandler):
    """Video files for the http(s) URL tests: /clip.mp4, /big.mp4 (over the size cap)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = self.files.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def files_url():
    noise = np.random.default_rng(0).integers(0, 256, MAX_BYTES + 1000, dtype=np.uint8).tobytes()
    Files.files = {"/clip.mp4": mp4(frames=5), "/big.mp4": noise}
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    media = MediaOptions(
        budget=70,
        max_images=2,
        allowed_domains=("127.0.0.1",),
        fetch_timeout_s=2.0,
        max_videos=1,
        max_video_seconds=MAX_SECONDS,
        max_video_bytes=MAX_BYTES,
    )
    with tiny_server(tiny_checkpoint, 2048, media=media) as (url, state):
        submitted = []
        original = state.client.submit

        def recording(*args, **kwargs):
            submitted.append((args[0], kwargs.get("images", ())))
            return original(*args, **kwargs)

        state.client.submit = recording
        yield url, state, submitted


def expected_prompt(state, data: bytes, **sampling) -> tuple[list[int], list]:
    """The prompt the server should submit for [video, "What moves?"]: the template with a {"type": "video"}
    part, the frames laid out, tokenized, expanded."""
    ctx, vision = state.context, state.caps.vision
    messages = [{"role": "user", "content": [{"type": "video"}, TEXT]}]
    video = load_video(data, vision, **sampling)
    text = ctx.template.render(messages, add_generation_prompt=True, enable_thinking=False)
    text = expand_video_text(text, [video], ctx.tokenizer.id_to_token, vision)
    return expand_image_tokens(ctx.tokenizer.encode(text), [], vision, video_frames([video]))


def ask(url: str, content: list, **extra):
    return openai_client(url).chat.completions.create(
        model="tiny",
        max_tokens=3,
        temperature=0,
        messages=[{"role": "user", "content": content}],
        extra_body=extra or None,
    )


def test_a_data_url_video_and_a_resent_clip(served):
    url, state, submitted = served
    data = mp4(frames=6)
    reply = ask(url, [video_part(data_url(data)), TEXT])
    ids, spans = expected_prompt(state, data)
    sent_ids, sent_spans = submitted[-1]
    assert sent_ids == ids and [(s.offset, s.image.hash) for s in sent_spans] == [
        (s.offset, s.image.hash) for s in spans
    ]
    assert len(spans) == 6 and all(ids[s.offset] == state.caps.vision.video_token_id for s in spans)
    assert reply.usage.prompt_tokens == len(ids) > sum(s.image.soft_tokens for s in spans)  # frames' tokens counted
    decoded = state.context.videos.decoded
    again = ask(url, [video_part(data_url(data)), TEXT])
    assert state.context.videos.decoded == decoded  # not decoded again
    assert again.usage.prompt_tokens_details.cached_tokens >= spans[-1].offset  # the frames' K/V reused
    assert again.choices[0].message.content == reply.choices[0].message.content
    tokenized = httpx.post(
        url + "/tokenize", json={"messages": [{"role": "user", "content": [video_part(data_url(data)), TEXT]}]}
    )
    assert tokenized.json()["tokens"] == ids


def test_sampling_and_budget_from_mm_processor_kwargs(served):
    url, state, submitted = served
    data = mp4(frames=8)
    ask(url, [video_part(data_url(data)), TEXT], mm_processor_kwargs={"num_frames": 3, "max_soft_tokens": 140})
    ids, spans = expected_prompt(state, data, num_frames=3, budget=140)
    assert submitted[-1][0] == ids and len(spans) == 3 and spans[0].image.soft_tokens > 70
    ask(url, [video_part(data_url(data)), TEXT], mm_processor_kwargs={"fps": 1})  # 2 s at 4 fps: 2 frames
    assert submitted[-1][0] == expected_prompt(state, data, fps=1.0)[0] and len(submitted[-1][1]) == 2


def test_the_video_part_and_an_http_url(served, files_url):
    url, state, submitted = served
    ask(url, [{"type": "video", "video": files_url + "/clip.mp4"}, TEXT])
    assert submitted[-1][0] == expected_prompt(state, Files.files["/clip.mp4"])[0]


def refusal(url: str, content=None, messages=None, **extra) -> str:
    messages = messages or [{"role": "user", "content": content}]
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(url).chat.completions.create(
            model="tiny", max_tokens=2, messages=messages, extra_body=extra or None
        )
    return err.value.body["message"]


def audio_only() -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="wav") as out:
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return buf.getvalue()


def unknown_codec() -> bytes:
    data = bytearray(mp4())
    while (i := data.find(b"avc1")) >= 0:  # the codec's fourcc: FFmpeg has no decoder for it
        data[i : i + 4] = b"zzzz"
    return bytes(data)


def y4m(width: int, height: int) -> bytes:
    """A raw YUV4MPEG2 stream's header alone: a frame size, and no frames."""
    return f"YUV4MPEG2 W{width} H{height} F4:1 Ip A0:0 C420jpeg\n".encode()


BAD_VIDEOS = {
    "empty": (lambda: [video_part(data_url(b"")), TEXT], "empty (0 bytes)"),
    "truncated": (lambda: [video_part(data_url(mp4()[:-300])), TEXT], "not a video this server can read"),
    "corrupt": (lambda: [video_part(data_url(b"\x00\x00\x00\x18ftypmp42" + bytes(500))), TEXT], "not a video"),
    "audio only": (lambda: [video_part(data_url(audio_only())), TEXT], "no video stream"),
    "zero frames": (lambda: [video_part(data_url(y4m(64, 48))), TEXT], "no frames"),
    "too long": (lambda: [video_part(data_url(clip("mp4", "libx264", 24, 64, 48, rate=1))), TEXT], "at most 20 s"),
    "too large a frame": (lambda: [video_part(data_url(y4m(5000, 4000))), TEXT], "pixels a frame"),
    "unknown codec": (lambda: [video_part(data_url(unknown_codec())), TEXT], "codec"),
    "too many bytes": (lambda: [video_part(data_url(bytes(MAX_BYTES + 100))), TEXT], f"larger than {MAX_BYTES}"),
    "not base64": (lambda: [video_part("data:video/mp4;base64,@@@"), TEXT], "not valid base64"),
    "not a video type": (lambda: [video_part(data_url(mp4(), "text/plain")), TEXT], "not a video type"),
    "bad scheme": (lambda: [video_part("ftp://example.com/x.mp4"), TEXT], "a video URL is a data: URL"),
    "host not allowed": (lambda: [video_part("http://localhost:1/x.mp4"), TEXT], "not among the allowed"),
    "too many videos": (lambda: [video_part(data_url(mp4())), video_part(data_url(mp4(frames=3))), TEXT], "at most 1"),
    "typed video token": (
        lambda: [video_part(data_url(mp4())), {"type": "text", "text": "a <|video|>"}],
        "video token",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_VIDEOS))
def test_a_bad_video_is_a_400_naming_the_problem(served, case):
    url, _, submitted = served
    content, needle = BAD_VIDEOS[case]
    before = len(submitted)
    message = refusal(url, content())
    assert needle in message, message
    assert len(submitted) == before and httpx.get(url + "/health").status_code == 200


def test_oversized_fetch_and_misplaced_videos_are_400s(served, files_url):
    url = served[0]
    good = video_part(data_url(mp4()))
    assert f"larger than {MAX_BYTES} bytes" in refusal(url, [video_part(files_url + "/big.mp4"), TEXT])
    assert "HTTP 404" in refusal(url, [video_part(files_url + "/none.mp4"), TEXT])
    for role in ("system", "assistant"):
        messages = [{"role": role, "content": [good, TEXT]}, {"role": "user", "content": "hi"}]
        assert f"videos are accepted in user messages only (not '{role}')" in refusal(url, messages=messages)
    assert "video token" in refusal(url, messages=[{"role": "user", "content": "typed <|video|> here"}])


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_frames": 0}, "num_frames must be a positive integer"),
        ({"num_frames": "4"}, "num_frames must be a positive integer"),
        ({"fps": -1}, "fps must be a number"),
        ({"fps": 1, "num_frames": 2}, "not both"),
        ({"max_soft_tokens": 100}, "max_soft_tokens must be one of"),
        ({"do_resize": False}, "only max_soft_tokens, num_frames, fps"),
    ],
)
def test_bad_sampling_is_a_400(served, kwargs, needle):
    assert needle in refusal(served[0], [video_part(data_url(mp4())), TEXT], mm_processor_kwargs=kwargs)


def test_messages_and_responses_refuse_video(served):
    url = served[0]
    messages = httpx.post(
        url + "/v1/messages",
        json={
            "model": "tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "video", "source": {"type": "url", "url": "x"}}]}],
        },
    )
    assert messages.status_code == 400 and "not supported by the Messages API" in messages.text
    responses = httpx.post(
        url + "/v1/responses",
        json={
            "model": "tiny",
            "input": [{"role": "user", "content": [{"type": "input_video", "video_url": data_url(mp4())}]}],
        },
    )
    assert responses.status_code == 400 and "not supported by the Responses API" in responses.text


def test_a_decode_past_its_time_limit_is_a_400(tiny_ckpt):
    import asyncio

    from thorgen.serve.protocol import APIError
    from thorgen.serve.request import VideoSampling, VideoSource
    from thorgen.serve.video_loader import VideoLoader

    loader = VideoLoader(tiny_ckpt.spec.vision, MediaOptions(video_decode_timeout_s=0.0))
    try:
        with pytest.raises(APIError, match="decoding the video took longer than 0 s"):
            asyncio.run(loader.load([VideoSource(data_url(mp4()), "messages[0].content[0]")], VideoSampling()))
    finally:
        loader.close()


def test_chat_client_attaches_a_video(served, tmp_path):
    from thorgen.serve.tools.chat import run_chat

    url, state, submitted = served
    clip_path = tmp_path / "clip.mp4"
    clip_path.write_bytes(mp4(frames=4))
    lines = iter(["hello", f"/video {clip_path}", "/video nope.png", "what moves?", "and now?", "/quit"])
    out = io.StringIO()
    before = len(submitted)
    run_chat(url, max_tokens=2, read=lambda prompt: next(lines), out=out)
    text = out.getvalue()
    assert "1 video(s) attached" in text and "not a video file name" in text
    frames = [f.hash for f in load_video(clip_path.read_bytes(), state.caps.vision).frames]
    # the video stays in the conversation (one per prompt: this server's limit)
    assert [[s.image.hash for s in spans] for _, spans in submitted[before:]] == [[], frames, frames]
