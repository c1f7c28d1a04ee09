"""Codegen stage: regenerates the committed sources under build/<preset>/<arch>/ (`python -m thorgen.codegen.regen`).

build/ holds, per shipped preset, the rendered .cu of every planned kernel plus plan.json, so a spec or template
change shows up as a reviewable diff; tests/test_codegen_stale.py fails when they are out of date.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..model_spec.presets import PRESETS
from .arch import get_arch
from .plan import plan, plan_json
from .render import render

BUILD_DIR = Path(__file__).resolve().parent.parent / "build"
COMMITTED_ARCHS = ("sm_90a",)


def generate(preset: str, arch_name: str) -> dict[str, str]:
    """{relative file name: text} of one preset/arch folder."""
    spec, arch = PRESETS[preset], get_arch(arch_name)
    kernels = plan(spec, arch)
    files = {f"{k.name}.cu": render(k, arch, spec.spec_hash) for k in kernels}
    files["plan.json"] = plan_json(spec, arch, kernels)
    return files


def regenerate(out_dir: Path = BUILD_DIR) -> list[Path]:
    """Write every preset x committed arch under out_dir; delete generated files no longer planned. Returns the
    folders written."""
    written = []
    for preset in PRESETS:
        for arch in COMMITTED_ARCHS:
            folder = Path(out_dir) / preset / arch
            folder.mkdir(parents=True, exist_ok=True)
            files = generate(preset, arch)
            for stale in folder.iterdir():
                if stale.is_file() and stale.name not in files and (stale.suffix == ".cu" or stale.name == "plan.json"):
                    stale.unlink()
            for name, text in files.items():
                path = folder / name
                if not path.is_file() or path.read_text() != text:
                    path.write_text(text)
            written.append(folder)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=BUILD_DIR, help="output root (default: the repo's build/)")
    args = ap.parse_args(argv)
    for folder in regenerate(args.out):
        sys.stdout.write(f"wrote {folder}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
