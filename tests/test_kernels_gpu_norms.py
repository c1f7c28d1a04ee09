"""GPU tests: embedding, DFlash block embedding and acceptance, and the RMSNorm family against the NumPy references."""

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
T = 5
GRIDS = [None, (3, 1, 1)]  # the planned grid, and fewer blocks than rows (grid-stride loop)


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("embedding", "norms", "drafter_glue"))


def bf16(rng, shape, mean=0.0, std=1.0):
    return f32_to_bf16(rng.normal(mean, std, shape).astype(np.float32))


def sparse_table(rng, V: int, H: int, rows) -> np.ndarray:
    """A bf16 [V, H] table that is random on `rows` and zero elsewhere (the full-size table is 1.5 GB)."""
    table = np.zeros((V, H), np.uint16)
    rows = np.unique(np.asarray(rows))
    table[rows] = bf16(rng, (len(rows), H))
    return table


@pytest.mark.parametrize("grid", GRIDS)
def test_embedding(runner, grid):
    rng = np.random.default_rng(1)
    (k,) = runner.find("embed__")
    V, H = k.param("V"), k.param("H")
    ids = rng.integers(0, V, T).astype(np.int32)
    ids[2] = V + 7
    table = sparse_table(rng, V, H, ids[ids < V])  # out of range: a NaN row, never a wild read
    out = runner.run(k, {"ids": ids, "table": table, "T": np.int32(T)}, {"out": ((T, H), np.float32)}, grid)["out"]
    ok = np.arange(T) != 2
    ref = R.embed_ref(np.where(ok, ids, 0), table, k.param("SCALE"))
    np.testing.assert_array_equal(out[ok], ref[ok])  # TOL_EMBED = 0: one float32 product
    assert np.isnan(out[2]).all()


def test_dflash_block_embed(runner):
    rng = np.random.default_rng(2)
    (k,) = runner.find("dflash_block_embed__")
    V, H, B = k.param("V"), k.param("H"), k.grid[0]
    last = np.array([int(rng.integers(0, V))], np.int32)
    table = sparse_table(rng, V, H, [last[0], k.param("MASK_ID")])
    out = runner.run(k, {"ids": last, "table": table, "T": np.int32(B)}, {"out": ((B, H), np.float32)})["out"]
    np.testing.assert_array_equal(out, R.embed_ref(np.repeat(last, B), table, k.param("SCALE"), k.param("MASK_ID")))


@pytest.mark.parametrize("grid", GRIDS)
def test_rmsnorm(runner, grid):
    rng = np.random.default_rng(3)
    for k in runner.find("rmsnorm__"):
        H, out_t = k.param("H"), k.param("OUT")
        x = (rng.normal(0, 3, (T, H))).astype(np.float32)
        w = bf16(rng, H, 1.0, 0.3)
        y = runner.run(k, {"x": x, "w": w, "T": np.int32(T)}, {"y": ((T, H), R.np_dtype(out_t))}, grid)["y"]
        assert R.norm_err(R.load(y, out_t), R.rmsnorm_ref(x, w, k.param("EPS"))) <= R.TOL[out_t], k.name


@pytest.mark.parametrize("grid", GRIDS)
def test_add_rmsnorm(runner, grid):
    rng = np.random.default_rng(4)
    for k in runner.find("add_rmsnorm__"):
        H, out_t = k.param("H"), k.param("OUT")
        x, y = rng.normal(0, 2, (T, H)).astype(np.float32), rng.normal(0, 1, (T, H)).astype(np.float32)
        w = bf16(rng, H, 1.0, 0.3)
        got = runner.run(
            k,
            {"x": x, "y": y, "w": w, "T": np.int32(T)},
            {"x": ((T, H), np.float32), "a": ((T, H), R.np_dtype(out_t))},
            grid,
        )
        xr, ar = R.add_rmsnorm_ref(x, y, w, k.param("EPS"))
        assert R.norm_err(got["x"], xr) <= R.TOL["f32"]
        assert R.norm_err(R.load(got["a"], out_t), ar) <= R.TOL[out_t]


@pytest.mark.parametrize("grid", GRIDS)
def test_attn_tail(runner, grid):
    rng = np.random.default_rng(5)
    (k,) = runner.find("attn_tail__")
    H, out_t = k.param("H"), k.param("OUT")
    o, x = rng.normal(0, 5, (T, H)).astype(np.float32), rng.normal(0, 2, (T, H)).astype(np.float32)
    ws = [bf16(rng, H, 1.0, 0.3) for _ in range(3)]
    got = runner.run(
        k,
        {"o": o, "x": x, "w_post": ws[0], "w_pre1": ws[1], "w_pre2": ws[2], "T": np.int32(T)},
        {"x": ((T, H), np.float32), "a1": ((T, H), R.np_dtype(out_t)), "a2": ((T, H), R.np_dtype(out_t))},
        grid,
    )
    xr, a1, a2 = R.attn_tail_ref(o, x, *ws, k.param("EPS"))
    assert R.norm_err(got["x"], xr) <= R.TOL["f32"]
    assert R.norm_err(R.load(got["a1"], out_t), a1) <= R.TOL[out_t]
    assert R.norm_err(R.load(got["a2"], out_t), a2) <= R.TOL[out_t]


