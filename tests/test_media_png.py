"""The FFmpeg path for plain PNGs (runtime/media/png.py): the very pixels and patches Pillow's decoder gives, over
sizes, aspect ratios, PNG filters and compression levels; PNGs it does not take (16-bit, tRNS, palette, grey,
animated) and broken ones go to Pillow as before."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.presets import get_preset
from thorgen.runtime.media import images, png
from thorgen.runtime.media.images import ImageError, decode, load_image

av = pytest.importorskip("av")
VISION = get_preset("tiny").vision


def picture(h: int, w: int, bands: int, seed: int) -> np.ndarray:
    """Smooth gradients with noise on top: rows Pillow's encoder filters with Sub, Up and Paeth alike."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x ^ y) & 255, (x + y) & 255], -1)
    return (base[..., :bands] + rng.integers(0, 24, (h, w, bands))).clip(0, 255).astype(np.uint8)


def encoded(pixels: np.ndarray, **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", **options)
    return out.getvalue()


def pillow_decoded(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


@pytest.mark.parametrize(
    "size,bands,options",
    [
        ((720, 1280), 3, {}),
        ((333, 517), 3, {"compress_level": 1}),
        ((1000, 90), 4, {"compress_level": 9}),
        ((1, 640), 3, {}),
        ((481, 1), 4, {"optimize": True}),
        ((256, 256), 4, {}),
    ],
)
def test_plain_pngs_decode_to_pillows_pixels_and_patches(size, bands, options, monkeypatch) -> None:
    data = encoded(picture(*size, bands, seed=size[0] + size[1]), **options)
    fast = png.decode_plain(Image.open(io.BytesIO(data)), data)
    assert fast is not None and fast.mode == ("RGB", "RGBA")[bands - 3]
    assert np.array_equal(np.asarray(fast), np.asarray(pillow_decoded(data)))
    ours = load_image(data, VISION, 280)
    monkeypatch.setattr(images, "decode_plain", lambda image, data: None)  # the Pillow-only decode
    before = load_image(data, VISION, 280)
    assert np.array_equal(ours.patches, before.patches) and ours.hash == before.hash


def sixteen_bit_rgb(h: int, w: int) -> bytes:
    codec = av.CodecContext.create("png", "w")
    codec.width, codec.height, codec.pix_fmt = w, h, "rgb48be"
    frame = av.VideoFrame.from_ndarray(picture(h, w, 3, 5).astype(np.uint16) * 257, format="rgb48be")
    return b"".join(bytes(packet) for packet in [*codec.encode(frame), *codec.encode(None)])


def animated(h: int, w: int) -> bytes:
    frames = [Image.fromarray(picture(h, w, 3, seed)) for seed in (1, 2)]
    out = io.BytesIO()
    frames[0].save(out, format="PNG", save_all=True, append_images=frames[1:])
    return out.getvalue()


def palette(h: int, w: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(picture(h, w, 3, 1)).convert("P").save(out, format="PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(lambda: sixteen_bit_rgb(30, 40), id="16-bit"),
        pytest.param(lambda: encoded(picture(30, 40, 3, 1), transparency=(1, 2, 3)), id="tRNS"),
        pytest.param(lambda: encoded(picture(30, 40, 3, 1)[..., 0]), id="grey"),
        pytest.param(lambda: animated(30, 40), id="animated"),
        pytest.param(lambda: palette(30, 40), id="palette"),
    ],
)
def test_other_pngs_are_left_to_pillow(data) -> None:
    raw = data()
    assert not png.plain(Image.open(io.BytesIO(raw)))
    assert png.decode_plain(Image.open(io.BytesIO(raw)), raw) is None
    assert np.array_equal(np.asarray(decode(raw)), np.asarray(pillow_decoded(raw)))


def test_broken_pngs_get_pillows_answer() -> None:
    data = encoded(picture(90, 120, 3, 3))
    for cut in (len(data) // 2, 60, len(data) - 20):
        broken = data[:cut]
        try:
            expected: object = np.asarray(pillow_decoded(broken))
        except (OSError, SyntaxError, ValueError, EOFError):
            expected = ImageError
        if expected is ImageError:
            with pytest.raises(ImageError):
                decode(broken)
        else:
            assert np.array_equal(np.asarray(decode(broken)), expected)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode(bytes(flipped))
