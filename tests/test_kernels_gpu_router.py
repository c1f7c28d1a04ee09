"""GPU tests: MoE router — logits (norm, scale, bf16 projection) and softmax / top-k / renorm / per-expert scale, as
the unfused pair (router_logits + router_topk) and as router_fused (one launch, the top-k by each token's last
block), which must be bit-identical to the pair and leave its arrival counters zeroed; and the prefill chunk's
GEMM-tiled logits (router_logits_tiled, ceil(T / BT) token tiles) against the reference at ragged and full T, and bit
for bit against the <= 16-row router_logits on the same rows (the engine's scoring pass and its prefill must pick the
same experts)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
from gpu_harness import PRESETS, GpuRunner
import reference_kernels as R
from thorgen.model_spec.nvfp4 import f32_to_bf16

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("router",))


def _inputs(rng, H, E, T):
    return {
        "x": rng.normal(0, 3, (T, H)).astype(np.float32),
        "scale": f32_to_bf16(rng.normal(1, 0.2, H).astype(np.float32)),
        "proj": f32_to_bf16(rng.normal(0, 1, (E, H)).astype(np.float32)),
        "per_expert_scale": f32_to_bf16(rng.uniform(0.5, 2.0, E).astype(np.float32)),
        "T": np.int32(T),
    }


def _outputs(T, E, K):
    return {"logits": ((T, E), np.float32), "topk_idx": ((T, K), np.int32), "topk_w": ((T, K), np.float32)}


def _small_logits(runner):
    """The router_logits blocking for up to 16 rows (the fused kernel's pair)."""
    (lk,) = [k for k in runner.find("router_logits__") if k.param("mmax") == 16]
    return lk


def _logits_launch(lk, T):
    """(kernel, grid) of a router_logits launch over T rows: the tiled form needs ceil(T / BT) token tiles (its
    ROW_GRID), the grid-stride one any extent (3 here, so blocks loop over several rows)."""
    if lk.name.startswith("router_logits_tiled__"):
        return lk, (lk.grid[0], -(-T // lk.param("BT")), 1)
    return lk, (lk.grid[0], min(T, 3), 1)


def _check_topk_clear_margin(logits, ref_logits, per_expert_scale, K):
    """The top-k of the kernel's logits equals the float64 reference's where its k-th / (k+1)-th margin is clear of
    the logits' error."""
    idx, _ = R.router_topk_ref(logits, K, per_expert_scale)
    idx64, _ = R.router_topk_ref(ref_logits, K, per_expert_scale)
    srt = np.sort(ref_logits, axis=-1)[:, ::-1]
    clear = (srt[:, K - 1] - srt[:, K]) > 1e-3 * np.abs(srt[:, 0])
    np.testing.assert_array_equal(idx[clear], idx64[clear])


@pytest.mark.parametrize("T", [1, 7, 40])
@pytest.mark.parametrize("blocking", ["small", "prefill"])
def test_router(runner, T, blocking):
    """Each router_logits blocking (2 experts a block up to 16 rows; the tiled prefill form) + top-k."""
    rng = np.random.default_rng(21 + T)
    (lk,) = [_small_logits(runner)] if blocking == "small" else runner.find("router_logits_tiled__")
    (tk,) = runner.find("router_topk__")
    H, E, K = lk.param("H"), lk.param("E"), tk.param("K")
    inp = _inputs(rng, H, E, T)
    got = runner.run_seq([_logits_launch(lk, T), (tk, (min(T, 3), 1, 1))], inp, _outputs(T, E, K))
    ref_logits = R.router_logits_ref(inp["x"], inp["scale"], inp["proj"], lk.param("EPS"))
    assert R.norm_err(got["logits"], ref_logits) <= R.TOL_ROUTER_LOGITS
    # indices exact against the reference applied to the kernel's own logits (no tie can differ) ...
    idx, w = R.router_topk_ref(got["logits"], K, inp["per_expert_scale"])
    np.testing.assert_array_equal(got["topk_idx"], idx)
    assert R.norm_err(got["topk_w"], w) <= R.TOL_ROUTER_WEIGHTS
    # ... and equal to the float64 reference's when its top-k margin is clear of the logits' error
    _check_topk_clear_margin(got["logits"], ref_logits, inp["per_expert_scale"], K)


@pytest.mark.parametrize("T", [37, 300, 512])
def test_router_logits_tiled(runner, T):
    """The prefill chunk's tiled logits (a block: BT tokens x BE experts, a warp per 8 x 8, H in staged 256-column
    chunks) against the float64 reference, at ragged T (a partial last token tile) and a full chunk, and bit for bit
    against router_logits (the <= 16-row kernel) on the same rows.
    The logits buffer holds a token tile more than T rows, poisoned with NaN: every row < T must be written (and
    close), every row >= T left alone (the partial tile's padding rows are not stored)."""
    rng = np.random.default_rng(900 + T)
    (lk,) = runner.find("router_logits_tiled__")
    (tk,) = runner.find("router_topk__")
    H, E, K, BT = lk.param("H"), lk.param("E"), tk.param("K"), lk.param("BT")
    assert T <= lk.param("mmax") and lk.param("ROW_GRID") == (1, 1, BT)
    rows = -(-T // BT) * BT + BT
    inp = _inputs(rng, H, E, T) | {"logits": np.full((rows, E), np.nan, np.float32)}
    got = runner.run_seq([_logits_launch(lk, T)], inp, {"logits": ((rows, E), np.float32)})["logits"]
    assert np.isfinite(got[:T]).all(), f"rows < {T} not all written: {np.argwhere(~np.isfinite(got[:T]))[:5]}"
    assert np.isnan(got[T:]).all(), "a row >= T was written"
    ref = R.router_logits_ref(inp["x"], inp["scale"], inp["proj"], lk.param("EPS"))
    assert R.norm_err(got[:T], ref) <= R.TOL_ROUTER_LOGITS
    per_row = np.linalg.norm(got[:T] - ref, axis=1) / np.linalg.norm(ref, axis=1)
    assert per_row.max() <= 10 * R.TOL_ROUTER_LOGITS, f"row {per_row.argmax()}: rel error {per_row.max():.3g}"
    _check_topk_clear_margin(got[:T], ref, inp["per_expert_scale"], K)
    # bit for bit the <= 16-row router_logits (2 warps a block) on the same rows, run 16 rows at a time
    small = _small_logits(runner)
    assert (small.param("H"), small.param("E"), small.param("EPS")) == (H, E, lk.param("EPS"))
    assert small.block == (64, 1, 1), "the tiled kernel follows router_logits' 2-warp (block_sum<64>) order"
    for r0 in range(0, T, 16):
        n = min(16, T - r0)
        part = {
            "x": np.ascontiguousarray(inp["x"][r0 : r0 + n]),
            "scale": inp["scale"],
            "proj": inp["proj"],
            "T": np.int32(n),
        }
        want = runner.run_seq([(small, (small.grid[0], n, 1))], part, {"logits": ((n, E), np.float32)})["logits"]
        diff = np.argwhere(got[r0 : r0 + n].view(np.uint32) != want.view(np.uint32))
        assert not len(diff), (
            f"rows {r0}..{r0 + n}: {len(diff)} logits differ from router_logits, first (row, "
            f"expert) {diff[:3].tolist()}: {got[r0 + diff[0][0], diff[0][1]]!r} vs "
            f"{want[diff[0][0], diff[0][1]]!r}"
        )


@pytest.mark.parametrize("T,rows_per_block", [(1, 1), (7, 1), (40, 3)])
def test_router_fused_bit_identical_to_pair(runner, T, rows_per_block):
    """router_fused == router_logits + router_topk bit for bit (logits, ids, weights), with tokens looped grid-stride
    (rows_per_block > 1: one block handles several tokens), launched twice in a row (the counters must be back at
    zero after the first launch, or the second would pick a wrong last block), outputs poisoned beforehand."""
    rng = np.random.default_rng(500 + T)
    (fu,) = runner.find("router_fused__")
    lk = _small_logits(runner)
    (tk,) = runner.find("router_topk__")
    H, E, K = fu.param("H"), fu.param("E"), fu.param("K")
    assert (lk.param("H"), lk.param("E"), tk.param("K")) == (H, E, K)
    inp = _inputs(rng, H, E, T)
    if T > 1:  # an exact tie between two experts of one token: the lower id must win in both kernels
        inp["proj"][5] = inp["proj"][2]
    gy = -(-T // rows_per_block)
    pair = runner.run_seq([(lk, (lk.grid[0], gy, 1)), (tk, (gy, 1, 1))], inp, _outputs(T, E, K))
    outs = _outputs(T, E, K) | {"counters": ((T,), np.uint32)}
    poisoned = inp | {
        "logits": np.full((T, E), np.nan, np.float32),
        "topk_idx": np.full((T, K), -1, np.int32),
        "topk_w": np.full((T, K), np.nan, np.float32),
        "counters": np.zeros(T, np.uint32),
    }
    fused = runner.run_seq([(fu, (fu.grid[0], gy, 1)), (fu, (fu.grid[0], gy, 1))], poisoned, outs)
    for name in ("logits", "topk_idx", "topk_w"):
        np.testing.assert_array_equal(fused[name].view(np.uint32), pair[name].view(np.uint32), err_msg=name)
    np.testing.assert_array_equal(fused["counters"], 0)
    idx, _ = R.router_topk_ref(fused["logits"], K, inp["per_expert_scale"])
    np.testing.assert_array_equal(fused["topk_idx"], idx)
