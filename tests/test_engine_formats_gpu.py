"""GPU test of the other checkpoint formats: the tiny model as Google's bf16 checkpoint, NVIDIA's ModelOpt
experts-only one and ModelOpt all-linear, each repacked for this GPU, its kernels built for its own linear formats
(or taken from $THORGEN_KERNELS_<FORMAT>, e.g. `thorgen build --model <checkpoint> --arch sm_90a`), and run by the
cuda backend against ReferenceBackend(numerics="w4a16") with bf16 KV: logits within the engine's tolerance and the
same greedy tokens (a reference tie aside, as tests/test_runtime_gpu.py allows) for a short and a 40-token prompt.

Run on the GPU: `python -m pytest -m gpu -q -rA tests/test_engine_formats_gpu.py`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_runtime_gpu import LOGITS_TOL, _rel_l2, _same_tokens  # noqa: E402

from thorgen.runtime.backend import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = 32
CTX = 1024
FORMATS = ("bf16", "modelopt", "modelopt-all-linear")


def _kernels(spec, arch: str, fmt: str, root: Path) -> Path:
    pre = os.environ.get("THORGEN_KERNELS_" + fmt.upper().replace("-", "_"))
    if pre and (Path(pre) / "manifest.json").is_file():
        return Path(pre)
    try:
        from thorgen.codegen.arch import get_arch
        from thorgen.codegen.builder import build
        from thorgen.codegen.nvcc import find_nvcc

        find_nvcc()
    except Exception as exc:  # tests may use codegen; the runtime itself never does
        pytest.skip(f"no nvcc / codegen: {exc}")
    build(spec, get_arch(arch), root / "kernels")
    return root / "kernels"


@pytest.fixture(scope="module", params=FORMATS)
def pair(request, device, tiny_format_checkpoints, tmp_path_factory):
    """(format, cuda backend, w4a16 reference backend) of one checkpoint format, bf16 KV."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.backend import ReferenceBackend

    fmt = request.param
    path = tiny_format_checkpoints[fmt]
    ck = Checkpoint.open(path)
    root = tmp_path_factory.mktemp(f"formats-gpu-{fmt}")
    weights = repack(path, root / "weights", arch=device.info.arch)
    kernels = _kernels(ck.spec, device.info.arch, fmt, root)
    cuda = open_backend(path, ctx=CTX, kv_dtype="bf16", weights_dir=weights, kernels_dir=kernels)
    ref = ReferenceBackend(ck, max_context=CTX, prefix_cache=False, numerics="w4a16", kv_dtype="bf16", kernels=kernels)
    yield fmt, cuda, ref
    cuda.close()


def test_format_runs_as_the_w4a16_reference_on_the_gpu(pair):
    from thorgen.runtime.reference.ops import softcap

    fmt, cuda, ref = pair
    m, cap = ref.target, ref.spec.target.final_logit_softcapping
    rng = np.random.default_rng(5)
    for n in (10, 40):
        ids = [2] + rng.integers(256, 512, n - 1).tolist()
        cuda.engine.prefill(ids)
        got = softcap(cuda.engine.logits(), cap)
        err = _rel_l2(got, m.forward(ids, m.new_cache(), last_only=True).logits[-1])
        print(f"{fmt}, {n} tokens: logits rel L2 vs the w4a16 reference {err:.3g}")
        assert err <= LOGITS_TOL["bf16"], f"{fmt} {n} tokens: logits rel L2 {err:.3g}"
        toks = cuda.generate(ids, GEN, SamplingParams()).token_ids
        want = ref.generate(ids, GEN, SamplingParams()).token_ids
        _same_tokens(ref, ids, toks, want, f"{fmt}, {n}-token prompt")
