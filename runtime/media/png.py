"""Runtime stage: a plain 8-bit RGB or RGBA PNG decoded by FFmpeg's PNG decoder (through PyAV), the very pixels
Pillow's decoder gives, in about half its time.

PNG is lossless, so any two correct decoders give the same pixels. Pillow undoes each row's filter byte by byte
(Paeth is most of its time on a photo-like image); FFmpeg undoes them with SIMD. Only the common case takes this
path: 8 bits a channel, RGB or RGBA, not interlaced, no tRNS transparency, one frame. Anything else, a missing
PyAV, or data FFmpeg refuses (truncated, corrupt) returns None, and the caller decodes with Pillow, whose errors
are the ones reported.
"""

from __future__ import annotations

from PIL import Image

_FORMATS = {"RGB": "rgb24", "RGBA": "rgba"}  # Pillow's mode -> FFmpeg's pixel format


def plain(image: Image.Image) -> bool:
    """Whether `image` (opened, not yet loaded) is a PNG the FFmpeg path decodes to what Pillow would."""
    if image.format != "PNG" or image.mode not in _FORMATS or len(image.tile) != 1:
        return False
    return (
        image.tile[0][3] == image.mode  # the raw mode: 8 bits a channel ("RGB;16B" is 16)
        and not image.info.get("interlace")
        and "transparency" not in image.info
        and getattr(image, "n_frames", 1) == 1
    )


def decode_plain(image: Image.Image, data: bytes) -> Image.Image | None:
    """The pixels of `data` (whose header `image` is) as a loaded Pillow image, or None when this path does not
    take it (see the module's docstring)."""
    if not plain(image):
        return None
    try:
        import av
    except ImportError:
        return None
    try:
        codec = av.CodecContext.create("png", "r")
        codec.thread_count = 1  # one image: no threads to start (the server decodes images side by side already)
        frames = codec.decode(av.Packet(data))
    except (av.FFmpegError, ValueError):
        return None
    if len(frames) != 1:
        return None
    frame = frames[0]
    if (frame.width, frame.height) != image.size or frame.format.name != _FORMATS[image.mode]:
        return None
    return Image.fromarray(frame.to_ndarray())  # [H, W, 3 or 4] uint8: RGB or RGBA
