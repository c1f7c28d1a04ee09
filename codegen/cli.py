"""Codegen stage: the `thorgen build` command (plan, render, compile in parallel through the cache, manifest)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from ..model_spec.paths import build_dir
from ..model_spec.types import ALL_NVFP4, ModelSpec, SpecError


def load_model_spec(model_dir: Path | None, preset: str | None, quantize: str = "none") -> ModelSpec:
    """The spec of `--preset NAME` or of a checkpoint folder (config.json [+ dflash/config.json], the linear
    formats its quantization config declares; all NVFP4 with `quantize` "nvfp4", as `repack-weights --quantize
    nvfp4` writes them)."""
    if (model_dir is None) == (preset is None):
        raise click.UsageError("give exactly one of --model DIR or --preset NAME")
    if preset is not None:
        from ..model_spec.presets import get_preset

        return get_preset(preset)
    from ..model_spec.config import spec_from_configs
    from ..model_spec.formats import HF_QUANT_CONFIG, with_checkpoint_formats

    cfg_path = Path(model_dir) / "config.json"
    if not cfg_path.is_file():
        raise click.BadParameter(f"{cfg_path} not found (is {model_dir} a checkpoint folder?)", param_hint="--model")
    try:
        target = json.loads(cfg_path.read_text())
        draft_path = Path(model_dir) / "dflash" / "config.json"
        draft = json.loads(draft_path.read_text()) if draft_path.is_file() else None
        quant_path = Path(model_dir) / HF_QUANT_CONFIG
        quant = json.loads(quant_path.read_text()) if quant_path.is_file() else None
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"invalid JSON in {model_dir}: {exc}", param_hint="--model") from exc
    spec = spec_from_configs(target, draft, name=Path(model_dir).name)
    if quantize == "nvfp4":
        return dataclasses.replace(spec, linear_formats=ALL_NVFP4)
    return with_checkpoint_formats(spec, target, quant)


def format_table(rows: list) -> str:
    head = f"{'kernel':<56} {'regs':>5} {'spills':>7} {'smem B':>8} {'compile s':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        secs = "cached" if r.cached else f"{r.seconds:.2f}"
        lines.append(f"{r.kernel:<56} {r.registers:>5} {r.spills:>7} {r.smem_bytes:>8} {secs:>10}")
    return "\n".join(lines)


@click.command("build")
@click.option(
    "--arch", "arch_name", required=True, help="sm_90a | sm_100a | sm_110a | sm_120a | native (the local GPU)"
)
@click.option("--model", "model_dir", type=click.Path(file_okay=False, path_type=Path), help="checkpoint folder")
@click.option("--preset", help="a shipped preset (tiny, gemma-4-26b-a4b)")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="output folder (default: ./thorgen-build/<model>/<arch>)",
)
@click.option("-j", "--jobs", default=0, type=int, help="parallel nvcc processes (default: all cores)")
@click.option(
    "--quantize",
    type=click.Choice(["none", "nvfp4"]),
    default="none",
    show_default=True,
    help="nvfp4: kernels for weights repacked with --quantize nvfp4 (every linear NVFP4); none: each "
    "linear in the format the checkpoint stores it (NVFP4 or bf16)",
)
@click.option(
    "--prologue-variants",
    is_flag=True,
    help="Also build the one-row decode GEMVs' bench-only prologue forms (codegen/prologue_variants.py: nc, "
    "the ld.global.nc prologue ptxas schedules after griddepcontrol.wait; early and slice, coherent loads before "
    "it; smem, cp.async copies before it), which `thorgen bench kernels --chain N` times against the planned "
    "ones (each its slice or early form); the step programs never launch them.",
)
def build(
    arch_name: str,
    model_dir: Path | None,
    preset: str | None,
    out_dir: Path | None,
    jobs: int,
    quantize: str = "none",
    prologue_variants: bool = False,
) -> None:
    """Render the model's specialised CUDA kernels and compile them to cubins for one GPU architecture.

    Only changed kernels are recompiled (content-addressed cache in THORGEN_CACHE_DIR, default ~/.cache/thorgen).
    Writes <out>/<kernel>.cubin, <out>/src/<kernel>.cu and <out>/manifest.json, then prints per-kernel
    registers, spills, shared memory and compile time.
    """
    from .arch import ArchError, get_arch, native_arch
    from .builder import BuildError, build as run_build
    from .nvcc import NvccNotFound
    from .plan import PlanError, plan
    from .prologue_variants import prologue_variants as variants_of
    from .render import RenderError

    try:
        arch = native_arch() if arch_name.strip().lower() == "native" else get_arch(arch_name)
        spec = load_model_spec(model_dir, preset, quantize)
        out = out_dir or build_dir(spec.name, arch.name)
        kernels = plan(spec, arch)
        if prologue_variants:
            kernels += variants_of(kernels, arch)
        report = run_build(spec, arch, out, jobs=jobs, kernels=kernels)
    except (ArchError, SpecError, PlanError, RenderError, NvccNotFound) as exc:
        raise click.ClickException(str(exc)) from exc
    except BuildError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(format_table(report.rows))
    click.echo(
        f"{len(report.rows)} kernels for {spec.name} on {arch.name}: {report.compiled} compiled, "
        f"{len(report.rows) - report.compiled} from cache -> {report.manifest}"
    )
