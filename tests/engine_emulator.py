"""Test support (not a test module): run the real CUDA engine on a CPU over tests/fake_driver.py's FakeDriver, a
stand-in for cuda.bindings.driver whose device memory is host NumPy arrays and whose kernel launches dispatch to
NumPy references of each kernel's contract (tests/emulated_kernels.py).

Everything above the driver is the production code (open_backend, Engine, Forward, KernelSet argument packing,
graph capture/replay, pinned staging, strided copies), so a wiring bug (wrong pointer, row offset, stride, launch
order, position or slot arithmetic, stale graph argument) shows up as a divergence from the reference backend,
while the kernels themselves are replaced by float64 references that round where the kernel stores (through
float32, as the kernels convert their float32 registers: `RK.store`). Accesses are bounds-checked against the
allocation they start in. The reference backend's numerics="w4a16" mode rounds at the same points, so the two
agree token for token (tests/test_reference_w4a16.py).
"""

from __future__ import annotations

from pathlib import Path

from thorgen.model_spec.nvfp4 import bf16_to_f32, f32_to_bf16

from emulated_kernels import EmuError
from fake_driver import OK, FakeDriver, install


def write_fake_manifest(spec, out_dir: Path, arch_name: str = "sm_90a") -> Path:
    """manifest.json of codegen's real plan (nothing compiled) plus empty cubin files beside it."""
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.manifest import build_manifest, write_manifest
    from thorgen.codegen.plan import plan
    from thorgen.codegen.render import render

    arch = get_arch(arch_name)
    kernels = plan(spec, arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    for k in kernels:
        (out_dir / f"{k.name}.cubin").write_bytes(b"")
    sources = {k.name: render(k, arch, spec.spec_hash) for k in kernels}  # (for each arg's access)
    write_manifest(out_dir, build_manifest(spec, arch, kernels, {}, "emulated", [], sources))
    return out_dir


__all__ = ["EmuError", "FakeDriver", "OK", "install", "write_fake_manifest", "bf16_to_f32", "f32_to_bf16"]


def open_emulated(checkpoint: Path, root: Path, **kwargs):
    """The cuda backend (runtime.cuda.backend.open_backend) of `checkpoint` on a freshly installed fake driver:
    weights repacked and a fake manifest written under `root`."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.convert.repack import repack

    weights = repack(checkpoint, root / "weights")
    kernels = write_fake_manifest(Checkpoint.open(checkpoint).spec, root / "kernels")
    install(kernels)
    return open_backend(checkpoint, weights_dir=weights, kernels_dir=kernels, **kwargs)


def decode_step(engine, position: int, greedy: bool = True, token: int | None = None, lane: int = 0) -> int:
    """One graphed one-row step of the engine, launched and then waited for: its new token."""
    return engine.steps.wait(engine.steps.launch_one(position, greedy, token, lane))[0]


def batch_step(engine, rows: list) -> list[int]:
    """One batched step of rows (lane, position, token, sampling or None), launched and then waited for."""
    return engine.steps.wait(engine.steps.launch_batch(rows))


def spec_step(engine, start: int, last: int, greedy: bool = True, lane: int = 0) -> tuple[list[int], list[int]]:
    """One DFlash step, launched and then waited for: (15 drafts, the target's 16 tokens)."""
    drafts, target, _ = engine.dflash.wait(engine.dflash.launch(start, last, greedy, lane=lane))
    return drafts, target


def run_requests(backend, ahead: bool, requests: list, speculative: bool = False, stop_ids=frozenset()):
    """Requests (prompt, max_tokens, params) one after another through the engine core on one cuda runner, its steps
    launched ahead or not (`ahead`): (tokens, accepted lengths, finish reason) of each, and the steps launched ahead
    that were used."""
    from thorgen.runtime.engine.core import EngineCore

    from thorgen.runtime.cuda.runner import CudaRunner

    runner = CudaRunner(backend.engine, launch_ahead=ahead)
    core, out = EngineCore(runner), []
    for n, (prompt, max_tokens, params) in enumerate(requests):
        core.add(str(n), prompt, max_tokens, params, stop_ids, speculative)
        toks: list[int] = []
        while core.unfinished:
            for o in core.step():
                toks += o.token_ids
                if o.finished:
                    out.append((toks, o.result.accepted_lengths, o.result.finish_reason))
    return out, runner.ahead_steps


def install_for_timing(build: Path, monkeypatch):
    """The emulated driver over `build` for the kernel benchmarks (runtime/bench/kernels.py, kernel_chain.py): 10 us
    between any two events (it times nothing), a 1 MiB copy probe and 1 MiB of rotated inputs."""
    from thorgen.runtime.bench import kernel_chain
    from thorgen.runtime.bench import kernels as kernel_bench

    driver = install(build)
    monkeypatch.setattr(driver, "cuEventElapsedTime", lambda a, b: (OK, 0.01))
    probe = kernel_bench.KernelRig.copy_bandwidth_gbps
    monkeypatch.setattr(kernel_bench.KernelRig, "copy_bandwidth_gbps", lambda rig: probe(rig, nbytes=1 << 20, iters=2))
    monkeypatch.setattr(kernel_bench, "ROTATE_BYTES", 1 << 20)
    monkeypatch.setattr(kernel_chain, "ROTATE_BYTES", 1 << 20)
    return driver
