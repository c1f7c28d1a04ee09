"""Tests for runtime/convert/layouts.py: round trips and a NumPy emulation of how the GPU kernels read the layouts."""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec.nvfp4 import E2M1_VALUES, dequantize_nvfp4, e4m3_to_f32, quantize_nvfp4
from thorgen.model_spec.weight_layout import FP4_ORDERS, SHIFT_DECODE_FACTOR
from thorgen.runtime.convert import layouts as L


def _random_nvfp4(rng: np.random.Generator, n: int, k: int):
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 1.0, size=(n, 1)).astype(np.float32)
    return quantize_nvfp4(w)


@pytest.mark.parametrize("order", FP4_ORDERS)
@pytest.mark.parametrize("n,k", [(16, 64), (48, 192), (32, 704)])
def test_nvfp4_round_trip(order: str, n: int, k: int) -> None:
    rng = np.random.default_rng(n * 1000 + k)
    packed, scale, _ = _random_nvfp4(rng, n, k)
    w, s = L.pack_nvfp4(packed, scale, order)
    assert w.shape == (n * k // 2,) and s.shape == (n * k // 16,)
    p2, s2 = L.unpack_nvfp4(w, s, n, k, order)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(s2, scale)


def test_nat_lane_bytes_are_checkpoint_bytes() -> None:
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(32, 64), dtype=np.uint8)  # N=32, K=128
    scale = rng.integers(0, 0x7E, size=(32, 8), dtype=np.uint8)
    w, s = L.pack_nvfp4(packed, scale, "nat")
    u, step, gid, t4 = 1, 1, 3, 2
    lane = 4 * gid + t4
    chunk = w.reshape(2, 2, 32, 16)[step, u, lane]  # step-major
    np.testing.assert_array_equal(chunk[:8], packed[16 * u + gid, 32 * step + 8 * t4 : 32 * step + 8 * t4 + 8])
    np.testing.assert_array_equal(chunk[8:], packed[16 * u + 8 + gid, 32 * step + 8 * t4 : 32 * step + 8 * t4 + 8])
    sc = s.reshape(2, 2, 32, 2)[step, u, lane]
    assert sc[0] == scale[16 * u + gid, 4 * step + t4] and sc[1] == scale[16 * u + 8 + gid, 4 * step + t4]


def _shift_decode(word: np.ndarray) -> list[np.ndarray]:
    """The sm_90 kernel's integer decode of one "shift" word into 4 half2 registers (uint32 bit patterns)."""
    v = word.astype(np.uint32)
    m = np.uint32(0x8E008E00)
    mag, sgn = np.uint32(0x0E000E00), np.uint32(0x80008000)
    return [
        v & m,
        (v << np.uint32(3)) & m,
        ((v << np.uint32(6)) & mag) | ((v << np.uint32(1)) & sgn),
        ((v << np.uint32(9)) & mag) | ((v << np.uint32(2)) & sgn),
    ]


def _half2_values(reg: np.ndarray) -> np.ndarray:
    lo = (reg & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)
    hi = (reg >> np.uint32(16)).astype(np.uint16).view(np.float16).astype(np.float64)
    return np.stack([lo, hi], axis=-1)


def test_shift_decode_is_exact_for_every_code() -> None:
    codes = np.arange(16, dtype=np.uint8)
    for r in range(4):
        # put code pair (a, b) at register r of a word, the other registers random
        rng = np.random.default_rng(r)
        for a in codes:
            group = rng.integers(0, 16, size=(16, 8)).astype(np.uint8)
            group[:, 2 * r] = a
            group[:, 2 * r + 1] = codes
            regs = _shift_decode(L._shift_words(group))
            vals = _half2_values(regs[r]) * SHIFT_DECODE_FACTOR
            np.testing.assert_array_equal(vals[:, 0], np.full(16, E2M1_VALUES[a]))
            np.testing.assert_array_equal(vals[:, 1], E2M1_VALUES[codes])


