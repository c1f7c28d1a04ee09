"""Shared pytest fixtures: one synthetic tiny checkpoint per session, and the ../shared facts folder."""

from __future__ import annotations

import os
from pathlib import Path

# The CPU tests multiply small matrices: OpenBLAS worker threads only spin against each other (and against
# parallel jobs) on the 2-core runners, e.g. 8.7 s instead of 1.4 s for a 32-token speculative run. This must
# be set before numpy is first imported; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a synthetic `tiny` checkpoint (target + dflash/ drafter + tokenizer), seed 0, built once."""
    from thorgen.model_spec.synth import write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("tiny_ckpt")
    write_synthetic_checkpoint("tiny", out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint: Path):
    """The tiny checkpoint opened (a `thorgen.model_spec.checkpoint.Checkpoint`), shared read-only."""
    from thorgen.model_spec.checkpoint import Checkpoint

    return Checkpoint.open(tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_format_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny model (seed 0, as tiny_checkpoint) in the other formats: {"bf16", "modelopt" (experts-only),
    "modelopt-all-linear"} -> folder, built once."""
    from thorgen.model_spec.synth import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("tiny_formats")
    return {
        fmt: write_synthetic_checkpoint("tiny", root / fmt, seed=0, progress=False, source_format=fmt)
        for fmt in ("bf16", "modelopt", "modelopt-all-linear")
    }


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """`<repo>/../shared` (facts, seed data); tests that need it skip when it is absent."""
    path = REPO.parent / "shared"
    if not path.is_dir():
        pytest.skip(f"{path} not present")
    return path


@pytest.fixture(scope="module")
def device():
    """The GPU (module-scoped); skips without a GPU, a driver or cuda-python."""
    from thorgen.runtime.backend import BackendError
    from thorgen.runtime.cuda.device import Device

    try:
        return Device.open(0)
    except BackendError as exc:
        pytest.skip(f"no GPU: {exc}")


@pytest.fixture(scope="module")
def built(device, tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, kernels dir): weights repacked for this GPU's arch, kernels built with codegen (or taken
    prebuilt from $THORGEN_KERNELS, e.g. `thorgen build --preset tiny --arch sm_90a` run where nvcc is)."""
    import os

    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.convert.repack import repack

    repack(tiny_checkpoint, arch=device.info.arch)
    pre = os.environ.get("THORGEN_KERNELS")
    if pre and (Path(pre) / "manifest.json").is_file():
        return tiny_checkpoint, Path(pre)
    try:
        from thorgen.codegen.arch import get_arch
        from thorgen.codegen.builder import build
        from thorgen.codegen.nvcc import find_nvcc

        find_nvcc()
    except Exception as exc:  # tests may use codegen; the runtime itself never does
        pytest.skip(f"no nvcc / codegen: {exc}")
    spec = Checkpoint.open(tiny_checkpoint).spec
    kernels = tmp_path_factory.mktemp("kernels")
    build(spec, get_arch(device.info.arch), kernels)
    return tiny_checkpoint, kernels


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny CPU matmuls in the torch oracles: worker threads only contend on the 2-core runners."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
