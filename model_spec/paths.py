"""Model-spec stage: where thorgen keeps its files, named once for codegen and the runtime: the kernel manifest's file
name, the build folders `thorgen build` and `thorgen prepare` write kernels to (which the runtime looks in), and
the cache directory (the one place its environment variables are read)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

MANIFEST_NAME = "manifest.json"  # codegen/manifest.py writes it into a build folder, runtime/manifest.py reads it
BUILD_FOLDER = "thorgen-build"
CACHE_ENV = "THORGEN_CACHE_DIR"


def build_dir(model_name: str, arch: str) -> Path:
    """`thorgen build`'s default output folder, relative to the working directory: thorgen-build/<model>/<arch>."""
    return Path(BUILD_FOLDER) / model_name / arch


def model_build_dir(model_dir: str | os.PathLike, arch: str) -> Path:
    """`thorgen prepare`'s output folder, inside the checkpoint: <model>/thorgen-build/<arch>."""
    return Path(model_dir) / BUILD_FOLDER / arch


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """thorgen's cache (cubins, repacked weights of read-only checkpoints, the demo model): $THORGEN_CACHE_DIR, else
    $XDG_CACHE_HOME/thorgen, else ~/.cache/thorgen."""
    env = os.environ if environ is None else environ
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "thorgen"
