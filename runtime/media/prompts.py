"""Runtime stage: a tokenized prompt's image placeholders expanded into each image's soft-token span.

The chat template writes one `<|image|>` per image; the model reads `<|image>` + N x `<|image|>` + `<image|>`,
N being that image's soft-token count. The spans (offset of the first placeholder, the image) go to the engine.
"""

from __future__ import annotations

from typing import Sequence

from ...model_spec.types import Gemma4VisionSpec
from ..backend import ImageInput, ImageSpan


class ImagePlaceholderError(ValueError):
    """The prompt's `<|image|>` tokens do not match the images given (e.g. the user typed the token)."""


def expand_image_tokens(
    ids: Sequence[int], images: Sequence[ImageInput], vision: Gemma4VisionSpec
) -> tuple[list[int], list[ImageSpan]]:
    """(expanded ids, spans): each `<|image|>` id, in order, becomes boi + N x image + eoi for the next image."""
    found = sum(1 for t in ids if t == vision.image_token_id)
    if found != len(images):
        raise ImagePlaceholderError(
            f"the prompt has {found} image placeholder(s) but {len(images)} image(s) were given"
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    pending = iter(images)
    for t in ids:
        if t != vision.image_token_id:
            out.append(t)
            continue
        image = next(pending)
        out.append(vision.boi_token_id)
        spans.append(ImageSpan(len(out), image))
        out += [vision.image_token_id] * image.soft_tokens
        out.append(vision.eoi_token_id)
    return out, spans
