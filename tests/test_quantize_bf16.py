"""runtime/convert/quantize.py's row-block bf16 -> NVFP4 quantizer against a float64 reference of the NVFP4 rules.

The reference follows the rules stated in model_spec/nvfp4.py (compressed-tensors' arithmetic): global scale
2688/amax as float32(2688) * float32(1/amax) (1.0 when that is not finite); block scale e4m3(float32(block amax / 6)
* global), an e4m3 zero replaced by 0.125; codes = e2m1 round-to-nearest-even of float32(w / float32(e4m3 /
global)) clamped to +-6, the sign bit set for every negative quotient; element 2k in the low nibble. Each float32
operation is done in float64 and rounded to float32 once (exact for one +, -, *, / of float32 operands), and every
rounding to a format is a nearest search over that format's enumerated values with its tie rule, not bit tricks.
"""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec.nvfp4 import bf16_to_f32, block_scales, f32_to_bf16, quantize_nvfp4
from thorgen.runtime.convert import quantize as Q
from thorgen.runtime.convert.linears import quantize_linear

F32, F64 = np.float32, np.float64
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e4m3_grid() -> np.ndarray:
    """The finite non-negative e4m3fn values in code order (code = index): subnormals m/8 * 2^-6, then
    (1 + m/8) * 2^(e - 7) for e = 1..15, without S.1111.111 (NaN)."""
    vals = [m / 8 * 2.0**-6 for m in range(8)]
    vals += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return np.array(vals[:0x7F])


E4M3_GRID = _e4m3_grid()


