"""Runtime stage: the `thorgen generate` command (raw-prompt generation through a Backend, text or JSON output)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

from .api import EngineConfig, engine_option_flags, open_backend
from .backend import BackendError, GenerationResult, SamplingParams
from .media.images import DEFAULT_BUDGET, SOFT_TOKEN_BUDGETS, ImageError, load_image
from .media.prompts import ImagePlaceholderError, expand_image_tokens, expand_video_text, video_frames
from .media.video import DEFAULT_BUDGET as FRAME_BUDGET
from .media.video import VideoError, VideoInput, load_video
from .options import DEFAULT_CTX

BOS_ID = 2


def _parse_ids(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",")]
    try:
        ids = [int(p) for p in parts if p]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint="--prompt-ids")
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--prompt-ids")
    return ids


def _stop_ids(generation_config: dict, spec) -> frozenset[int]:
    """eos_token_id of generation_config.json (an int or a list), else the model config's eos."""
    eos = generation_config.get("eos_token_id", spec.target.eos_token_id)
    eos = eos if isinstance(eos, list) else [eos]
    return frozenset(int(e) for e in eos if e is not None)


def read_videos(spec, paths: tuple[Path, ...], budget: int, num_frames: int | None, fps: float | None) -> list:
    """Each video file decoded and sampled (VideoInputs); a one-line error for a model without a tower or an
    unusable file."""
    if spec.vision is None:
        raise click.ClickException("--video: this model has no vision tower")
    videos = []
    for path in paths:
        try:
            videos.append(load_video(path.read_bytes(), spec.vision, budget, num_frames=num_frames, fps=fps))
        except (VideoError, OSError) as exc:
            raise click.ClickException(f"{path}: {exc}") from None
    return videos


def _video_text(spec, tok, text: str, videos: list[VideoInput]) -> str:
    """The prompt text with each `<|video|>` replaced by the next video's frames (timestamps and placeholders)."""
    try:
        return expand_video_text(text, videos, lambda i: tok.id_to_token(i) or "", spec.vision)
    except ImagePlaceholderError as exc:
        raise click.ClickException(f"{exc}: write one <|video|> in --prompt for each --video") from None


def _with_images(
    spec, ids: list[int], paths: tuple[Path, ...], budget: int, frames: list | None = None
) -> tuple[list[int], list]:
    """(expanded prompt ids, image and frame spans): each image file read and preprocessed, the placeholders
    expanded; a one-line error for a model without a tower, an unreadable image or a placeholder count mismatch."""
    if spec.vision is None:
        raise click.ClickException("--image: this model has no vision tower")
    images = []
    for path in paths:
        try:
            images.append(load_image(path.read_bytes(), spec.vision, budget))
        except (ImageError, OSError) as exc:
            raise click.ClickException(f"{path}: {exc}") from None
    try:
        return expand_image_tokens(ids, images, spec.vision, frames or [])
    except ImagePlaceholderError as exc:
        raise click.ClickException(f"{exc}: write one <|image|> in --prompt for each --image") from None


