"""Runtime stage: the `thorgen repack-weights` command (checkpoint -> kernel-layout weights.bin + weights.json)."""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import click


class ProgressBar:
    """A one-line progress bar on stderr (redrawn in place on a terminal, a line every 10% otherwise)."""

    def __init__(self, label: str, stream=None) -> None:
        self.label, self.stream = label, stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = self.last = time.monotonic()
        self.last_decile = -1

    def __call__(self, done: int, total: int, item: str) -> None:
        now = time.monotonic()
        frac = done / total if total else 1.0
        decile = int(frac * 10)
        if self.tty and now - self.last < 0.2 and done < total:
            return
        if not self.tty and decile == self.last_decile and done < total:
            return
        self.last, self.last_decile = now, decile
        rate = done / max(now - self.start, 1e-9)
        eta = (total - done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 30)
        line = (
            f"{self.label} [{bar:<30}] {frac * 100:5.1f}% {done / 2**30:6.2f}/{total / 2**30:.2f} GiB "
            f"{rate / 2**20:7.1f} MiB/s ETA {eta:5.0f}s  {item[:40]}"
        )
        if self.tty:
            self.stream.write("\r" + line.ljust(150)[:150])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def report_lines(report: dict) -> list[str]:
    """The quantization report as text: one line per linear, the experts of one layer and projection on one line
    (the largest max_rel, and the RMS over the experts of rms_rel), then the worst over the model."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for name, err in report["linears"].items():
        head, _, rest = name.partition(".experts.")
        groups[f"{head}.experts.*.{rest.split('.', 1)[1]}" if rest else name].append(err)
    lines = [
        f"quantized {name}: max rel err {max(e['max_rel'] for e in errs):.4f}, rms rel err "
        f"{(sum(e['rms_rel'] ** 2 for e in errs) / len(errs)) ** 0.5:.4f}"
        for name, errs in groups.items()
    ]
    worst = report["worst"]
    return lines + [
        f"quantized {len(report['linears'])} linears to NVFP4: worst max rel err {worst['max_rel']:.4f}, "
        f"worst rms rel err {worst['rms_rel']:.4f}"
    ]


@click.command("repack-weights")
@click.option(
    "--model",
    "model_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint folder (RedHatAI NVFP4 layout; drafter in <model>/dflash unless --draft is given).",
)
@click.option(
    "--draft",
    "draft_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="DFlash drafter folder (default: <model>/dflash when it exists).",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Output folder (default: <model>/thorgen-<spec hash[:12]>, or "
    "~/.cache/thorgen/weights/<model>-<hash[:12]> when the model folder is read-only).",
)
@click.option(
    "--lm-head",
    type=click.Choice(["nvfp4", "bf16"]),
    default="nvfp4",
    show_default=True,
    help="Quantize the tied lm_head to NVFP4 (4.5 bits, ~3.3x fewer bytes per token) or keep it bf16.",
)
@click.option(
    "--arch",
    default=None,
    help="GPU arch the artifact is for (default sm_90a, the H200): sm_90a stores FP4 in the 'shift' byte "
    "order, sm_100a and later in 'nat'; the artifact loads only on that arch.",
)
@click.option(
    "--quantize",
    type=click.Choice(["none", "nvfp4"]),
    default="none",
    show_default=True,
    help="nvfp4: quantize every linear the checkpoint stores bf16 (a ModelOpt or bf16 checkpoint) to NVFP4 "
    "with thorgen's quantizer, in the RedHatAI checkpoint's layout; each linear's error is printed and "
    "saved as quantization_report.json in the artifact. none: serve the checkpoint as shipped.",
)
@click.option("--verify/--no-verify", default=False, help="Re-read the written file and check every checksum.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar.")
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes (default: the usable cores, at most 16; 1 below 256 MB of output). The "
    "artifact's bytes do not depend on it.",
)
def repack_weights(
    model_dir: Path,
    draft_dir: Path | None,
    out_dir: Path | None,
    lm_head: str,
    arch: str | None,
    verify: bool,
    quiet: bool,
    jobs: int | None,
    quantize: str = "none",
) -> None:
    """Repack a checkpoint offline into the kernels' weight layout.

    Reads the checkpoint memory-mapped and streams it into one weights.bin (every tensor 256-byte aligned,
    per-projection global scales kept, experts stacked per layer) plus weights.json (spec hash, layout version,
    a blake2b checksum per tensor). Written into OUT.tmp-XXXX and renamed onto OUT, so an interrupted run never
    leaves a half-written artifact. Memory stays at a few hundred MB per process whatever the model size.
    """
    from ...model_spec.checkpoint import CheckpointError
    from ..backend import BackendError
    from .repack import QUANT_REPORT, repack
    from .artifact import WeightsArtifact

    t0 = time.monotonic()
    bar = None if quiet else ProgressBar("repack")
    try:
        out = repack(
            model_dir,
            out_dir,
            lm_head=lm_head,
            arch=arch,
            draft_dir=draft_dir,
            progress=bar,
            jobs=jobs,
            quantize=quantize,
        )
    except (CheckpointError, BackendError, OSError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    finally:
        if bar is not None:
            bar.close()
    art = WeightsArtifact.open(out)
    if quantize != "none":
        for line in report_lines(json.loads((out / QUANT_REPORT).read_text())):
            click.echo(line, err=True)
    if verify:
        try:
            art.verify()
        except BackendError as exc:
            raise click.ClickException(str(exc)) from exc
    click.echo(
        f"wrote {out} ({len(art.tensors)} tensors, {art.total_bytes / 2**30:.2f} GiB, lm_head {lm_head}"
        f"{', verified' if verify else ''}) in {time.monotonic() - t0:.1f} s",
        err=True,
    )
    click.echo(str(out))
