"""Runtime stage: one image's bytes -> an ImageInput (Gemma4ImageProcessor's steps, bit-exact, on Pillow + NumPy).

Decode (Pillow; a plain 8-bit RGB(A) PNG by FFmpeg, the same pixels faster: runtime/media/png.py), composite any
transparency onto white (alpha_composite's bytes, from a paste through the alpha in bands), resize preserving the
aspect ratio to the largest multiple-of-(pool x patch) sides within the soft-token budget (PIL BICUBIC on uint8;
small images are upscaled; a large image's resize runs in bands on a few threads, byte for byte the same:
runtime/media/resize.py), cut into patches in (py, px, c) order, row-major over the patch grid, with (x, y) grid
positions. Pixels stay uint8 (ImageInput.pixel_values gives /255 as float32). Anything Pillow cannot turn into
pixels, a decompression bomb or a zero-size image raises ImageError with a message fit for a 400.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

from ...model_spec.types import Gemma4VisionSpec
from ..backend import ImageInput
from .png import decode_plain
from .resize import PARALLEL_PIXELS, THREADS, resized_patches, run_all, spans, worth_bands

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
DEFAULT_BUDGET = 280
MAX_PIXELS = 50_000_000  # decoded pixels an image may have (a 7071 x 7071 photo); Pillow checks it from the header
MAX_BYTES = 64 << 20
WHITE = (255, 255, 255)  # what transparency is composited onto


class ImageError(ValueError):
    """An image that cannot be used (undecodable, truncated, too large, empty, a bad budget): the message says why."""


def check_budget(budget: int) -> int:
    if budget not in SOFT_TOKEN_BUDGETS:
        raise ImageError(f"image soft-token budget {budget!r} must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))}")
    return budget


def decode(data: bytes, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The image in `data` (any format Pillow reads; the first frame of an animation), fully decoded."""
    if not data:
        raise ImageError("the image is empty (0 bytes)")
    if len(data) > MAX_BYTES:
        raise ImageError(f"the image is {len(data)} bytes; at most {MAX_BYTES} are accepted")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            w, h = image.size
            if w * h > max_pixels:
                raise ImageError(f"the image is {w}x{h} = {w * h} pixels; at most {max_pixels} are accepted")
            image = decode_plain(image, data) or image  # a plain PNG: the same pixels, faster (runtime/media/png.py)
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is too large to decode safely: {exc}") from None
    except UnidentifiedImageError:
        raise ImageError(
            "the data is not an image in a format this server reads (PNG, JPEG, GIF, WebP, BMP, ...)"
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # truncated or corrupt data
        raise ImageError(f"the image cannot be decoded: {exc}") from None
    if image.width == 0 or image.height == 0:
        raise ImageError(f"the image has no pixels ({image.width}x{image.height})")
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band or a transparent palette entry) composited onto white; an RGB
    image as it is (convert would copy it, and nothing here writes to it)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        return onto_white(image if image.mode == "RGBA" else image.convert("RGBA"))  # RGBA is read, not copied
    return image if image.mode == "RGB" else image.convert("RGB")


def onto_white(rgba: Image.Image, threads: int = THREADS) -> Image.Image:
    """An RGBA image composited onto opaque white, as RGB: the bytes of `Image.alpha_composite(white, rgba)
    .convert("RGB")`, from a paste through its own alpha where this Pillow rounds that paste the same way: a
    quarter of the time, and with the GIL let go (alpha_composite holds it), so a large image's rows go in bands
    on the resize threads (a 720p RGBA screenshot on a 16-core host: 10.5 ms -> 1.7 ms)."""
    if not paste_composites():
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*WHITE, 255)), rgba).convert("RGB")
    (w, h), out = rgba.size, Image.new("RGB", rgba.size, WHITE)
    if threads < 2 or w * h < PARALLEL_PIXELS:
        out.paste(rgba, (0, 0), rgba)
        return out
    rgba.load()  # decoded once, not by the first band's crop racing the others

    def band(a: int, b: int) -> None:
        part = rgba.crop((0, a, w, b))  # paste reads a source of the box's size
        out.paste(part, (0, a), part)  # disjoint rows

    run_all([lambda a=a, b=b: band(a, b) for a, b in spans(h, threads)], threads)
    return out


