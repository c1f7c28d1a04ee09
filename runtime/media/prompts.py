"""Runtime stage: a prompt's image and video placeholders expanded into each image's (or frame's) soft-token span.

The chat template writes one `<|image|>` per image and one `<|video|>` per video. The model reads an image as
`<|image>` + N x `<|image|>` + `<image|>`, N being that image's soft-token count, and a video as its frames joined
by a space, each `mm:ss <|image>` + N x `<|video|>` + `<image|>` (HF's Gemma4Processor). A video's layout holds
text (the timestamps), so it is written into the prompt's text before tokenizing (`expand_video_text`, one
`<|video|>` per frame), exactly where HF's processor writes it; the ids are then expanded (`expand_image_tokens`).
The spans (offset of the first placeholder, the image or frame) go to the engine.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ...model_spec.types import Gemma4VisionSpec
from ..backend import ImageInput, ImageSpan
from .video import VideoInput, frame_text


class ImagePlaceholderError(ValueError):
    """The prompt's `<|image|>` / `<|video|>` tokens do not match the images or videos given (e.g. the user typed
    the token)."""


def frames_layout(video: VideoInput, token: Callable[[int], str], vision: Gemma4VisionSpec) -> str:
    """A video's text before its ids are expanded: `mm:ss <|image><|video|><image|>` per frame, joined by a space
    (`token(id)` gives a special token's text)."""
    boi, placeholder, eoi = token(vision.boi_token_id), token(vision.video_token_id), token(vision.eoi_token_id)
    return " ".join(f"{frame_text(t)} {boi}{placeholder}{eoi}" for t in video.timestamps)


def expand_video_text(
    text: str, videos: Sequence[VideoInput], token: Callable[[int], str], vision: Gemma4VisionSpec
) -> str:
    """The rendered prompt with each `<|video|>`, in order, replaced by the next video's frames layout."""
    placeholder = token(vision.video_token_id)
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(videos):
        raise ImagePlaceholderError(
            f"the prompt has {len(pieces) - 1} video placeholder(s) {placeholder!r} but {len(videos)} video(s) "
            "were given"
        )
    out = [pieces[0]]
    for video, rest in zip(videos, pieces[1:]):
        out += [frames_layout(video, token, vision), rest]
    return "".join(out)


def expand_image_tokens(
    ids: Sequence[int],
    images: Sequence[ImageInput],
    vision: Gemma4VisionSpec,
    frames: Sequence[ImageInput] = (),
) -> tuple[list[int], list[ImageSpan]]:
    """(expanded ids, spans): each `<|image|>` id, in order, becomes boi + N x image + eoi for the next image;
    each `<|video|>` id (one per frame, inside its boi/eoi already: expand_video_text) N x video for the next
    frame."""
    for token, given, what in ((vision.image_token_id, images, "image"), (vision.video_token_id, frames, "frame")):
        found = sum(1 for t in ids if t == token)
        if found != len(given):
            raise ImagePlaceholderError(
                f"the prompt has {found} {what} placeholder(s) but {len(given)} {what}(s) were given"
            )
    out: list[int] = []
    spans: list[ImageSpan] = []
    pending_images, pending_frames = iter(images), iter(frames)
    for t in ids:
        if t == vision.image_token_id:
            image = next(pending_images)
            out.append(vision.boi_token_id)
            spans.append(ImageSpan(len(out), image))
            out += [t] * image.soft_tokens
            out.append(vision.eoi_token_id)
        elif t == vision.video_token_id:
            frame = next(pending_frames)
            spans.append(ImageSpan(len(out), frame))
            out += [t] * frame.soft_tokens
        else:
            out.append(t)
    return out, spans


def video_frames(videos: Sequence[VideoInput]) -> list[ImageInput]:
    """Every frame of the videos, in prompt order (what expand_image_tokens takes as `frames`)."""
    return [frame for video in videos for frame in video.frames]
