"""Runtime stage: the values every backend and its users share: requests (SamplingParams, images), results, the
errors a request can meet, and what a backend can run (BackendFeatures); the interfaces: runtime/engine/interface.py."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable, Protocol, Sequence

import numpy as np


class BackendError(RuntimeError):
    """A request the backend cannot serve (prompt over the context, no GPU, ...): the message says what to do."""


class SequenceFailed(BackendError):
    """One sequence failed while it ran (its sampling, logits processing, grammar, a device error attributable to
    it, ...): it finishes alone with this error while the other sequences of the step go on. `request_fault`: the
    request's own values caused it (a client error, 4xx); else the engine's (5xx). The message names no other
    request."""

    def __init__(self, request_id: str, message: str, request_fault: bool = False) -> None:
        self.request_id, self.request_fault, self.detail = request_id, request_fault, message
        super().__init__(f"request {request_id}: {message}")

    def __reduce__(self) -> tuple[Any, tuple[str, str, bool]]:  # (pickled by its arguments, not by str(self))
        return type(self), (self.request_id, self.detail, self.request_fault)


class EngineStateLost(BackendError):
    """A failure after which the engine's own state is unknown (e.g. a device error that poisons the context):
    every sequence in it fails, and the engine must be rebuilt before it runs another step."""


def check_token_ids(ids: Iterable[int], vocab: int, what: str = "prompt") -> None:
    """BackendError naming the first ids outside 0..vocab-1."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise BackendError(f"{what} token ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}")


# uint8 pixel -> float32 in [0, 1]: v * (1 / 255) in float64, rounded once to float32 (the HF processor's rescale)
PIXEL_UNIT = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One preprocessed image (runtime.media.images): its patches in (py, px, c) order, row-major over the patch
    grid, as uint8 pixels [L, patch_dim]; each patch's (x, y) grid position i32 [L, 2];
    the soft tokens it becomes (L / pool^2); and a content hash (sha256 of the patches and their grid) that keys
    the encoder and prefix caches. Identity is the hash: two inputs with one hash are the same image to the tower."""

    patches: np.ndarray
    positions: np.ndarray
    soft_tokens: int
    hash: str

    def pixel_values(self) -> np.ndarray:
        """The patches as float32 in [0, 1] (uint8 / 255 rounded once from float64, as the HF processor does; the
        device tower computes the same in its first kernel)."""
        out: np.ndarray = PIXEL_UNIT[self.patches]  # a table: 15x faster than the float64 product, the same values
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ImageInput) and other.hash == self.hash

    def __hash__(self) -> int:
        return hash(self.hash)


def patch_width(image: ImageInput) -> int:
    """The width of the image's patch grid (its patches run row-major: the last one's x + 1). Images of one soft-token
    count and one width share a grid: one encode may take them together."""
    return int(image.positions[-1][0]) + 1


@dataclass(frozen=True)
class ImageSpan:
    """Where an image sits in a prompt: its soft-token placeholders are prompt positions offset .. offset+N-1."""

    offset: int
    image: ImageInput

    @property
    def end(self) -> int:
        return self.offset + self.image.soft_tokens


class ImageEncoder(Protocol):
    """A vision tower: an image's soft-token rows float32 [N, text hidden]."""

    def encode(self, image: ImageInput) -> np.ndarray: ...


DONE_KEPT = 32  # images encoded beside the steps and not yet taken by a prefill (an aborted request's stay)


