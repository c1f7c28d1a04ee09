"""Runtime stage: `thorgen bench --image FILE`: one image plus the text prompt, timed at each soft-token budget asked
for: preprocessing (decode, resize, patches), the vision tower alone, TTFT (encode + prefill, the encoder cache kept
out of it) and decode after it."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..backend import BackendError, ImageInput, ImageSpan
from ..media.images import SOFT_TOKEN_BUDGETS, ImageError, decode, load_image
from ..media.prompts import expand_image_tokens
from .timing import timed_stream

BENCH_BUDGETS = (70, 280, 560, 1120)  # --image-max-tokens' default: the budgets the image targets are set at


def parse_budgets(text: str) -> list[int]:
    """ "70,280" -> [70, 280]; ValueError naming what is wrong (not integers, or a budget the model has not)."""
    try:
        budgets = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of budgets") from None
    bad = [b for b in budgets if b not in SOFT_TOKEN_BUDGETS]
    if not budgets or bad:
        raise ValueError(
            f"{text!r}: each budget must be one of {', '.join(map(str, SOFT_TOKEN_BUDGETS))} (soft tokens per image)"
        )
    return list(dict.fromkeys(budgets))


def tower_encoder(backend: Any) -> Callable[[ImageInput], np.ndarray] | None:
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


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def _preprocessed(data: bytes, vision: Any, budget: int, runs: int) -> tuple[ImageInput, list[float]]:
    """The image at `budget`, and `runs` timings of its preprocessing from the file's bytes."""
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        image = load_image(data, vision, budget)
        times.append(time.perf_counter() - t0)
    return image, times


def timed_prompt(backend: Any, ids: list[int], spans: list[ImageSpan], gen: int, runs: int) -> dict:
    """ttft_ms (median), ttft_ms_runs and decode_tok_s (median) of `runs` streams of the prompt with its image
    spans, after one warm-up (the first encode and prefill of these sizes)."""
    timed_stream(backend, ids, min(gen, 4), images=spans)
    ttfts, rates = [], []
    for _ in range(runs):
        r = timed_stream(backend, ids, gen, images=spans)
        ttfts.append(r["ttft_s"])
        n = len(r["token_ids"])
        rates.append((n - 1) / r["decode_s"] if n > 1 and r["decode_s"] > 0 else float("nan"))
    return {
        "ttft_ms": median_ms(ttfts),
        "ttft_ms_runs": [round(t * 1e3, 3) for t in ttfts],
        "decode_tok_s": round(statistics.median(rates), 3),
    }


def _timed(backend: Any, image: ImageInput, ids: list[int], spans: list[ImageSpan], gen: int, runs: int) -> dict:
    """encode_ms (the tower alone; None without one), then TTFT and decode tok/s of the image + text prompt."""
    encode = tower_encoder(backend)
    encodes = []
    if encode is not None:
        for _ in range(runs):
            t0 = time.perf_counter()
            encode(image)
            encodes.append(time.perf_counter() - t0)
    out = {"encode_ms": median_ms(encodes) if encodes else None, **timed_prompt(backend, ids, spans, gen, runs)}
    if encode is not None and hasattr(backend, "encode_breakdown"):  # the device tower's launches, per kernel
        out["encode_kernels"] = backend.encode_breakdown(image)
    return out


def measure_image(
    backend: Any, report: dict, path: Path, budgets: Sequence[int], text: list[int], gen: int, runs: int
) -> None:
    """Add `images` to a `run_bench` report: one entry per budget, each with the image's size and soft tokens,
    preprocess_ms, encode_ms (the tower alone; None without one), and the TTFT and decode tok/s of the image +
    text prompt (medians). Every budget's prompt is checked against the context before anything is timed."""
    spec = backend.spec
    if spec.vision is None:
        raise BackendError("--image: this model has no vision tower")
    data = path.read_bytes()
    try:
        width, height = decode(data).size
        prepared = [(budget, *_preprocessed(data, spec.vision, budget, runs)) for budget in budgets]
    except ImageError as exc:
        raise BackendError(f"--image {path}: {exc}") from None
    prompts = []
    for budget, image, prep in prepared:
        ids, spans = image_prompt(spec, text, image)
        if len(ids) + gen > backend.max_context:
            raise BackendError(
                f"at budget {budget}, the image's {image.soft_tokens} soft tokens + the prompt + --gen "
                f"({len(ids) + gen}) exceed the context of {backend.max_context} (--ctx)"
            )
        prompts.append((budget, image, prep, ids, spans))
    report["images"] = [
        {
            "file": path.name,
            "width": width,
            "height": height,
            "budget": budget,
            "soft_tokens": image.soft_tokens,
            "patches": int(image.patches.shape[0]),
            "prompt_tokens": len(ids),
            "preprocess_ms": median_ms(prep),
            **_timed(backend, image, ids, spans, gen, runs),
        }
        for budget, image, prep, ids, spans in prompts
    ]
