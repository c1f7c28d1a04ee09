"""The banded resize (runtime/media/resize.py) byte for byte against one Pillow `Image.resize(BICUBIC)` call and the
patches cut from it: downscales and upscales, every budget's target size, thin strips, sides kept on one axis, and
band counts from one band to more bands than rows or patch columns."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.presets import get_preset
from thorgen.runtime.media import images, resize
from thorgen.runtime.media.images import SOFT_TOKEN_BUDGETS, load_image, target_size
from thorgen.runtime.media.resize import resized_patches, run_all, spans

VISION = get_preset("gemma-4-26b-a4b").vision
P = VISION.patch_size


def photo(h: int, w: int, seed: int) -> Image.Image:
    """Noise over gradients: edges that overshoot (the clipping) beside smooth areas (the rounding)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], axis=-1)
    noisy = rng.integers(0, 256, (h, w, 3))
    a = np.where(rng.random((h, w, 1)) < 0.3, noisy, smooth)
    return Image.fromarray(a.astype(np.uint8), "RGB")


def one_call(image: Image.Image, th: int, tw: int) -> np.ndarray:
    """What preprocessing did before bands: one resize, then the patches cut from its pixels."""
    pixels = np.asarray(image.resize((tw, th), resample=Image.Resampling.BICUBIC))
    gh, gw = th // P, tw // P
    return pixels.reshape(gh, P, gw, P, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, P * P * 3)


def random_cases(n: int, seed: int) -> list[tuple[int, int, int]]:
    """(height, width, budget): sides from 1 to 2400 px, log-uniform, so both upscales and downscales come up."""
    rng = np.random.default_rng(seed)
    sides = np.exp(rng.uniform(0, np.log(2400), (n, 2))).astype(int) + 1
    return [(int(h), int(w), int(rng.choice(SOFT_TOKEN_BUDGETS))) for h, w in sides]


CASES = [
    (720, 1280, 280),  # a 720p screenshot: downscaled
    (720, 1280, 1120),  # upscaled across, downscaled down
    (100, 100, 280),  # upscaled both ways
    (37, 41, 70),
    (1, 700, 280),  # strips: one row or column of source
    (900, 1, 1120),
    (3, 5000, 1120),
    (1500, 2000, 560),
    (2999, 4001, 280),
    *random_cases(40, 7),
]


@pytest.mark.parametrize("h,w,budget", CASES)
@pytest.mark.parametrize("threads", [1, 3, 8])
def test_bands_equal_one_resize(h, w, budget, threads) -> None:
    image = photo(h, w, seed=h * 7919 + w)
    th, tw = target_size(h, w, budget, VISION)
    got = resized_patches(image, th, tw, P, threads=threads)
    assert got.dtype == np.uint8 and got.flags.c_contiguous
    assert np.array_equal(got, one_call(image, th, tw))  # byte for byte: any band with other taps fails


@pytest.mark.parametrize("size,target", [((480, 300), (480, 336)), ((300, 480), (336, 480)), ((96, 64), (96, 64))])
@pytest.mark.parametrize("threads", [1, 4])
def test_a_side_kept_runs_one_pass_or_none(size, target, threads) -> None:
    image = photo(size[1], size[0], seed=size[0])
    tw, th = target
    assert np.array_equal(resized_patches(image, th, tw, P, threads=threads), one_call(image, th, tw))


def test_more_bands_than_rows_or_patch_columns() -> None:
    image = photo(2, 48, seed=1)
    assert np.array_equal(resized_patches(image, 48, 96, P, threads=64), one_call(image, 48, 96))


def test_load_image_takes_the_banded_path_and_keeps_its_bytes(monkeypatch) -> None:
    image = photo(720, 1280, seed=3)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    calls = []
    monkeypatch.setattr(images, "resized_patches", lambda *a, **k: calls.append(a) or resized_patches(*a, **k))
    banded = load_image(buf.getvalue(), VISION, 280)
    assert calls  # a 720p image is large enough for bands
    monkeypatch.setattr(images, "worth_bands", lambda *a: False)
    serial = load_image(buf.getvalue(), VISION, 280)
    assert np.array_equal(banded.patches, serial.patches) and banded.hash == serial.hash


def test_spans_cover_the_range_on_unit_edges() -> None:
    assert spans(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert spans(100, 3, 16) == [(0, 32), (32, 64), (64, 100)]
    assert spans(5, 8) == [(i, i + 1) for i in range(5)]
    assert spans(48, 8, 16) == [(0, 16), (16, 32), (32, 48)]


def test_run_all_runs_every_job_and_raises_a_jobs_error() -> None:
    done: list[int] = []
    run_all([lambda i=i: done.append(i) for i in range(50)], threads=4)
    assert sorted(done) == list(range(50))

    def fail() -> None:
        raise RuntimeError("band failed")

    with pytest.raises(RuntimeError, match="band failed"):
        run_all([fail] + [lambda: None] * 5, threads=4)


def test_rgb_only() -> None:
    with pytest.raises(ValueError):
        resized_patches(Image.new("L", (64, 64)), 48, 48, P)
    assert resize.THREADS >= 1


ORDERS = [((478, 2318), (240, 1248), True), ((78, 652), (336, 464), True), ((1243, 1426), (560, 304), False)]


@pytest.mark.parametrize("size,target,vertical_first", ORDERS)
def test_the_pass_order_follows_pillow(size, target, vertical_first) -> None:
    """Where the height shrinks by much more than the width, Pillow 13 runs the vertical pass first: the two orders
    round differently, and the bands take Pillow's."""
    image = photo(size[1], size[0], seed=size[1])
    tw, th = target
    assert np.array_equal(resized_patches(image, th, tw, P, threads=4), one_call(image, th, tw))
    assert resize.vertical_first(size, target) == (vertical_first and resize.pass_order() == "by shrink")
    assert resize.pass_order() is not None