def _nearest_even(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest to each |x| <= grid[-1]; a tie goes to the even index (even mantissa)."""
    d = np.abs(x[..., None] - grid)
    best = d.min(axis=-1, keepdims=True)
    hits = d == best
    idx = np.argmax(hits, axis=-1)
    two = hits.sum(axis=-1) > 1
    return np.where(two & (idx % 2 == 1), idx + 1, idx)


def _f32(x) -> np.ndarray:
    return np.asarray(x, F64).astype(F32).astype(F64)


def reference(w_bits: np.ndarray, global_scale: float | None = None) -> tuple[np.ndarray, np.ndarray, float, dict]:
    w = bf16_to_f32(w_bits).astype(F64)
    n, k = w.shape
    amax = float(np.abs(w).max())
    if global_scale is None:  # an amax of 0 overflows float32: compressed-tensors then uses 1.0
        with np.errstate(over="ignore"):
            g = float(_f32(2688.0 * float(_f32(1.0 / max(amax, float(np.finfo(F32).tiny))))))
        g = g if np.isfinite(g) else 1.0
    else:
        g = float(F32(global_scale))
    block_amax = np.abs(w.reshape(n, k // 16, 16)).max(axis=2)
    s = _f32(_f32(block_amax / 6.0) * g)
    scale = _nearest_even(np.minimum(s, 448.0), E4M3_GRID).astype(np.uint8)
    scale[scale == 0] = np.searchsorted(E4M3_GRID, 0.125)
    eff = _f32(E4M3_GRID[scale] / g)
    v = _f32(w.reshape(n, k // 16, 16) / eff[:, :, None]).reshape(n, k)
    mag = np.empty((n, k), np.int64)
    for r in range(0, n, 64):  # the nearest search holds 8 candidates per value
        mag[r : r + 64] = _nearest_even(np.minimum(np.abs(v[r : r + 64]), 6.0), E2M1_GRID)
    codes = (mag | np.where(v < 0, 8, 0)).astype(np.uint8)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    deq = _f32(np.where(codes >= 8, -1.0, 1.0) * E2M1_GRID[mag] * np.repeat(eff, 16, axis=1))
    diff = _f32(deq - w)
    error = {
        "max_rel": float(np.abs(diff).max()) / amax if amax else 0.0,
        "rms_rel": float(np.sqrt((diff * diff).sum()) / np.sqrt((w * w).sum())) if amax else 0.0,
    }
    return packed, scale, g, error


def _bf16(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16(np.asarray(x, F32))


def hard_matrix(n: int, k: int, seed: int) -> np.ndarray:
    """Random bf16 weights with what breaks quantizers: outliers, exact zeros and -0.0, an all-zero row and block,
    huge and tiny values (blocks whose e4m3 scale is subnormal or rounds to zero), tiny negatives rounding to -0."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k), dtype=F32) * F32(0.02)
    w[rng.random((n, k)) < 1e-4] *= F32(300.0)  # outliers
    w[rng.random((n, k)) < 0.01] = 0.0
    w[rng.random((n, k)) < 0.01] = -0.0
    w[5] = 0.0  # an all-zero row
    w[6, 32:48] = 0.0  # an all-zero block
    w[7] *= F32(1e-2)  # a small row: its block scales are e4m3 subnormals
    w[8, :64] = rng.standard_normal(64).astype(F32) * F32(1e-30)  # block scales that round to an e4m3 zero
    w[9, 16:32] = -rng.random(16).astype(F32) * F32(1e-3)
    w[9, 16] = -0.5  # one large value: the rest of the block rounds to -0 (code 8)
    w[10, 100] = F32(40.0)  # the global amax: every other block is small against it
    w[11, :16] = np.array([6, 5, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -6, -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25])
    return _bf16(w)


@pytest.mark.parametrize("shape", [(1408, 2816), (2816, 2816)], ids=["expert_gate_up", "dense"])
def test_quantize_bf16_equals_float64_reference_on_full_shapes(shape):
    w = hard_matrix(*shape, seed=shape[0])
    q = Q.quantize_bf16(w, with_error=True)
    packed, scale, g, error = reference(w)
    codes = np.stack([packed & 0xF, packed >> 4])
    assert ((scale > 0) & (scale < 8)).any() and (scale[8, :4] == 0x20).all()  # e4m3 subnormals; 0 -> 0.125
    assert (codes == 8).any() and (codes == 7).any() and (codes == 15).any()  # -0 and both saturated signs
    assert q.global_scale == np.float32(g)
    np.testing.assert_array_equal(q.scale, scale)
    np.testing.assert_array_equal(q.packed, packed)
    assert q.error["max_rel"] == error["max_rel"]
    assert q.error["rms_rel"] == pytest.approx(error["rms_rel"], rel=1e-9)


def test_quantize_bf16_equals_quantize_nvfp4_and_keeps_quantize_linear_numbers():
    w = hard_matrix(704, 2816, seed=3)
    q = Q.quantize_bf16(w, with_error=True)
    packed, scale, g = quantize_nvfp4(bf16_to_f32(w))
    np.testing.assert_array_equal(q.packed, packed)
    np.testing.assert_array_equal(q.scale, scale)
    assert q.global_scale == g
    (lp, ls, mul), error = quantize_linear(w)
    np.testing.assert_array_equal(lp, packed)
    assert mul == np.float32(np.float32(1) / g)
    assert error == q.error


def test_exact_ties_round_to_even_codes():
    """With a given global scale of 1, row j's block amax 6 * 2^j gives the exact scale 2^j, so w / scale is exact
    and every E2M1 midpoint is hit."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 5.5, 0.0, -0.0, -0.25, -0.75, -2.5, -5.0, -6.0])
    w = _bf16(np.stack([mids * 2.0**j for j in range(-8, 8)]))
    q = Q.quantize_bf16(w, global_scale=1.0)
    packed, scale, _, _ = reference(w, global_scale=1.0)
    np.testing.assert_array_equal(q.packed, packed)
    np.testing.assert_array_equal(q.scale, scale)
    # codes 0 2 2 4 4 6 6 7 | 7 0 0 8 10 12 14 15: 0.25, 1.25, 2.5 and 5 round down, 0.75, 1.75, 3.5 up, -0.25 to -0
    np.testing.assert_array_equal(q.packed, np.tile([0x20, 0x42, 0x64, 0x76, 0x07, 0x80, 0xCA, 0xFE], (16, 1)))


def test_row_blocks_and_strided_input_do_not_change_the_result(monkeypatch):
    w = hard_matrix(200, 512, seed=4)
    whole = Q.quantize_bf16(w[:, 128:384], with_error=True)  # a column slice, as the lm_head job passes it
    monkeypatch.setattr(Q, "BLOCK_ELEMENTS", 256 * 7)  # 7 rows a block: the last block is a partial one
    pieces = Q.quantize_bf16(np.ascontiguousarray(w[:, 128:384]), with_error=True)
    np.testing.assert_array_equal(whole.packed, pieces.packed)
    np.testing.assert_array_equal(whole.scale, pieces.scale)
    assert whole.error["max_rel"] == pieces.error["max_rel"]
    assert whole.error["rms_rel"] == pytest.approx(pieces.error["rms_rel"], rel=1e-12)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_weights_are_refused(bad):
    w = hard_matrix(16, 128, seed=5)
    w[3, 7] = _bf16(np.array([bad]))[0]
    with pytest.raises(ValueError, match="NaN or inf"):
        Q.quantize_bf16(w)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        Q.quantize_bf16(np.zeros((4, 24), np.uint16))
    with pytest.raises(ValueError, match="uint16"):
        Q.quantize_bf16(np.zeros((4, 32), np.float32))


def test_all_zero_matrix_has_zero_error_and_the_zero_block_scale():
    q = Q.quantize_bf16(np.zeros((16, 64), np.uint16), with_error=True)
    assert q.error == {"max_rel": 0.0, "rms_rel": 0.0}
    assert not q.packed.any()
    packed, scale, g, _ = reference(np.zeros((16, 64), np.uint16))
    np.testing.assert_array_equal(q.scale, scale)
    assert q.global_scale == np.float32(g)


@pytest.mark.parametrize("global_scale", [1.0, 6.0, 2688.0 / 0.37])
def test_block_scale_codes_equal_block_scales_over_the_float32_range(global_scale):
    """Every 4999th float32 bit pattern (zero, subnormals, each e4m3 binade and its midpoints, far past 448) and
    every e4m3 value and midpoint, times 6 / global, as a block amax: the same e4m3 byte as model_spec/nvfp4.py
    block_scales (f32_to_e4m3) gives."""
    g = np.float32(global_scale)
    grid = np.concatenate([E4M3_GRID, (E4M3_GRID[1:] + E4M3_GRID[:-1]) / 2])
    amax = np.concatenate([np.arange(0, 0x7F800000, 4999, dtype=np.uint32).view(F32), _f32(grid * 6 / g)])
    amax = amax.astype(F32)
    with np.errstate(over="ignore"):  # amax / 6 * global past float32's range: both saturate
        want = block_scales(np.repeat(amax, 16).reshape(-1, 16), g)[:, 0]
        got = Q.block_scale_codes(amax, g)
    np.testing.assert_array_equal(got, want)


def test_a_bad_global_scale_is_refused():
    with pytest.raises(ValueError, match="global scale"):
        Q.quantize_bf16(hard_matrix(16, 128, seed=6), global_scale=0.0)
