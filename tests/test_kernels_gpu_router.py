"""GPU tests: MoE router logits (norm, scale, bf16 projection) and softmax / top-k / renorm / per-expert scale."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
from gpu_harness import PRESETS, GpuRunner
from thorgen.codegen import reference_kernels as R
from thorgen.model_spec.nvfp4 import f32_to_bf16

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("router",))


@pytest.mark.parametrize("T", [1, 7])
def test_router(runner, T):
    rng = np.random.default_rng(21 + T)
    (lk,) = runner.find("router_logits__")
    (tk,) = runner.find("router_topk__")
    H, E, K = lk.param("H"), lk.param("E"), tk.param("K")
    x = rng.normal(0, 3, (T, H)).astype(np.float32)
    scale = f32_to_bf16(rng.normal(1, 0.2, H).astype(np.float32))
    proj = f32_to_bf16(rng.normal(0, 1, (E, H)).astype(np.float32))
    pes = f32_to_bf16(rng.uniform(0.5, 2.0, E).astype(np.float32))
    got = runner.run_seq([(lk, (lk.grid[0], min(T, 3), 1)), (tk, (min(T, 3), 1, 1))],
                         {"x": x, "scale": scale, "proj": proj, "per_expert_scale": pes, "T": np.int32(T)},
                         {"logits": ((T, E), np.float32), "topk_idx": ((T, K), np.int32), "topk_w": ((T, K), np.float32)})
    ref_logits = R.router_logits_ref(x, scale, proj, lk.param("EPS"))
    assert R.norm_err(got["logits"], ref_logits) <= R.TOL_ROUTER_LOGITS
    # indices exact against the reference applied to the kernel's own logits (no tie can differ) ...
    idx, w = R.router_topk_ref(got["logits"], K, pes)
    np.testing.assert_array_equal(got["topk_idx"], idx)
    assert R.norm_err(got["topk_w"], w) <= R.TOL_ROUTER_WEIGHTS
    # ... and equal to the float64 reference's when its top-k margin is clear of the logits' error
    idx64, _ = R.router_topk_ref(ref_logits, K, pes)
    srt = np.sort(ref_logits, axis=-1)[:, ::-1]
    clear = (srt[:, K - 1] - srt[:, K]) > 1e-3 * np.abs(srt[:, 0])
    np.testing.assert_array_equal(got["topk_idx"][clear], idx64[clear])
