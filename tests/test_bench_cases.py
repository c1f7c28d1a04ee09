"""bench_cases.json round-trips: `thorgen build` (codegen/builder.py, nvcc replaced by empty cubins) writes the
planned kernels' bench cases beside manifest.json, and the kernel benchmark (runtime/bench/cases.py, kernels.py)
reads them back into the same buffers and arguments, checks them against the manifest, and launches them through
KernelRig on the emulated driver; the whole benchmark runs there over the build folder."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

import engine_emulator as EE
from thorgen.codegen import bench_cases as codegen_cases
from thorgen.codegen import builder
from thorgen.codegen.arch import get_arch
from thorgen.model_spec.bench_args import Buf, Scalar
from thorgen.codegen.nvcc import CompileResult
from thorgen.codegen.plan import plan
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.backend import BackendError
from thorgen.runtime.bench import cases as runtime_cases
from thorgen.runtime.bench import kernels as kernel_bench
from thorgen.runtime.bench.kernels import KernelRig, find_build
from thorgen.runtime.cuda import device as dev
from thorgen.runtime.manifest import ModuleError, load_manifest

ARCH = "sm_90a"


def _empty_cubins(sources: dict[str, str], arch, work_dir: Path, jobs: int = 0, cache=None) -> dict:
    return {name: (b"", CompileResult(name, 0.0, True, {})) for name in sources}


@pytest.fixture(scope="module")
def tiny_build(tmp_path_factory) -> Path:
    """`thorgen build --preset tiny --arch sm_90a` with nvcc replaced by empty cubins."""
    out = tmp_path_factory.mktemp("build") / "tiny" / ARCH
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "compile_sources", _empty_cubins)
        mp.setattr(builder, "find_nvcc", lambda: "nvcc")
        mp.setattr(builder, "nvcc_version", lambda nvcc: "emulated")
        builder.build(get_preset("tiny"), get_arch(ARCH), out)
    return out


def test_nvcc_build_writes_the_cases_of_its_kernels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real build of two kernels (skips without nvcc) writes bench cases for exactly those two."""
    try:
        builder.find_nvcc()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(str(exc))
    monkeypatch.setenv("THORGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec, arch = get_preset("tiny"), get_arch(ARCH)
    two = [k for k in plan(spec, arch) if k.family == "norms"][:2]
    builder.build(spec, arch, tmp_path / "out", jobs=2, kernels=two)
    read = runtime_cases.load_bench_cases(load_manifest(tmp_path / "out"))
    assert {c.kernel for c in read} == {c.kernel.name for c in codegen_cases.built_bench_cases(spec, arch, two)}
    assert read and {c.kernel for c in read} <= {k.name for k in two}


def test_round_trip_gives_the_same_buffers_and_args(tiny_build: Path) -> None:
    spec, arch = get_preset("tiny"), get_arch(ARCH)
    planned = plan(spec, arch)
    written = codegen_cases.built_bench_cases(spec, arch, planned)
    read = runtime_cases.load_bench_cases(load_manifest(tiny_build))
    assert written and len(read) == len(written)
    names = {k.name for k in planned}
    assert all(c.kernel.name in names for c in written)
    for w, r in zip(written, read):
        assert (r.kernel, r.bytes_moved, r.grid, r.note, r.weight_streaming) == (
            w.kernel.name,
            w.bytes_moved,
            w.grid,
            w.note,
            w.weight_streaming,
        )
        assert len(r.args) == len(w.args)
        host = runtime_cases.host_args(r, np.random.default_rng(7))
        rng = np.random.default_rng(7)
        for wa, ra, h in zip(w.args, r.args, host):
            if isinstance(wa, Buf):
                assert isinstance(ra, Buf)
                assert (ra.name, ra.dtype, ra.count, ra.values) == (wa.name, wa.dtype, wa.count, wa.values)
                assert (ra.low, ra.high, type(ra.low), type(ra.high)) == (wa.low, wa.high, type(wa.low), type(wa.high))
                want = None if wa.count == 0 else runtime_cases.fill(wa, rng)  # the same rng draws, in order
                assert (h is None) == (want is None)
                if want is not None:
                    assert h.dtype == want.dtype and np.array_equal(h.view(np.uint8), want.view(np.uint8))
            else:
                assert isinstance(ra, Scalar)
                assert (ra.name, ra.ctype, ra.value) == (wa.name, wa.ctype, wa.value)
                assert h == wa.value and h.dtype.itemsize == {"i32": 4, "u32": 4, "f32": 4}.get(wa.ctype, 8)


def test_cases_of_kernels_the_build_lacks_are_dropped() -> None:
    """A case whose kernel the build does not hold, or holds with another spec under its name, has no cubin."""
    spec, arch = get_preset("tiny"), get_arch(ARCH)
    planned = plan(spec, arch)
    every = codegen_cases.built_bench_cases(spec, arch, planned)
    left_out, changed = every[0].kernel, every[-1].kernel
    assert left_out.name != changed.name
    built = [
        dataclasses.replace(k, smem_bytes=k.smem_bytes + 16) if k == changed else k for k in planned if k != left_out
    ]
    kept = {c.kernel.name for c in codegen_cases.built_bench_cases(spec, arch, built)}
    assert kept == {c.kernel.name for c in every} - {left_out.name, changed.name}


def _rewrite(build: Path, out: Path, change) -> Path:
    """`out`: a copy of the build's manifest and bench cases with `change(bench cases JSON)` applied."""
    out.mkdir()
    for name in ("manifest.json", "programs.json.gz"):
        (out / name).write_bytes((build / name).read_bytes())
    data = json.loads((build / runtime_cases.BENCH_CASES_NAME).read_text())
    change(data)
    (out / runtime_cases.BENCH_CASES_NAME).write_text(json.dumps(data))
    return out


def test_stale_or_missing_cases_say_rebuild(tiny_build: Path, tmp_path: Path) -> None:
    def other_build(d):
        d["spec_hash"] = "0" * 64

    def other_args(d):
        d["cases"][0]["args"] = d["cases"][0]["args"][::-1]

    def unknown_kernel(d):
        d["cases"][0]["kernel"] = "no_such_kernel"

    for change, words in (
        (other_build, "was written for"),
        (other_args, "its manifest entry takes"),
        (unknown_kernel, "no kernel 'no_such_kernel'"),
    ):
        folder = _rewrite(tiny_build, tmp_path / change.__name__, change)
        with pytest.raises(ModuleError, match=words):
            runtime_cases.load_bench_cases(load_manifest(folder))
    (folder / runtime_cases.BENCH_CASES_NAME).unlink()
    with pytest.raises(ModuleError, match="thorgen build"):
        runtime_cases.load_bench_cases(load_manifest(folder))


def test_find_build(tiny_build: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("THORGEN_KERNELS", raising=False)
    assert find_build(ARCH, kernel_dir=tiny_build).path.parent == tiny_build
    # ./thorgen-build/<preset>/<arch> is `thorgen build --preset`'s default folder
    (tmp_path / "thorgen-build").symlink_to(tiny_build.parents[1])
    monkeypatch.chdir(tmp_path)
    assert find_build(ARCH, preset="tiny").path.parent.resolve() == tiny_build.resolve()
    with pytest.raises(BackendError, match="thorgen build --preset tiny --arch sm_100a"):
        find_build("sm_100a", preset="tiny")


def test_cases_launch_through_the_rig(tiny_build: Path, tmp_path: Path) -> None:
    """Every norms and embedding case, read back, launches on its manifest entry (argument count and widths as the
    manifest declares) on the emulated driver."""
    manifest = load_manifest(tiny_build)
    cases = [
        c
        for c in runtime_cases.load_bench_cases(manifest)
        if manifest.kernel(c.kernel).family in ("norms", "embedding")
    ]
    assert cases
    driver = EE.install(tiny_build)
    device = dev.Device.open(0)
    rig = KernelRig(device, tmp_path / "work", arch=manifest.arch)
    try:
        rig.add(manifest.kernel(c.kernel) for c in cases)
        rng = np.random.default_rng(0)
        for case in cases:
            args = [rig.upload(h) if isinstance(h, np.ndarray) else h for h in runtime_cases.host_args(case, rng)]
            rig.launch(case.kernel, args, case.grid)
            rig.free()
        assert driver.launches == [c.kernel for c in cases]
    finally:
        rig.close()
        device.close()
        dev.set_driver(None)


@pytest.fixture
def emulated_gpu(tiny_build: Path, monkeypatch: pytest.MonkeyPatch):
    """The emulated driver, timing nothing (EE.install_for_timing)."""
    yield EE.install_for_timing(tiny_build, monkeypatch)
    dev.set_driver(None)


def test_benchmark_runs_over_the_build_folder(tiny_build: Path, emulated_gpu) -> None:
    report = kernel_bench.run_bench(kernel_dir=tiny_build, iters=2, flush_l2=False, families=("norms",))
    manifest = load_manifest(tiny_build)
    want = [c.kernel for c in runtime_cases.load_bench_cases(manifest) if manifest.kernel(c.kernel).family == "norms"]
    assert want and [r["kernel"] for r in report["kernels"]] == want
    assert (report["model"], report["arch"], report["kernel_dir"]) == ("tiny", ARCH, str(tiny_build))
    for r in report["kernels"]:  # one launch between two events; a graph of STREAM_LAUNCHES launches
        assert r["single_us"] == pytest.approx(10.0) and r["family"] == "norms"
        assert r["stream_us"] == pytest.approx(10.0 / kernel_bench.STREAM_LAUNCHES)
    assert set(emulated_gpu.launches) == set(want)
    assert "tiny kernels of" in kernel_bench.format_report(report)


def test_benchmark_refuses_a_build_for_another_gpu(tiny_build: Path, tmp_path: Path, emulated_gpu) -> None:
    other = _rewrite(tiny_build, tmp_path / "other", lambda d: d.update(arch="sm_100a"))
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps({**manifest, "arch": "sm_100a"}))
    with pytest.raises(ModuleError, match="kernels built for sm_100a, this GPU is sm_90a"):
        kernel_bench.run_bench(kernel_dir=other, iters=1, flush_l2=False)
