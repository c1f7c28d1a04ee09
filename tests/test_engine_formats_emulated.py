"""CPU proof that the mixed-precision step programs are the w4a16 reference's arithmetic: the tiny model as a bf16
checkpoint (every target linear bf16 -> the fp16-weight kernels), a ModelOpt experts-only one (bf16 attention and
dense MLP next to NVFP4 experts) and a ModelOpt all-linear one (all NVFP4, ModelOpt multipliers) is repacked, planned
for its own linear formats, and run by the real engine on the emulated GPU (tests/engine_emulator.py) against
ReferenceBackend(numerics="w4a16"): the same greedy tokens and logits within LOGITS_TOL, through the 16-row
kernels (a 10-token prompt), the prefill kernels and grouped MoE (a 40-token prompt) and the one-row decode
kernels with their folds (the generated tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import SamplingParams  # noqa: E402

GEN = 24
LOGITS_TOL = 1e-5  # (as tests/test_reference_w4a16.py: room for another BLAS summation order only)
FORMATS = {
    "bf16": ("bf16", "bf16", "bf16"),
    "modelopt": ("bf16", "bf16", "nvfp4"),
    "modelopt-all-linear": ("nvfp4", "nvfp4", "nvfp4"),
}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def pair(request, tiny_format_checkpoints, tmp_path_factory):
    """(emulated CUDA backend, w4a16 reference backend) of one checkpoint format, bf16 KV."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.backend import ReferenceBackend

    path = tiny_format_checkpoints[request.param]
    ck = Checkpoint.open(path)
    f = ck.spec.linear_formats
    assert (f.attention, f.dense_mlp, f.experts) == FORMATS[request.param]
    root = tmp_path_factory.mktemp(f"formats-{request.param}")
    weights = repack(path, root / "weights")
    kernels = EE.write_fake_manifest(ck.spec, root / "kernels")
    drv = EE.install(kernels)
    cuda = open_backend(path, ctx=1024, kv_dtype="bf16", weights_dir=weights, kernels_dir=kernels)
    ref = ReferenceBackend(ck, max_context=1024, prefix_cache=False, numerics="w4a16", kv_dtype="bf16", kernels=kernels)
    yield request.param, cuda, ref, drv
    dev.set_driver(drv)
    cuda.close()
    dev.set_driver(None)


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_mixed_precision_programs_follow_the_w4a16_reference(pair):
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.reference.ops import softcap

    fmt, cuda, ref, drv = pair
    dev.set_driver(drv)
    launched = set()
    drv.emu.after = lambda name, entry, a: launched.add(name)
    m, cap = ref.target, ref.spec.target.final_logit_softcapping
    rng = np.random.default_rng(5)
    for n in (10, 40):
        ids = [2] + rng.integers(256, 512, n - 1).tolist()
        cuda.engine.prefill(ids)
        got = softcap(cuda.engine.logits(), cap)
        want = m.forward(ids, m.new_cache(), last_only=True).logits[-1]
        assert _rel_l2(got, want) <= LOGITS_TOL, f"{fmt} {n} tokens: logits rel L2 {_rel_l2(got, want):.3g}"
        toks = cuda.generate(ids, GEN, SamplingParams()).token_ids
        want_toks = ref.generate(ids, GEN, SamplingParams()).token_ids
        assert len(want_toks) == GEN and toks == want_toks, f"{fmt} {n} tokens: {toks} != {want_toks}"
    drv.emu.after = None
    half = {k for k in launched if k.startswith("half_") or k.endswith("_half") or "_half_" in k}
    f = cuda.spec.linear_formats
    # the kernels of each role follow its format: fp16-weight ones exactly where the checkpoint is bf16
    assert any(k.startswith("half_gemv__") and "_rope__" in k for k in half) == (f.attention == "bf16")
    assert any(k.startswith("half_gemmL__") for k in half) == (f.attention == "bf16")
    assert any(k.startswith("moe_") for k in half) == (f.experts == "bf16")
    assert (
        any(k.startswith("moe_grouped_gateup__") for k in launched)
        and any(k.startswith("moe_gateup__m16_") for k in launched)
        and any(k.startswith("moe_gateup__m1_") for k in launched)
    )
