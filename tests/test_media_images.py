"""Image preprocessing (runtime/media/images.py) bit-exact against transformers' Gemma4ImageProcessorPil, its
errors for unusable input, and the placeholder expansion (runtime/media/prompts.py)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.presets import get_preset
from thorgen.runtime.backend import ImageSpan, check_image_spans, key_tokens
from thorgen.runtime.media import images
from thorgen.runtime.media.images import ImageError, decode, load_image, preprocess
from thorgen.runtime.media.prompts import ImagePlaceholderError, expand_image_tokens

VISION = get_preset("tiny").vision


def noise(h: int, w: int, mode: str, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    bands = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2}
    if mode == "P":
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).convert("P", palette=Image.ADAPTIVE)
        img.info["transparency"] = 3  # one palette entry is transparent: composited onto white
        return img
    a = rng.integers(0, 256, (h, w, bands[mode]), dtype=np.uint8)
    return Image.fromarray(a[..., 0] if mode == "L" else a, mode)


def png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


CASES = [
    ((200, 330), "RGB", 70),
    ((500, 120), "RGBA", 280),
    ((37, 41), "L", 280),
    ((64, 90), "P", 280),
    ((1, 700), "RGB", 70),
    ((900, 1), "L", 280),
    ((1, 3), "RGB", 280),
    ((1500, 2000), "RGB", 1120),
    ((768, 768), "RGBA", 280),
    ((672, 960), "RGB", 280),
    ((3, 5000), "LA", 1120),
]


@pytest.mark.parametrize("size,mode,budget", CASES)
def test_matches_gemma4_image_processor_pil(size, mode, budget) -> None:
    transformers = pytest.importorskip("transformers")
    img = noise(*size, mode, seed=size[0] * 7 + size[1])
    hf = transformers.Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[img], return_tensors="np")
    ours = load_image(png(img), VISION, budget)
    n = ours.patches.shape[0]
    assert ours.soft_tokens == int(np.asarray(hf["num_soft_tokens_per_image"]).reshape(-1)[0]) == n // 9
    assert n <= budget * 9 and ours.patches.dtype == np.uint8
    pv, pos = np.asarray(hf["pixel_values"])[0], np.asarray(hf["image_position_ids"])[0]
    assert np.array_equal(ours.pixel_values(), pv[:n])  # bit-exact
    assert np.array_equal(ours.positions, pos[:n])
    assert not pv[n:].any() and (pos[n:] == -1).all()  # HF's padding is all that is left out


def test_small_images_are_upscaled_and_square_ones_fill_256_tokens() -> None:
    assert load_image(png(noise(100, 100, "RGB")), VISION).soft_tokens == 256


def test_hash_keys_content_and_budget() -> None:
    a, b = noise(90, 60, "RGB", 1), noise(90, 60, "RGB", 2)
    ia, ia2, ib = load_image(png(a), VISION), load_image(png(a), VISION), load_image(png(b), VISION)
    assert ia.hash == ia2.hash and ia == ia2 and ia.hash != ib.hash and ia.soft_tokens == ib.soft_tokens
    assert load_image(png(a), VISION, 70).hash != ia.hash
    jpeg = io.BytesIO()
    a.save(jpeg, format="JPEG")
    assert preprocess(Image.open(io.BytesIO(jpeg.getvalue())), VISION).hash != ia.hash


def composited(img: Image.Image) -> bytes:
    """What to_rgb gave before the paste: Pillow's alpha_composite onto white, then the alpha dropped."""
    rgba = img.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB").tobytes()


def test_the_paste_composites_as_pillow_does() -> None:
    assert images.paste_composites()  # this Pillow takes the fast path, so the cases below test it


@pytest.mark.parametrize("size", [(1, 1), (37, 41), (3, 5000), (720, 1283)])  # the last in bands
@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_transparency_goes_onto_white_byte_for_byte(size, mode, threads, monkeypatch) -> None:
    img = noise(*size, mode, seed=size[0] + size[1])
    rgba = img.convert("RGBA")
    assert images.onto_white(rgba, threads).tobytes() == composited(img)
    assert images.to_rgb(img).tobytes() == composited(img)
    monkeypatch.setattr(images, "paste_composites", lambda: False)  # a Pillow that rounds the paste otherwise
    assert images.onto_white(rgba, threads).tobytes() == composited(img)


@pytest.mark.parametrize(
    "data,message",
    [
        (b"", "empty"),
        (b"not an image at all", "not an image"),
        (png(noise(40, 40, "RGB"))[:120], "cannot be decoded"),
        (b"%PDF-1.4\n%...", "not an image"),
    ],
)
def test_unusable_bytes_raise_image_error(data, message) -> None:
    with pytest.raises(ImageError, match=message):
        load_image(data, VISION)


def test_decompression_bomb_and_budget_are_refused() -> None:
    big = png(Image.new("L", (4000, 3000)))
    with pytest.raises(ImageError, match="at most 1000000"):
        decode(big, max_pixels=1_000_000)
    with pytest.raises(ImageError, match="budget"):
        load_image(png(noise(10, 10, "RGB")), VISION, 300)


def test_expansion_spans_and_cache_keys() -> None:
    v = VISION
    i1, i2 = load_image(png(noise(50, 50, "RGB", 1)), v, 70), load_image(png(noise(50, 50, "RGB", 2)), v, 70)
    ids, spans = expand_image_tokens([2, 10, v.image_token_id, 11, v.image_token_id, 12], [i1, i2], v)
    n = i1.soft_tokens
    assert ids == [2, 10, v.boi_token_id] + [v.image_token_id] * n + [v.eoi_token_id, 11, v.boi_token_id] + [
        v.image_token_id
    ] * n + [v.eoi_token_id, 12]
    assert spans == [ImageSpan(3, i1), ImageSpan(3 + n + 3, i2)]
    check_image_spans(ids, spans, v.placeholder_ids)
    keys = key_tokens(ids, spans)
    assert keys[:3] == ids[:3] and all(k < 0 for k in keys[3 : 3 + n]) and len(set(keys[3 : 3 + n])) == n
    assert set(keys[3 : 3 + n]).isdisjoint(keys[spans[1].offset : spans[1].end])  # same size, different image
    assert key_tokens(ids, [ImageSpan(3, i1), ImageSpan(3 + n + 3, i1)])[spans[1].offset] == keys[3]
    with pytest.raises(ImagePlaceholderError, match="2 image placeholder"):
        expand_image_tokens([v.image_token_id, v.image_token_id], [i1], v)
    with pytest.raises(Exception, match="placeholder"):
        check_image_spans(ids, spans[:1], v.placeholder_ids)