@click.command("generate")
@click.option(
    "--model",
    "model",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint directory (target; the drafter is DIR/dflash unless --draft).",
)
@click.option(
    "--backend",
    type=click.Choice(["reference", "cuda"]),
    default="reference",
    show_default=True,
    help="reference: the NumPy oracle (slow, exact); cuda: the compiled engine.",
)
@click.option(
    "--prompt",
    "prompt_text",
    default=None,
    help="Raw text, tokenized WITHOUT a chat template and prefixed with <bos> (id 2).",
)
@click.option("--prompt-ids", "prompt_ids", default=None, help="Comma-separated token ids, used verbatim.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--min-p", type=click.FloatRange(min=0.0, max=1.0), default=0.0, show_default=True)
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Sampling seed; a token depends only on (seed, its position).",
)
@click.option(
    "--speculative/--no-speculative",
    default=False,
    show_default=True,
    help="DFlash draft-then-verify (same tokens as plain decoding).",
)
@click.option(
    "--draft",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="Drafter directory (default: MODEL/dflash when present).",
)
@click.option(
    "--ctx",
    "--max-context",
    "max_context",
    type=click.IntRange(min=2),
    default=None,
    help=f"Context limit in tokens (default: min(the model's max_position_embeddings, {DEFAULT_CTX})).",
)
@click.option(
    "--kv-dtype",
    type=click.Choice(["bf16", "fp8"]),
    default="bf16",
    show_default=True,
    help="KV-cache dtype of the cuda backend (fp8 = e4m3).",
)
@click.option(
    "--image",
    "image_paths",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="An image file (repeat for several): each one fills the prompt's next <|image|> placeholder.",
)
@click.option(
    "--image-max-tokens",
    type=click.Choice([str(b) for b in SOFT_TOKEN_BUDGETS]),
    default=str(DEFAULT_BUDGET),
    show_default=True,
    help="Soft tokens an image may take.",
)
@click.option(
    "--video",
    "video_paths",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A video file (repeat for several): each one fills the --prompt's next <|video|> placeholder with its "
    "sampled frames (timestamp + soft tokens each).",
)
@click.option(
    "--num-frames",
    type=click.IntRange(min=1),
    default=None,
    help="--video: frames to sample from each video, uniformly (default: up to 32).",
)
@click.option(
    "--fps",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    help="--video: frames to sample per second of video, instead of --num-frames (at most 32).",
)
@click.option(
    "--video-max-tokens",
    type=click.Choice([str(b) for b in SOFT_TOKEN_BUDGETS]),
    default=str(FRAME_BUDGET),
    show_default=True,
    help="Soft tokens a video frame may take.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@engine_option_flags
def generate(
    model: Path,
    backend: str,
    prompt_text: str | None,
    prompt_ids: str | None,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
    seed: int,
    speculative: bool,
    draft: Path | None,
    max_context: int | None,
    kv_dtype: str,
    image_paths: tuple[Path, ...],
    image_max_tokens: str,
    video_paths: tuple[Path, ...],
    num_frames: int | None,
    fps: float | None,
    video_max_tokens: str,
    as_json: bool,
    engine_options,
) -> None:
    """Generate tokens for one raw prompt (no chat template) and print them.

    With --image, each <|image|> placeholder of the prompt (in order) becomes that image's <|image> + soft tokens
    + <image|> span; the prompt must hold exactly one placeholder per image. With --video (and --prompt), each
    <|video|> becomes that video's sampled frames, each `mm:ss <|image>` + soft tokens + `<image|>`.

    Generation stops at a stop id (generation_config.json eos_token_id) or after --max-tokens. Text output
    streams the decoded tokens (special tokens included) to stdout and a summary line to stderr; --json prints
    {token_ids, text, finish_reason, timings, prompt_tokens[, accepted_lengths]}.
    """
    if (prompt_text is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    if video_paths and prompt_text is None:
        raise click.UsageError("--video needs --prompt (a video's frames are laid out in the prompt's text)")
    if num_frames is not None and fps is not None:
        raise click.UsageError("give --num-frames or --fps, not both")
    ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
    try:
        opened = open_backend(
            EngineConfig(model, backend, max_context, kv_dtype, draft, max_num_seqs=1, options=engine_options)
        )
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
    engine = opened.backend
    from .text.tokenizer import Tokenizer, TokenizerError

    try:
        tok = Tokenizer.from_file(opened.tokenizer_path)
    except TokenizerError as exc:
        raise click.ClickException(str(exc)) from exc
    videos = read_videos(engine.spec, video_paths, int(video_max_tokens), num_frames, fps) if video_paths else []
    if ids is None:
        ids = [BOS_ID] + tok.encode(
            _video_text(engine.spec, tok, prompt_text or "", videos) if videos else prompt_text or ""
        )
    vocab = engine.spec.target.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise click.BadParameter(
            f"token ids {bad[:5]} lie outside the vocabulary 0..{vocab - 1}", param_hint="--prompt-ids"
        )
    spans: list = []
    if image_paths or videos:
        ids, spans = _with_images(engine.spec, ids, image_paths, int(image_max_tokens), video_frames(videos))
    if speculative and not engine.features.speculative:
        raise click.ClickException(
            f"{model}: no drafter (no {model / 'dflash'} folder): pass --draft DIR or --no-speculative"
        )
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    decoder = tok.incremental_decoder()
    t0 = time.perf_counter()
    result = GenerationResult()
    try:
        stream = engine.generate_stream(
            ids,
            max_tokens,
            sampling,
            stop_ids=_stop_ids(opened.generation_config, engine.spec),
            speculative=speculative,
            result=result,
            images=spans,
        )
        for step in stream:
            text = decoder.push_many(step.token_ids)
            if not as_json and text:
                click.echo(text, nl=False)
                sys.stdout.flush()
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    tail = decoder.flush()
    n = len(result.token_ids)
    timings = {
        "prefill_s": round(result.prefill_s, 6),
        "decode_s": round(result.decode_s, 6),
        "total_s": round(wall, 6),
        "decode_tokens_per_s": round((n - 1) / result.decode_s, 3) if n > 1 and result.decode_s > 0 else None,
    }
    if as_json:
        out = {
            "token_ids": result.token_ids,
            "text": decoder.text,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "timings": timings,
        }
        if speculative:
            out["accepted_lengths"] = result.accepted_lengths
        click.echo(json.dumps(out))
        return
    click.echo(tail)
    summary = (
        f"[{n} tokens, finish={result.finish_reason}, prefill {result.prefill_s:.3f}s, decode {result.decode_s:.3f}s"
    )
    if speculative and result.accepted_lengths:
        mean = sum(result.accepted_lengths) / len(result.accepted_lengths)
        summary += f", mean acceptance length {mean:.2f}"
    click.echo(summary + "]", err=True)