@pytest.mark.parametrize("last_layer", [False, True])
@pytest.mark.parametrize("pairs", [False, True], ids=["moe_rows", "slot_rows"])
def test_ffn_tail(runner, last_layer, pairs):
    """Both forms: moe [T, H] (one-row steps), and the MoE's slot rows [T*K, H] summed over each row's valid slots
    in slot order (the form steps of more rows use; ids out of range, as a corrupt router would give, skipped)."""
    rng = np.random.default_rng(6)
    (k,) = [k for k in runner.find("ffn_tail__") if bool(k.param("PAIRS")) == pairs]
    H, out_t, tap_t = k.param("H"), k.param("OUT"), k.param("TAP")
    mlp = rng.normal(0, 4, (T, H)).astype(np.float32)
    x = rng.normal(0, 2, (T, H)).astype(np.float32)
    w1, w2, w, w_next = (bf16(rng, H, 1.0, 0.3) for _ in range(4))
    ls = f32_to_bf16(np.array([0.7], np.float32))
    taps, col = 3, 1  # write this layer's tap into column block 1 of a [T, 3H] buffer
    inputs = {
        "mlp": mlp,
        "x": x,
        "w1": w1,
        "w2": w2,
        "w": w,
        "layer_scalar": ls,
        "tap_stride": np.int32(taps * H),
        "tap_col": np.int32(col * H),
        "T": np.int32(T),
    }
    if pairs:
        K, E = k.param("PAIRS"), k.param("EXPERTS")
        ids = rng.integers(0, E, (T, K)).astype(np.int32)
        ids[0, 1], ids[-1, -1] = -1, E + 3
        ypair = rng.normal(0, 0.5, (T * K, H)).astype(np.float32)
        ypair.reshape(T, K, H)[(ids < 0) | (ids >= E)] = np.nan  # rows no down kernel writes: never read
        moe = np.zeros((T, H), np.float32)
        for slot in range(K):  # the kernel's own order: from 0, slot by slot, in f32
            ok = (ids[:, slot] >= 0) & (ids[:, slot] < E)
            moe[ok] += ypair.reshape(T, K, H)[ok, slot]
        inputs |= {"moe": ypair, "ids": ids}
    else:
        moe = rng.normal(0, 1, (T, H)).astype(np.float32)
        inputs["moe"] = moe
    outputs = {"x": ((T, H), np.float32), "tap": ((T, taps * H), R.np_dtype(tap_t))}
    if not last_layer:
        inputs["w_next"] = w_next
        outputs["a"] = ((T, H), R.np_dtype(out_t))
    got = runner.run(k, inputs, outputs, (3, 1, 1))
    xr, ar = R.ffn_tail_ref(mlp, moe, x, w1, w2, w, ls, None if last_layer else w_next, k.param("EPS"))
    assert R.norm_err(got["x"], xr) <= R.TOL["f32"]
    tap = R.load(got["tap"], tap_t).reshape(T, taps, H)
    assert R.norm_err(tap[:, col], xr) <= R.TOL[tap_t]
    assert not tap[:, [0, 2]].any()  # other tap columns untouched
    if not last_layer:
        assert R.norm_err(R.load(got["a"], out_t), ar) <= R.TOL[out_t]
    if pairs:  # the one-row form given the slot sum (moe_down's: from 0, in slot order, in f32): the same bits
        (one,) = [k1 for k1 in runner.find("ffn_tail__") if not k1.param("PAIRS")]
        single = runner.run(one, dict(inputs, moe=moe), outputs, (3, 1, 1))
        for name in outputs:
            np.testing.assert_array_equal(
                single[name].view(np.uint8),
                got[name].view(np.uint8),
                err_msg=f"{name}: the one-row and slot-row forms differ",
            )


@pytest.mark.parametrize(
    "most, emulate, agree", [(16, -1, 0), (16, -1, 7), (16, -1, 15), (6, -1, 15), (16, 6, 0), (4, 15, 0), (16, 15, 3)]
)
def test_dflash_accept(runner, most, emulate, agree):
    """The acceptance on the device (exact): the first `agree` drafts equal the targets, then one differs."""
    rng = np.random.default_rng(agree + 16 * most)
    (k,) = runner.find("dflash_accept__")
    B = k.param("B")
    targets = rng.integers(0, 1000, B).astype(np.int32)
    ids = np.concatenate([[5], targets[: B - 1]]).astype(np.int32)
    if agree < B - 1:
        ids[1 + agree] = targets[agree] + 1
    start, sampled = 700, np.full(B, -9, np.int32)
    out = runner.run(
        k,
        {
            "ids": ids,
            "out_ids": targets,
            "positions": np.full(B, start, np.int32),
            "sampled": sampled,
            "rule": np.array([most, emulate], np.int32),
        },
        {
            "ids": ((B,), np.int32),
            "positions": ((B,), np.int32),
            "sampled": ((B,), np.int32),
            "accepted": ((1,), np.int32),
        },
    )
    n, pos, smp, last = R.spec_accept_ref(ids, targets, start, most, emulate)
    assert n == (min(most, agree + 1) if emulate < 0 else min(most, emulate + 1))
    assert int(out["accepted"][0]) == n and out["ids"][0] == last and (out["ids"][1:] == ids[1:]).all()
    np.testing.assert_array_equal(out["positions"], pos)
    np.testing.assert_array_equal(out["sampled"], smp)