class ImageRowCache:
    """The soft-token rows of recently encoded images, by content hash: an LRU of `slots` images in front of a
    tower (`model.encode(image) -> float32 [N, text hidden]`), shared by both backends' engines. `encoded` counts
    the images the tower ran (misses); `slots = 0` turns the cache off (the bench times every encode)."""

    def __init__(self, model: ImageEncoder, slots: int = 8) -> None:
        self.model, self.slots, self.encoded = model, slots, 0
        self._rows: OrderedDict[str, np.ndarray] = OrderedDict()
        self._done: OrderedDict[str, np.ndarray] = OrderedDict()

    def rows(self, image: ImageInput) -> np.ndarray:
        self.ready([image], wait=True)  # a tower encoding beside the steps: its rows (or the one in flight) waited for
        hit = self._rows.get(image.hash)
        if hit is not None:
            self._rows.move_to_end(image.hash)
            return hit
        rows = self._done.pop(image.hash, None)  # encoded beside the steps (ready()), not yet used
        if rows is None:
            rows = self.model.encode(image)
            self.encoded += 1
        if self.slots > 0:
            self._rows[image.hash] = rows
            while len(self._rows) > self.slots:
                self._rows.popitem(last=False)
        return rows

    def ready(self, images: Sequence[ImageInput], wait: bool = False, along: Sequence[ImageInput] = ()) -> bool:
        """Whether every image's rows are at hand (cached, or encoded beside the steps and not yet used). With a
        tower that encodes beside the steps (`start(images, pieces)`, `poll()`, `wait()`, `busy`), starts the first
        missing image when the tower is idle, in pieces between the steps of the sequences running (each call
        advances it), together with the other missing ones of its patch grid, its own first, then those of `along`
        (images of requests queued behind it), as many as one encode takes (`images_per_encode`); `wait` (nothing
        else runs): encode them all now. A tower without them: always True (rows() encodes when asked)."""
        start = getattr(self.model, "start", None)
        if start is None:
            return True
        while True:
            self._collect(wait=False)
            missing = [i for i in images if not self._at_hand(i)]
            if not missing:
                return True
            if not getattr(self.model, "busy"):
                start(self._together(missing[0], [*missing[1:], *along]), pieces=not wait)
            if not wait:
                return False
            self._collect(wait=True)

    def _at_hand(self, image: ImageInput) -> bool:
        return image.hash in self._rows or image.hash in self._done

    def _together(self, first: ImageInput, others: Sequence[ImageInput]) -> list[ImageInput]:
        """`first` and the missing images of `others` with its patch grid, up to what one encode takes; one the
        tower refuses (`check`) is left to fail its own request when its turn comes."""
        limit = getattr(self.model, "images_per_encode", lambda image: 1)(first)
        check = getattr(self.model, "check", None)
        out, grid = {first.hash: first}, (first.soft_tokens, patch_width(first))
        for image in others:
            if len(out) >= limit:
                break
            if image.hash in out or self._at_hand(image) or (image.soft_tokens, patch_width(image)) != grid:
                continue
            try:
                if check is not None:
                    check(image)
            except BackendError:
                continue
            out[image.hash] = image
        return list(out.values())

    def _collect(self, wait: bool) -> None:
        """Keep the rows of an encode that finished beside the steps (the most recent DONE_KEPT unused)."""
        poll = getattr(self.model, "wait" if wait else "poll", None)
        for key, rows in poll() if poll is not None else ():
            self._done[key] = rows
            self.encoded += 1
        while len(self._done) > DONE_KEPT:
            self._done.popitem(last=False)

    @property
    def bytes(self) -> int:
        """Host bytes of the rows kept (at most `slots` images' plus DONE_KEPT encoded and not yet used)."""
        return sum(rows.nbytes for kept in (self._rows, self._done) for rows in list(kept.values()))

    def clear(self) -> None:
        self._rows.clear()
        self._done.clear()


def check_image_spans(ids: Sequence[int], spans: Sequence[ImageSpan], placeholder_ids: Collection[int]) -> None:
    """BackendError unless the spans are in order, disjoint, inside the prompt, and cover exactly the prompt's
    placeholder ids (an image's `<|image|>` or a video frame's `<|video|>`: vision.placeholder_ids)."""
    at = -1
    covered = 0
    for span in spans:
        if span.offset <= at or span.end > len(ids):
            raise BackendError(
                f"image span {span.offset}..{span.end} is out of order or outside the {len(ids)}-token prompt"
            )
        if any(ids[i] not in placeholder_ids for i in range(span.offset, span.end)):
            raise BackendError(
                f"image span {span.offset}..{span.end} does not hold {span.image.soft_tokens} "
                f"image or video placeholder tokens ({', '.join(map(str, placeholder_ids))})"
            )
        at = span.end - 1
        covered += span.image.soft_tokens
    placeholders = sum(1 for t in ids if t in placeholder_ids)
    if placeholders != covered:
        raise BackendError(f"the prompt has {placeholders} image/video placeholder tokens; its images take {covered}")


def image_key(image_hash: str, index: int) -> int:
    """A negative id standing for soft token `index` of an image in cache keys (never a real token id)."""
    digest = hashlib.blake2b(f"{image_hash}:{index}".encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "little") >> 2)


def key_tokens(ids: Sequence[int], spans: Sequence[ImageSpan]) -> list[int]:
    """The ids that key prefix caches: each image placeholder becomes image_key(hash, index), so two different
    images never share cached K/V and the same image at the same place does."""
    out = list(ids)
    for span in spans:
        out[span.offset : span.end] = [image_key(span.image.hash, i) for i in range(span.image.soft_tokens)]
    return out


def span_floor(n: int, spans: Sequence[ImageSpan]) -> int:
    """The largest m <= n such that the first m positions end outside every image span (a span is all or
    nothing: its tokens attend to each other both ways, so a chunk or cache hit never ends inside one)."""
    for span in spans:
        if span.offset < n < span.end:
            return span.offset
    return n


