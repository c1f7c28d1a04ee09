"""The `thorgen prepare` command: the offline steps a checkpoint needs before `serve --backend cuda`, in one go:
build its kernels for the GPU (codegen) and repack its weights for them (runtime), both into the checkpoint
folder, where the cuda backend finds them without --kernel-dir or --weights."""

from __future__ import annotations

from pathlib import Path

import click


@click.command("prepare")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint folder (the drafter is MODEL/dflash when present).",
)
@click.option(
    "--arch",
    "arch_name",
    default="native",
    show_default=True,
    help="sm_90a | sm_100a | sm_110a | sm_120a | native (the local GPU).",
)
@click.option("-j", "--jobs", default=0, type=int, help="Parallel nvcc processes (default: all cores).")
@click.option(
    "--quantize",
    type=click.Choice(["none", "nvfp4"]),
    default="none",
    show_default=True,
    help="nvfp4: quantize the linears the checkpoint stores bf16 to NVFP4 (see repack-weights --quantize).",
)
@click.pass_context
def prepare(ctx: click.Context, model_dir: Path, arch_name: str, jobs: int, quantize: str) -> None:
    """Build the kernels into MODEL/thorgen-build/<arch> and repack the weights (thorgen build + repack-weights)."""
    from .codegen.arch import ArchError, get_arch, native_arch
    from .codegen.cli import build
    from .model_spec.paths import model_build_dir
    from .runtime.convert.artifact import ArtifactError
    from .runtime.convert.cli import repack_weights
    from .runtime.convert.repack import preflight

    try:
        preflight(model_dir)
    except ArtifactError as exc:
        raise click.ClickException(str(exc)) from exc
    try:
        arch = native_arch() if arch_name.strip().lower() == "native" else get_arch(arch_name)
    except ArchError as exc:
        raise click.ClickException(str(exc)) from exc
    ctx.invoke(
        build,
        arch_name=arch.name,
        model_dir=model_dir,
        preset=None,
        out_dir=model_build_dir(model_dir, arch.name),
        jobs=jobs,
        quantize=quantize,
    )
    ctx.invoke(
        repack_weights,
        model_dir=model_dir,
        draft_dir=None,
        out_dir=None,
        lm_head="nvfp4",
        arch=arch.name,
        verify=False,
        quiet=True,
        jobs=None,
        quantize=quantize,
    )
    click.echo(f"ready: thorgen serve --model {model_dir} --backend cuda")