@pytest.mark.parametrize("order", FP4_ORDERS)
def test_emulated_kernel_matches_dequantized_matvec(order: str) -> None:
    """Emulate the GEMM's per-lane view (units, steps, lanes, k permutation, scales) and compare to W @ x."""
    rng = np.random.default_rng(7)
    n, k, m = 32, 192, 3
    packed, scale, g = _random_nvfp4(rng, n, k)
    x = rng.standard_normal((m, k))
    w_lay, s_lay = L.pack_nvfp4(packed, scale, order)
    inv = L.tile_gscales([(n, float(np.float32(1) / g))])
    wl = w_lay.reshape(k // 64, n // 16, 32, 16).transpose(1, 0, 2, 3)  # -> [unit, step, lane, 16]
    sl = s_lay.reshape(k // 64, n // 16, 32, 2).transpose(1, 0, 2, 3)
    out = np.zeros((m, n))
    for u in range(n // 16):
        for s in range(k // 64):
            for lane in range(32):
                gid, t4 = divmod(lane, 4)
                for tile in range(2):
                    chunk = wl[u, s, lane, 8 * tile : 8 * tile + 8]
                    if order == "nat":
                        lo, hi = chunk & 0xF, chunk >> 4
                        codes = np.stack([lo, hi], axis=1).reshape(16)
                        vals = E2M1_VALUES[codes].astype(np.float64)
                    else:
                        words = chunk.view(np.uint32)
                        vals = (
                            np.concatenate(
                                [_half2_values(np.array(r)).reshape(2) for wd in words for r in _shift_decode(wd)]
                            )
                            * SHIFT_DECODE_FACTOR
                        )
                    vals = vals * e4m3_to_f32(sl[u, s, lane, tile])
                    kk = 64 * s + 16 * t4 + np.arange(16)  # e = 4j + 2h + {0,1}: the lane's 16-block in order
                    col = 16 * u + 8 * tile + gid
                    out[:, col] += x[:, kk] @ vals * inv[col // 8]
    ref = x @ dequantize_nvfp4(packed, scale, g).astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def _as_multiplier(parts):
    """(packed, scale, divisor g) -> (packed, scale, float32(1)/g), the form Checkpoint.nvfp4_parts hands out."""
    packed, scale, g = parts
    return packed, scale, np.float32(1) / np.float32(g)


def test_gate_up_interleave_and_scales() -> None:
    rng = np.random.default_rng(3)
    gate = _random_nvfp4(rng, 32, 64)
    up = _random_nvfp4(rng, 32, 64)
    w, s, inv = L.pack_nvfp4_gate_up(_as_multiplier(gate), _as_multiplier(up), "shift")
    p, sc = L.unpack_nvfp4(w, s, 64, 64, "shift")
    gp, upp = L.deinterleave8(p)
    np.testing.assert_array_equal(gp, gate[0])
    np.testing.assert_array_equal(upp, up[0])
    np.testing.assert_allclose(inv[0::2], 1.0 / gate[2], rtol=1e-7)
    np.testing.assert_allclose(inv[1::2], 1.0 / up[2], rtol=1e-7)
    assert inv[0] != inv[1]  # each part keeps its own multiplier


def test_concat_scales_follow_parts() -> None:
    rng = np.random.default_rng(4)
    parts = [_random_nvfp4(rng, 16, 64), _random_nvfp4(rng, 32, 64)]
    _, _, inv = L.pack_nvfp4_concat([_as_multiplier(p) for p in parts], "nat")
    assert inv.shape == (6,)
    np.testing.assert_allclose(inv[:2], 1.0 / parts[0][2], rtol=1e-7)
    np.testing.assert_allclose(inv[2:], 1.0 / parts[1][2], rtol=1e-7)


def test_bad_inputs_raise() -> None:
    with pytest.raises(L.LayoutError):
        L.pack_nvfp4(np.zeros((16, 16), np.uint8), np.zeros((16, 2), np.uint8), "shift")  # K=32
    with pytest.raises(L.LayoutError):
        L.pack_nvfp4(np.zeros((16, 32), np.uint8), np.zeros((16, 3), np.uint8), "shift")
    with pytest.raises(L.LayoutError):
        L.pack_nvfp4(np.zeros((16, 32), np.uint8), np.zeros((16, 4), np.uint8), "zigzag")
    with pytest.raises(L.LayoutError):
        L.tile_gscales([(16, 0.0)])
    with pytest.raises(L.LayoutError):
        L.bf16_to_f16_bits(np.array([[0x7F00]], dtype=np.uint16))  # 1.7e38


def test_half_layouts() -> None:
    rng = np.random.default_rng(5)
    f = rng.standard_normal((32, 64)).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)  # truncated bf16
    h = L.bf16_to_f16_bits(bits)
    np.testing.assert_allclose(
        h.view(np.float16).astype(np.float32), (bits.astype(np.uint32) << 16).view(np.float32), rtol=2**-11
    )
    fused = L.unpack_half(L.pack_half_gate_up(h[:16], h[16:]), 32, 64)
    np.testing.assert_array_equal(fused[:8], h[:8])
    np.testing.assert_array_equal(fused[8:16], h[16:24])
    np.testing.assert_array_equal(L.unpack_half(L.pack_half(h), 32, 64), h)
    # lane view: step 0, unit 1, lane (gid 2, t4 3) -> rows 16+2 and 24+2, inputs 48..63
    lane = L.pack_half(h).reshape(1, 2, 32, 2, 16)[0, 1, 4 * 2 + 3]
    np.testing.assert_array_equal(lane[0], h[18, 48:64])
    np.testing.assert_array_equal(lane[1], h[26, 48:64])
