"""Small video clips written in memory with PyAV for the video tests (moving colour gradients)."""

from __future__ import annotations

import functools
import io

import numpy as np


@functools.cache  # one clip, one stream: libx264 does not always write the same stream twice (its threads)
def clip(fmt: str, codec: str, frames: int, w: int, h: int, rate: int = 8, pix: str = "yuv420p") -> bytes:
    """A tiny clip of moving colour gradients, written in memory (needs PyAV)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, pix
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(frames):
            rgb = np.stack([(xx * 7 + i * 20) % 256, (yy * 5 + i * 9) % 256, ((xx + yy) * 3 + i * 31) % 256], -1)
            frame = av.VideoFrame.from_ndarray(rgb.astype(np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def mp4(frames: int = 6, w: int = 64, h: int = 48, rate: int = 4) -> bytes:
    """An H.264 mp4 clip (frames / rate seconds long)."""
    return clip("mp4", "libx264", frames, w, h, rate=rate)


def video_prompt(checkpoint_dir, vision, videos, before: str = "Watch:", after: str = "What moves?"):
    """(ids, spans) of `<bos><|turn>user before <|video|>... after<turn|><|turn>model`, each video's frames laid out
    as HF's processor writes them (runtime.media.prompts), tokenized with the checkpoint's tokenizer."""
    from thorgen.runtime.media.prompts import expand_image_tokens, expand_video_text, video_frames
    from thorgen.runtime.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_checkpoint(checkpoint_dir)
    text = f"<bos><|turn>user\n{before}" + "".join("\n\n<|video|>\n\n" for _ in videos) + f"{after}<turn|>\n"
    text = expand_video_text(text + "<|turn>model\n", videos, tokenizer.id_to_token, vision)
    return expand_image_tokens(tokenizer.encode(text), [], vision, video_frames(videos))