MAX_TOP_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0
# repetition_penalty scales a seen token's logit by 1/r or r. Within [1/100, 100] a logit moves by at most 100x,
# which float32 holds for any logit a model makes (Gemma-4's are softcapped to +-30, so +-3,000 at worst), where
# r = 1e-300 made a non-finite value. Useful penalties lie near 1 (vLLM and HF examples use 1.0..2.0).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
PENALTY_LIMIT = 2.0  # presence / frequency penalties, as OpenAI bounds them

# One committed token's logprob entry: (its logprob, ((token id, logprob), ...) for the top entries asked for).
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 is greedy. Filters apply in the order softcap -> temperature -> top-k -> top-p -> min-p.

    Logits processing (all off by default, so that a plain request pays nothing) runs on the softcapped logits
    before the temperature, in vLLM's order and semantics: repetition_penalty over prompt + output tokens
    (positive logits divided, negative multiplied), then frequency_penalty * count and presence_penalty over
    output tokens, then logit_bias (token id -> bias, clamped to +-100), then the grammar's allowed-token mask,
    and while fewer than `min_tokens` tokens are out, the sequence's stop ids are masked off (vLLM's min_tokens).
    `logprobs` (None: off, else 0..20 top entries) come from the softcapped logits, before any processing.
    `prompt_logprobs` (None: off, else 0..20 top entries): the same for every prompt token after the first, each
    given the tokens before it (completions' `echo`; lm-eval's loglikelihood). Such a request bypasses the prefix
    cache: a cached prefix has no logits."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted by id
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    draft_tokens: int | None = None  # a speculative request's drafts per step, at most (None: the drafter's block)
    grammar: Any = None  # a runtime.text.grammar.Grammar
    min_tokens: int = 0  # no stop id may be sampled before this many output tokens (0: off)

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} {value!r} must be a finite number")
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k {self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p {self.top_p} must lie in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p {self.min_p} must lie in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -PENALTY_LIMIT <= getattr(self, name) <= PENALTY_LIMIT:
                raise ValueError(f"{name} {getattr(self, name)} must lie in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty {self.repetition_penalty} must lie in [{low:g}, {high:g}] (1: off; "
                "below 1 favours repeats, above 1 penalises them)"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs {self.logprobs} must lie in 0..{MAX_TOP_LOGPROBS}")
        if self.draft_tokens is not None and not self.draft_tokens >= 1:
            raise ValueError(f"draft_tokens {self.draft_tokens} must be >= 1 (speculative off is its own switch)")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top prompt logprobs {self.prompt_logprobs} must lie in 0..{MAX_TOP_LOGPROBS}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens {self.min_tokens} must be >= 0")
        bias = dict(self.logit_bias)
        if len(bias) != len(self.logit_bias):
            raise ValueError("logit_bias names a token id twice")
        bad = [
            t for t, b in bias.items() if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
        ]
        if bad:
            raise ValueError(f"logit_bias for token {bad[0]} must be a finite number, not {bias[bad[0]]!r}")
        object.__setattr__(
            self,
            "logit_bias",
            tuple((int(t), max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(b)))) for t, b in sorted(bias.items())),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (a penalty, a bias, a grammar or min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.grammar is not None
            or self.min_tokens
        )

    @property
    def extended(self) -> bool:
        """Whether the request uses anything beyond the plain sampler (processing or logprobs)."""
        return self.processed or self.logprobs is not None

    def describe_extended(self) -> str:
        names = [
            n
            for n, on in (
                ("logprobs", self.logprobs is not None),
                ("prompt logprobs (echo)", self.prompt_logprobs is not None),
                ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
                ("repetition_penalty", self.repetition_penalty != 1.0),
                ("logit_bias", self.logit_bias),
                ("response_format / forced tool_choice", self.grammar is not None),
                ("min_tokens", self.min_tokens),
            )
            if on
        ]
        return ", ".join(names)


@dataclass
class StepOutput:
    """Tokens committed by one decode (or verify) step; `accepted` is the drafts accepted in a speculative step."""

    token_ids: list[int]
    accepted: int | None = None


@dataclass
class GenerationResult:
    token_ids: list[int] = field(default_factory=list)
    accepted_lengths: list[int] = field(default_factory=list)  # acc+1 per verify step (1..block_size)
    finish_reason: str = "length"  # "stop" (a stop id was produced), "length", "cancelled"
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class BackendFeatures:
    """What a backend can run beyond plain decoding (runtime/engine/interface.py's Backend.features)."""

    speculative: bool = False  # DFlash draft + verify (a drafter, and on the GPU its kernels)
    grammar: bool = False  # grammar-constrained decoding (llguidance masks: structured outputs, forced tool calls)
