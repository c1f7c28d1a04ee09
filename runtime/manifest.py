"""The kernel manifest that `thorgen build` writes, read as plain JSON: kernels, conventions and step programs, and
the one lookup of the build folder that holds it (`find_kernels`).

The schema is codegen/manifest.py's; the runtime never imports codegen, so the fields it relies on are re-checked
here. Both the cuda engine and the reference's engine-precision mode read it.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..model_spec.conventions import MANIFEST_SCHEMA, max_step_tokens
from ..model_spec.paths import MANIFEST_NAME, build_dir, model_build_dir
from .backend import BackendError

KERNELS_ENV = "THORGEN_KERNELS"


class ModuleError(BackendError):
    """A manifest or cubin the runtime cannot use: names the file and what to rebuild."""


@dataclass(frozen=True)
class KernelEntry:
    name: str
    cubin: Path
    entry: str
    family: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    args: tuple[str, ...]
    params: dict
    template: str = ""
    # arg -> "r" (a pointer the kernel only reads), "w" (one it writes), "v" (a value); {}: the manifest gave
    # none (the dataflow checks refuse such a kernel)
    access: dict = field(default_factory=dict)

    def param(self, key: str) -> Any:
        try:
            return self.params[key]
        except KeyError:
            raise ModuleError(f"kernel {self.name} has no param {key!r} (has {sorted(self.params)})") from None


@dataclass(frozen=True)
class KernelManifest:
    path: Path
    model: str
    spec_hash: str
    arch: str
    conventions: dict
    kernels: dict[str, KernelEntry]
    # the step programs, {kv dtype: {program key: [{"lo", "hi", "launches"}]}} (codegen/programs.py), and what
    # the kinds left out lack, by group ("core", "ext", "speculative")
    programs: dict = field(default_factory=dict)
    programs_missing: dict = field(default_factory=dict)

    @property
    def max_step_tokens(self) -> int:
        """The most rows one forward of this build runs (its convention; older manifests: the current default)."""
        return max_step_tokens(self.conventions)

    def kernel(self, name: str) -> KernelEntry:
        try:
            return self.kernels[name]
        except KeyError:
            raise ModuleError(
                f"{self.path}: no kernel {name!r} in the manifest ({len(self.kernels)} kernels); "
                "rebuild with `thorgen build`"
            ) from None

    def check(self, spec_hash: str | None = None, device_arch: str | None = None) -> None:
        """ModuleError naming every field where the manifest and the model/device disagree."""
        diffs = []
        if spec_hash is not None and spec_hash != self.spec_hash:
            diffs.append(
                f"spec hash: kernels built for {self.spec_hash[:12]} ({self.model}), model is {spec_hash[:12]}"
            )
        if device_arch is not None and device_arch != self.arch:
            diffs.append(f"arch: kernels built for {self.arch}, this GPU is {device_arch}")
        if diffs:
            raise ModuleError(
                f"{self.path} does not match: "
                + "; ".join(diffs)
                + f". Rebuild with `thorgen build --arch {device_arch or self.arch}`"
            )


def kernel_dirs(
    arch: str, model_name: str, model_dir: Path | None = None, kernels_dir: Path | None = None
) -> list[Path]:
    """Where the built kernels of `model_name` for `arch` are looked for, in order: `kernels_dir` (--kernel-dir DIR),
    $THORGEN_KERNELS, `thorgen build`'s default folder ./thorgen-build/<model>/<arch>, and with a checkpoint folder
    `thorgen prepare`'s <model>/thorgen-build/<arch>."""
    dirs = [Path(kernels_dir)] if kernels_dir else []
    if os.environ.get(KERNELS_ENV):
        dirs.append(Path(os.environ[KERNELS_ENV]))
    dirs.append(build_dir(model_name, arch))
    if model_dir is not None:
        dirs.append(model_build_dir(model_dir, arch))
    return dirs


def find_kernels(
    arch: str,
    model_name: str,
    model_dir: Path | None = None,
    kernels_dir: Path | None = None,
    option: str = "--kernel-dir",
) -> KernelManifest:
    """The manifest in the first of kernel_dirs(...) that holds one; ModuleError naming where it looked, the build
    command (of the checkpoint, else of the preset `model_name`) and `option`, the caller's flag for a folder."""
    dirs = kernel_dirs(arch, model_name, model_dir, kernels_dir)
    for d in dirs:
        if (d / MANIFEST_NAME).is_file():
            return load_manifest(d)
    source = f"--model {model_dir}" if model_dir is not None else f"--preset {model_name}"
    raise ModuleError(
        f"no built kernels for {arch} (looked in {', '.join(map(str, dirs))}); run "
        f"`thorgen build {source} --arch {arch}` or pass {option} DIR"
    )


def load_manifest(path: str | Path) -> KernelManifest:
    """Read manifest.json (or a folder holding one); ModuleError for a missing file or a malformed entry."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST_NAME
    if not p.is_file():
        raise ModuleError(f"kernel manifest {p} not found; build the kernels with `thorgen build` first")
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModuleError(f"{p}: unreadable kernel manifest ({exc}); rebuild with `thorgen build`") from exc
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ModuleError(f"{p}: manifest schema {got!r}, this runtime reads schema {MANIFEST_SCHEMA}; rebuild")
    kernels = {}
    for name, k in (data.get("kernels") or {}).items():
        try:
            kernels[name] = KernelEntry(
                name=name,
                cubin=p.parent / k["cubin"],
                entry=k.get("entry", name),
                family=k.get("family", ""),
                grid=tuple(int(v) for v in k["grid"]),
                block=tuple(int(v) for v in k["block"]),  # type: ignore[arg-type]
                smem_bytes=int(k.get("smem_bytes", 0)),
                args=tuple(k.get("args", ())),
                params=dict(k.get("params", {})),
                template=str(k.get("template", "")),
                access=dict(k.get("access") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModuleError(f"{p}: kernel {name!r} entry is malformed ({exc!r}); rebuild") from exc
    for key in ("spec_hash", "arch"):
        if not isinstance(data.get(key), str):
            raise ModuleError(f"{p}: manifest has no {key!r}; rebuild with `thorgen build`")
    programs = data.get("programs")
    if programs is None and data.get("programs_file"):
        try:
            programs = json.loads(gzip.decompress((p.parent / str(data["programs_file"])).read_bytes()))
        except (OSError, ValueError) as exc:
            raise ModuleError(f"{p}: unreadable step programs {data['programs_file']} ({exc}); rebuild") from exc
    if not isinstance(programs, dict):
        raise ModuleError(f"{p}: manifest has no step programs; rebuild with `thorgen build`")
    return KernelManifest(
        p,
        str(data.get("model", "")),
        data["spec_hash"],
        data["arch"],
        dict(data.get("conventions") or {}),
        kernels,
        programs,
        dict(data.get("programs_missing") or {}),
    )
