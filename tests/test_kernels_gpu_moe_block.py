"""GPU tests: the one-token MoE block (moe_block: router logits + top-k, the selected experts' gate|up and down in
one persistent launch whose blocks wait on device counters) against router_logits + router_topk bit for bit and the
NumPy MoE reference, launched twice in a row (its counters must be left zeroed) on poisoned outputs, on the planned
grid and on fewer blocks (they loop over the work), tiny preset (real quantize + pack path) and full size (all 128
experts resident)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as MR  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402
from test_kernels_gpu_moe import Experts  # noqa: E402
from thorgen.model_spec.nvfp4 import f32_to_bf16  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("moe", "router"))


# (seed, grid): the planned grid (a block a work item), and fewer blocks than items (what a smaller GPU gets: its
# blocks loop over router, gate|up and down items)
@pytest.mark.parametrize("seed,blocks", [(0, None), (1, None), (2, 40)])
def test_moe_block_equals_router_pair_and_reference(runner, seed, blocks):
    (blk,) = runner.find("moe_block__")
    (lk,) = [k for k in runner.find("router_logits__") if k.param("mmax") == 16]
    (tk,) = runner.find("router_topk__")
    H, E, K, IE = blk.param("H"), blk.param("E"), blk.param("K"), blk.param("IE")
    experts = Experts(np.random.default_rng(31), runner.spec, blk.param("fp4_order"))
    rng = np.random.default_rng(40 + seed)
    inp = {"x": rng.normal(0, 3, (1, H)).astype(np.float32),
           "scale": f32_to_bf16(rng.normal(1, 0.2, H).astype(np.float32)),
           "proj": f32_to_bf16(rng.normal(0, 1, (E, H)).astype(np.float32)),
           "per_expert_scale": f32_to_bf16(rng.uniform(0.5, 2.0, E).astype(np.float32)), "T": np.int32(1),
           "xe": MR.act_f16(rng, 1, H), "gu_w": experts.gu_w, "gu_s": experts.gu_s, "gu_gscale": experts.gu_g,
           "dn_w": experts.dn_w, "dn_s": experts.dn_s, "dn_gscale": experts.dn_g}
    routing = {"logits": ((1, E), np.float32), "topk_idx": ((1, K), np.int32), "topk_w": ((1, K), np.float32)}
    pair = runner.run_seq([(lk, (lk.grid[0], 1, 1)), (tk, (1, 1, 1))], inp, routing)
    outs = routing | {"act": ((K, IE), np.float16), "ypair": ((K, H), np.float32),
                      "sync": ((blk.param("sync_words"),), np.uint32)}
    poisoned = inp | {"logits": np.full((1, E), np.nan, np.float32), "topk_idx": np.full((1, K), -1, np.int32),
                      "topk_w": np.full((1, K), np.nan, np.float32), "act": np.full((K, IE), np.nan, np.float16),
                      "ypair": np.full((K, H), np.nan, np.float32), "sync": np.zeros(blk.param("sync_words"), np.uint32)}
    grid = None if blocks is None else (blocks, 1, 1)
    got = runner.run_seq([(blk, grid), (blk, grid)], poisoned, outs)
    for name in routing:  # the router blocks run router_fused's arithmetic
        np.testing.assert_array_equal(got[name].view(np.uint32), pair[name].view(np.uint32), err_msg=name)
    np.testing.assert_array_equal(got["sync"], 0)  # left zeroed: the second launch saw zeroed counters too
    ids, wts = got["topk_idx"], got["topk_w"]
    gates, ups, downs = experts.lists(ids)
    err = MR.norm_err(got["act"], MR.moe_gateup_ref(inp["xe"], ids, gates, ups))
    assert err <= MR.TOL_MOE_ACT, f"{blk.name}: act error {err:.2e}"
    y = got["ypair"].sum(axis=0, dtype=np.float32)[None]  # ffn_tail's PAIRS form: the slot rows in slot order
    err = MR.norm_err(y, MR.moe_down_ref(got["act"], ids, wts, downs))
    assert err <= MR.TOL_MOE_OUT, f"{blk.name}: output error {err:.2e}"
    again = runner.run_seq([(blk, grid)], poisoned, outs)
    for name in ("act", "ypair"):  # deterministic: no atomics in the arithmetic
        np.testing.assert_array_equal(again[name].view(np.uint16 if name == "act" else np.uint32),
                                      got[name].view(np.uint16 if name == "act" else np.uint32), err_msg=name)