@functools.cache
def paste_composites() -> bool:
    """Whether a paste through the alpha onto white gives alpha_composite's bytes, told from every (value, alpha)
    pair: each channel of either is a function of the pair alone (Pillow 13: both compute (v * a + 255 * (255 - a))
    / 255, rounded alike), so the 65536 pairs are every case there is."""
    value, alpha = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8))
    probe = Image.fromarray(np.stack([value, ~value, value * np.uint8(7), alpha], axis=-1), "RGBA")
    pasted = Image.new("RGB", probe.size, WHITE)
    pasted.paste(probe, (0, 0), probe)
    composited = Image.alpha_composite(Image.new("RGBA", probe.size, (*WHITE, 255)), probe).convert("RGB")
    return pasted.tobytes() == composited.tobytes()


def target_size(height: int, width: int, budget: int, vision: Gemma4VisionSpec) -> tuple[int, int]:
    """The largest (H', W'), each a multiple of pool x patch, with H' x W' within budget x pool^2 patches, that
    keeps the aspect ratio; a strip too thin for that gets one side of pool x patch and the other as long as the
    ratio allows (capped to the budget). Exactly HF's `get_aspect_ratio_preserving_size`, except that no side
    may hold more patches than the tower's position table has rows: a thin strip at a large budget on a checkpoint
    with a smaller table (HF would index past it) is shortened to the longest side the table covers."""
    patch, pool = vision.patch_size, vision.pooling_kernel_size
    max_patches = budget * pool * pool
    target_px = max_patches * patch * patch
    factor = math.sqrt(target_px / (height * width))
    side = pool * patch
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    longest = budget * side
    if th == 0 and tw == 0:
        raise ImageError(f"the image ({width}x{height}) cannot be resized to a multiple of {side} pixels")
    if th == 0:
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:
        th, tw = min(int(math.floor(height / width)) * side, longest), side
    positioned = (vision.position_embedding_size // pool) * side  # the longest side the table gives positions to
    if positioned < side:
        raise ImageError(
            f"the vision tower's position table ({vision.position_embedding_size} rows) is shorter than one "
            f"{pool}x{pool} patch cell"
        )
    return min(th, positioned), min(tw, positioned)


def content_hash(patches: np.ndarray, grid: tuple[int, int]) -> str:
    """sha256 over the patches and their grid (rows x columns): equal exactly when what the tower reads is (the
    positions follow from the grid, the soft tokens from the patch count). Hashing the patches rather than the
    decoded image costs at most budget x pool^2 patches' bytes, however large the image was."""
    h = hashlib.sha256(f"{grid[0]}x{grid[1]}:{patches.shape[1]}:".encode())
    h.update(patches.data)  # contiguous uint8: hashed in place, the GIL let go
    return h.hexdigest()


def preprocess(image: Image.Image, vision: Gemma4VisionSpec, budget: int = DEFAULT_BUDGET) -> ImageInput:
    """A decoded image -> its patches (uint8), positions and soft-token count."""
    check_budget(budget)
    rgb_image = to_rgb(image)
    th, tw = target_size(rgb_image.height, rgb_image.width, budget, vision)
    p = vision.patch_size
    gh, gw = th // p, tw // p
    if (th, tw) != (rgb_image.height, rgb_image.width) and worth_bands(rgb_image.size, (tw, th)):
        patches = resized_patches(rgb_image, th, tw, p)  # the same bytes, the resize spread over threads
    else:
        if (th, tw) != (rgb_image.height, rgb_image.width):
            rgb_image = rgb_image.resize((tw, th), resample=Image.Resampling.BICUBIC)
        pixels = np.asarray(rgb_image)  # [H', W', 3] uint8
        patches = np.ascontiguousarray(
            pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, p * p * 3)
        )
    gx, gy = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    positions = np.stack([gx, gy], axis=-1).reshape(-1, 2).astype(np.int32)
    soft = gh * gw // (vision.pooling_kernel_size**2)
    return ImageInput(patches, positions, soft, content_hash(patches, (gh, gw)))


def load_image(
    data: bytes, vision: Gemma4VisionSpec, budget: int = DEFAULT_BUDGET, max_pixels: int = MAX_PIXELS
) -> ImageInput:
    """Bytes of an image file -> its ImageInput; ImageError for anything unusable."""
    check_budget(budget)
    return preprocess(decode(data, max_pixels), vision, budget)
