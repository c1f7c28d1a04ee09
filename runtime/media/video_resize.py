"""Runtime stage: torchvision's antialiased BICUBIC resize of uint8 frames, byte for byte, in NumPy.

HF's Gemma4 video processor resizes frames with `torchvision.transforms.v2.functional.resize(..., BICUBIC,
antialias=True)`, which casts uint8 to float32, runs PyTorch's separable antialiased kernel (horizontal pass, then
vertical; Keys cubic a = -0.5 widened by the scale when shrinking), clamps to [0, 255] and rounds half to even.
Unlike Pillow (runtime/media/images.py) it keeps float32 between the passes, so a Pillow resize differs by a
level here and there. PyTorch's CPU kernel is compiled with multiply-adds fused: the filter's polynomial and each
tap's accumulation are single-rounding FMAs, emulated here in float64 (a float32 product is exact there, and the
sums at these magnitudes are too, so rounding once to float32 gives the fused result).
"""

from __future__ import annotations

import numpy as np

_F32 = np.float32


def _fma(a: np.ndarray, b: np.ndarray | np.float32, c: np.ndarray | np.float32) -> np.ndarray:
    return (a.astype(np.float64) * np.float64(b) + np.asarray(c, np.float64)).astype(_F32)


def _cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic (a = -0.5) at |x|, in float32 with PyTorch's fused multiply-adds."""
    a = _F32(-0.5)
    x = np.abs(x).astype(_F32)
    near = _fma((_fma(x, a + _F32(2), -(a + _F32(3))) * x).astype(_F32), x, _F32(1))
    far = _fma(_fma(_fma(x, a, -(_F32(5) * a)), x, _F32(8) * a), x, -(_F32(4) * a))
    return np.where(x < 1, near, np.where(x < 2, far, _F32(0))).astype(_F32)


def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(first source index [n_out], tap count [n_out], weights float32 [n_out, k], zero past each output's own
    taps) of one pass."""
    scale = _F32(n_in) / _F32(n_out)
    support = _F32(2.0 * float(scale)) if scale >= 1 else _F32(2.0)
    invscale = _F32(1.0 / float(scale)) if scale >= 1 else _F32(1.0)
    k = int(np.ceil(float(support))) * 2 + 1
    center = (float(scale) * (np.arange(n_out) + 0.5)).astype(_F32)  # a double product stored as float
    first = np.maximum((center - support).astype(np.float64) + 0.5, 0).astype(np.int64)
    last = np.minimum(((center + support).astype(np.float64) + 0.5).astype(np.int64), n_in)
    size = np.clip(last - first, 0, k)
    j = np.arange(k)
    src = (first[:, None] + j[None, :]).astype(_F32)  # int64 - float: float
    arg = (((src - center[:, None]).astype(np.float64) + 0.5) * float(invscale)).astype(_F32)
    w = np.where(j[None, :] < size[:, None], _cubic(arg), _F32(0)).astype(_F32)
    total = np.zeros(n_out, _F32)
    for t in range(k):  # the kernel sums the taps in order, in float32
        total = (total + w[:, t]).astype(_F32)
    w = np.where(total[:, None] != 0, w / np.where(total == 0, _F32(1), total)[:, None], w).astype(_F32)
    return first, size, w


def _pass(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """One separable pass of float32 `x` along `axis` to `n_out` samples."""
    n_in = x.shape[axis]
    first, size, w = taps(n_in, n_out)
    x = np.moveaxis(x, axis, -1)
    idx = np.minimum(first[:, None] + np.arange(w.shape[1])[None, :], n_in - 1)  # past-the-end taps weigh 0
    # The compiled tap loop (taps 1..size-1) runs unrolled by 4 with separate multiplies and adds, and its
    # remainder, the last (size - 1) % 4 taps, with fused multiply-adds: measured against PyTorch on the CPU.
    unrolled = 4 * ((size - 1) // 4)
    out = (x[..., idx[:, 0]] * w[:, 0]).astype(_F32)
    for t in range(1, w.shape[1]):
        live = t < size
        if not live.any():
            continue
        xt = x[..., idx[:, t]]
        plain = (out + xt * w[:, t]).astype(_F32)
        fused = _fma(xt, w[:, t], out)
        out = np.where(live, np.where(t <= unrolled, plain, fused), out)
    return np.moveaxis(out, -1, axis)


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [F, H, W, 3] -> uint8 [F, height, width, 3] exactly as torchvision's antialiased bicubic resize."""
    if frames.shape[1:3] == (height, width):
        return frames
    x = frames.astype(_F32)
    if x.shape[2] != width:
        x = _pass(x, width, 2)
    if x.shape[1] != height:
        x = _pass(x, height, 1)
    return np.rint(np.clip(x, 0, 255)).astype(np.uint8)
