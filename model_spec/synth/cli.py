"""Model spec stage: the `thorgen synth-checkpoint` command (random-weight checkpoints of a preset)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from ..presets import PRESETS
from .writer import MODELOPT_VARIANTS


@click.command("synth-checkpoint")
@click.option("--preset", required=True, type=click.Choice(sorted(PRESETS)), help="Model preset to write.")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Output folder (target files; the drafter goes to OUT/dflash).",
)
@click.option("--seed", default=0, show_default=True, type=int, help="Random seed (same seed -> same bytes).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists and is not empty.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (default: the usable cores, at most 16; 1 for models under 256 MB). "
    "The output bytes do not depend on it.",
)
@click.option(
    "--format",
    "source_format",
    type=click.Choice(["compressed-tensors", "modelopt", "bf16"]),
    default="compressed-tensors",
    show_default=True,
    help="Checkpoint format: RedHatAI's compressed-tensors NVFP4, NVIDIA's ModelOpt NVFP4, Google's bf16.",
)
@click.option(
    "--modelopt-variant",
    type=click.Choice(sorted(MODELOPT_VARIANTS)),
    default="experts-only",
    show_default=True,
    help="ModelOpt only: NVFP4 experts with bf16 attention and dense MLP (NVIDIA's "
    "Gemma-4 export), or every linear NVFP4.",
)
def synth_checkpoint(
    preset: str,
    out_dir: Path,
    seed: int,
    force: bool,
    quiet: bool,
    jobs: int | None,
    source_format: str,
    modelopt_variant: str,
) -> None:
    """Write a synthetic checkpoint: random but numerically sane weights in the exact on-disk layout of the chosen
    format (the same model in every format), a z-lab-layout DFlash drafter in OUT/dflash, a byte-fallback BPE
    tokenizer with Gemma-4's special ids, the chat template and generation config. Written to a temp folder and
    renamed into place."""
    from . import write_synthetic_checkpoint

    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise click.ClickException(f"{out_dir} exists and is not empty; pass --force to replace it")
    t0 = time.monotonic()
    try:
        fmt = MODELOPT_VARIANTS[modelopt_variant] if source_format == "modelopt" else source_format
        write_synthetic_checkpoint(
            preset, out_dir, seed=seed, progress=not quiet, force=force, jobs=jobs, source_format=fmt
        )
    except (OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    size = sum(p.stat().st_size for p in out_dir.rglob("*") if p.is_file())
    click.echo(
        f"wrote {preset} {source_format} checkpoint (seed {seed}) to {out_dir}: {size / 1e9:.2f} GB in "
        f"{time.monotonic() - t0:.1f} s",
        err=True,
    )
