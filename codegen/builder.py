"""Codegen stage: plan -> render -> compile (parallel, cached) -> cubins + manifest.json in an output folder."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..model_spec.types import ModelSpec
from .arch import ArchSpec
from .bench_cases import write_bench_cases
from .cache import CubinCache, cache_key, headers_digest_fast
from .kernel_spec import KernelSpec
from .manifest import build_manifest, write_manifest
from .nvcc import CompileError, CompileResult, PtxasInfo, compile_cubin, find_nvcc, flags, nvcc_version, parse_ptxas
from .plan import plan
from .render import INCLUDE_DIR, render


class BuildError(RuntimeError):
    """One or more kernels failed to compile; each failure names the kernel and its kept .cu and .log."""

    def __init__(self, failures: list[CompileError]):
        super().__init__(f"{len(failures)} kernel(s) failed to compile:\n" + "\n".join(str(f) for f in failures))
        self.failures = failures


@dataclass
class BuildRow:
    kernel: str
    registers: int
    spills: int
    smem_bytes: int  # static + dynamic
    seconds: float
    cached: bool


@dataclass
class BuildReport:
    out_dir: Path
    manifest: Path
    rows: list[BuildRow]

    @property
    def compiled(self) -> int:
        return sum(not r.cached for r in self.rows)


def _write_if_changed(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def compile_sources(
    sources: dict[str, str], arch: ArchSpec, work_dir: Path, jobs: int = 0, cache: CubinCache | None = None
) -> dict[str, tuple[bytes, CompileResult]]:
    """Compile {kernel name: source} (one cubin each) through the cache; returns {name: (cubin, result)}.

    Sources are written to work_dir/<name>.cu (kept on failure beside <name>.log)."""
    import time

    nvcc = find_nvcc()
    version = nvcc_version(nvcc)
    fl = flags(arch, INCLUDE_DIR)
    headers = headers_digest_fast(INCLUDE_DIR)
    cache = cache or CubinCache()
    work_dir.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> tuple[bytes, CompileResult]:
        source = sources[name]
        key = cache_key(source, headers, version, fl, arch.name)
        cu = work_dir / f"{name}.cu"
        _write_if_changed(cu, source.encode())
        hit = cache.get(key)
        if hit is not None:
            cubin, meta = hit
            info = {k: PtxasInfo(**v) for k, v in meta.get("ptxas", {}).items()}
            return cubin, CompileResult(name, float(meta.get("seconds", 0.0)), True, info)
        tmp_cubin = work_dir / f".{name}.{os.getpid()}.cubin"
        start = time.perf_counter()
        try:
            _, log = compile_cubin(name, cu, tmp_cubin, arch, INCLUDE_DIR, nvcc)
            cubin = tmp_cubin.read_bytes()
        finally:
            tmp_cubin.unlink(missing_ok=True)
        seconds = time.perf_counter() - start
        info = parse_ptxas(log)
        cache.put(
            key,
            cubin,
            {
                "kernel": name,
                "arch": arch.name,
                "nvcc": version,
                "seconds": seconds,
                "ptxas": {k: vars(v) for k, v in info.items()},
            },
        )
        return cubin, CompileResult(name, seconds, False, info)

    results: dict[str, tuple[bytes, CompileResult]] = {}
    failures: list[CompileError] = []
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        futures = {name: pool.submit(one, name) for name in sources}
        for name, fut in futures.items():
            try:
                results[name] = fut.result()
            except CompileError as exc:
                failures.append(exc)
    if failures:
        raise BuildError(failures)
    return results


def build(
    spec: ModelSpec,
    arch: ArchSpec,
    out_dir: Path,
    jobs: int = 0,
    kernels: list[KernelSpec] | None = None,
    cache: CubinCache | None = None,
) -> BuildReport:
    """Build every kernel of the plan into out_dir (<name>.cubin, src/<name>.cu, manifest.json, bench_cases.json)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kernels = plan(spec, arch) if kernels is None else kernels
    sources = {k.name: render(k, arch, spec.spec_hash) for k in kernels}
    results = compile_sources(sources, arch, out_dir / "src", jobs, cache)
    rows, infos = [], {}
    for k in kernels:
        cubin, res = results[k.name]
        _write_if_changed(out_dir / f"{k.name}.cubin", cubin)
        info = res.info.get(k.name, PtxasInfo())
        infos[k.name] = info
        rows.append(
            BuildRow(k.name, info.registers, info.spills, info.smem_bytes + k.smem_bytes, res.seconds, res.cached)
        )
    nvcc = find_nvcc()
    manifest = build_manifest(spec, arch, kernels, infos, nvcc_version(nvcc), flags(arch, INCLUDE_DIR), sources)
    write_bench_cases(out_dir, spec, arch, kernels)
    return BuildReport(out_dir, write_manifest(out_dir, manifest), rows)
