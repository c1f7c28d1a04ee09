"""Runtime stage: `thorgen bench --image FILE`: one image plus the text prompt, timed: preprocessing (decode, resize,
patches), the vision tower alone, TTFT (encode + prefill, the encoder cache kept out of it) and decode after it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..backend import BackendError, ImageInput, ImageSpan
from ..media.images import ImageError, decode, load_image
from ..media.prompts import expand_image_tokens
from .timing import timed_stream


def _encoder(backend: Any) -> Callable[[ImageInput], np.ndarray] | None:
    """The backend's vision tower as a callable (image -> soft-token rows), with its encoder cache turned off so
    that every timed prompt encodes its image; None where the backend exposes no tower."""
    cache = getattr(backend, "encoder_cache", None)
    if cache is None:
        return None
    cache.slots = 0  # an image encoded once must not make the next TTFT a cache hit
    return cache.model.encode


def image_prompt(spec: Any, text: list[int], image: ImageInput) -> tuple[list[int], list[ImageSpan]]:
    """<bos>, the image's span, then the rest of the text prompt."""
    return expand_image_tokens([text[0], spec.vision.image_token_id, *text[1:]], [image], spec.vision)


def measure_image(backend: Any, report: dict, path: Path, budget: int, text: list[int], gen: int, runs: int) -> None:
    """Add `image` to a `run_bench` report: the image's size and soft tokens, preprocess_ms, encode_ms (the
    tower alone; None without one), and the TTFT and decode tok/s of the image + text prompt (medians)."""
    spec = backend.spec
    if spec.vision is None:
        raise BackendError("--image: this model has no vision tower")
    data = path.read_bytes()
    try:
        width, height = decode(data).size
        prep = []
        for _ in range(runs):
            t0 = time.perf_counter()
            image = load_image(data, spec.vision, budget)
            prep.append(time.perf_counter() - t0)
    except ImageError as exc:
        raise BackendError(f"--image {path}: {exc}") from None
    ids, spans = image_prompt(spec, text, image)
    if len(ids) + gen > backend.max_context:
        raise BackendError(
            f"the image's {image.soft_tokens} soft tokens + the prompt + --gen ({len(ids) + gen}) "
            f"exceed the context of {backend.max_context} (--ctx)"
        )
    encode = _encoder(backend)
    encodes = []
    if encode is not None:
        for _ in range(runs):
            t0 = time.perf_counter()
            encode(image)
            encodes.append(time.perf_counter() - t0)
    timed_stream(backend, ids, min(gen, 4), images=spans)  # warm-up
    ttfts, rates = [], []
    for _ in range(runs):
        r = timed_stream(backend, ids, gen, images=spans)
        ttfts.append(r["ttft_s"])
        n = len(r["token_ids"])
        rates.append((n - 1) / r["decode_s"] if n > 1 and r["decode_s"] > 0 else float("nan"))
    report["image"] = {
        "file": path.name,
        "width": width,
        "height": height,
        "budget": budget,
        "soft_tokens": image.soft_tokens,
        "patches": int(image.patches.shape[0]),
        "prompt_tokens": len(ids),
        "preprocess_ms": round(statistics.median(prep) * 1e3, 3),
        "encode_ms": round(statistics.median(encodes) * 1e3, 3) if encodes else None,
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 3),
        "ttft_ms_runs": [round(t * 1e3, 3) for t in ttfts],
        "decode_tok_s": round(statistics.median(rates), 3),
    }
    if encode is not None and hasattr(backend, "encode_breakdown"):
        report["image"]["encode_kernels"] = backend.encode_breakdown(image)


def image_text(r: dict) -> str:
    i = r["image"]
    encode = "n/a (no tower exposed)" if i["encode_ms"] is None else f"{i['encode_ms']:.1f} ms"
    lines = [
        f"  image           {i['file']} {i['width']}x{i['height']} -> {i['soft_tokens']} soft tokens (budget "
        f"{i['budget']}, {i['patches']} patches); preprocess {i['preprocess_ms']:.1f} ms, encode {encode}",
        f"  image + text    {i['prompt_tokens']} prompt tokens: TTFT {i['ttft_ms']:.1f} ms (median, encode "
        f"included), decode {i['decode_tok_s']:.2f} tok/s",
    ]
    ks = i.get("encode_kernels") or []
    if ks:
        total = sum(k["us"] for k in ks)
        lines.append(f"  vision tower, per kernel (eager launches, event-timed); sum {total:.0f} us:")
    lines += [f"    {k['kernel']:<56} {k['us']:9.1f} us x{k.get('count', 1)}" for k in ks]
    return "\n".join(lines)
