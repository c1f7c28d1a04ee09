"""Where files are, resolved once (model_spec/paths.py, runtime/manifest.py kernel_dirs): the cache directory every
stage uses, the manifest name codegen writes and the runtime reads, the build folders `thorgen build` writes and
the kernel lookup searches, in its order."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from thorgen.codegen.cache import CubinCache
from thorgen.codegen.manifest import write_manifest
from thorgen.model_spec.conventions import MANIFEST_SCHEMA
from thorgen.model_spec.paths import MANIFEST_NAME, build_dir, cache_dir, model_build_dir
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.convert.artifact import default_artifact_dirs
from thorgen.runtime.manifest import ModuleError, find_kernels, kernel_dirs


def test_cache_dir_precedence(tmp_path: Path) -> None:
    home = Path.home()
    assert cache_dir({}) == home / ".cache" / "thorgen"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "thorgen"
    assert cache_dir({"XDG_CACHE_HOME": str(tmp_path / "xdg"), "THORGEN_CACHE_DIR": "~/tc"}) == home / "tc"
    assert cache_dir({"THORGEN_CACHE_DIR": ""}) == home / ".cache" / "thorgen"  # an empty value is unset


def test_every_stage_caches_in_the_one_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THORGEN_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_dir() == tmp_path / "cache"
    assert CubinCache().root == tmp_path / "cache"  # codegen's cubins
    model = tmp_path / "model"
    model.mkdir()
    assert default_artifact_dirs(model, "ab" * 32)[1] == tmp_path / "cache" / "weights" / f"model-{'ab' * 6}"


def _fake_build(folder: Path, model: str, arch: str) -> Path:
    """A minimal build folder, written by codegen's manifest writer."""
    folder.mkdir(parents=True)
    return write_manifest(
        folder,
        {"schema": MANIFEST_SCHEMA, "model": model, "spec_hash": "0" * 64, "arch": arch, "kernels": {}, "programs": {}},
    )


def test_codegen_writes_the_name_the_runtime_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THORGEN_KERNELS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert _fake_build(tmp_path / build_dir("m", "sm_90a"), "m", "sm_90a").name == MANIFEST_NAME
    assert find_kernels("sm_90a", "m").path == build_dir("m", "sm_90a") / MANIFEST_NAME


def test_kernel_lookup_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, given, env = tmp_path / "ckpt", tmp_path / "given", tmp_path / "env"
    monkeypatch.delenv("THORGEN_KERNELS", raising=False)
    assert kernel_dirs("sm_90a", "m") == [build_dir("m", "sm_90a")]
    monkeypatch.setenv("THORGEN_KERNELS", str(env))
    assert kernel_dirs("sm_90a", "m", model, given) == [
        given,
        env,
        build_dir("m", "sm_90a"),
        model_build_dir(model, "sm_90a"),
    ]
    assert model_build_dir(model, "sm_90a") == model / "thorgen-build" / "sm_90a"
    with pytest.raises(ModuleError, match=r"thorgen build --model .*ckpt --arch sm_90a` or pass --kernel-dir DIR"):
        find_kernels("sm_90a", "m", model)
    with pytest.raises(ModuleError, match="thorgen build --preset m --arch sm_90a` or pass --kernel-dir DIR"):
        find_kernels("sm_90a", "m", option="--kernel-dir")
    # the first folder that holds a manifest wins: the checkpoint's (thorgen prepare's), then $THORGEN_KERNELS
    _fake_build(model_build_dir(model, "sm_90a"), "from-prepare", "sm_90a")
    assert find_kernels("sm_90a", "m", model).model == "from-prepare"
    _fake_build(env, "from-env", "sm_90a")
    assert find_kernels("sm_90a", "m", model).model == "from-env"
    _fake_build(given, "given", "sm_90a")
    assert find_kernels("sm_90a", "m", model, given).model == "given"


def test_build_writes_where_the_lookup_looks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`thorgen build` without --out builds into build_dir(model, arch), the lookup's default."""
    import thorgen.codegen.builder as builder
    from thorgen.codegen.cli import build

    seen = {}

    def fake(spec, arch, out, jobs=0, **kwargs):
        seen["out"] = out
        raise builder.BuildError([])

    monkeypatch.setattr(builder, "build", fake)
    monkeypatch.delenv("THORGEN_KERNELS", raising=False)
    CliRunner().invoke(build, ["--preset", "tiny", "--arch", "sm_90a"])
    name = get_preset("tiny").name
    assert seen["out"] == build_dir(name, "sm_90a") == kernel_dirs("sm_90a", name)[0]
