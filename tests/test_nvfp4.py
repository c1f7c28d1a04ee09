"""Tests for model_spec/nvfp4.py against torch's fp8/bf16 casts and compressed-tensors' own NVFP4 functions."""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec import nvfp4

torch = pytest.importorskip("torch")


def _ct():
    """compressed-tensors pieces used as the oracle (skip when the package or its imports are unavailable)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    return dict(
        Compressor=NVFP4PackedCompressor,
        pack=pack_fp4_to_uint8,
        unpack=unpack_fp4_from_uint8,
        Args=QuantizationArgs,
        Scheme=QuantizationScheme,
        dequantize=_dequantize,
        qparams=calculate_qparams,
        gparam=generate_gparam,
    )


def _ct_quantize(ct, w: np.ndarray):
    """The compressed-tensors NVFP4 path: generate_gparam -> per-group calculate_qparams -> compress."""
    args = ct["Args"](
        num_bits=4,
        type="float",
        group_size=16,
        strategy="tensor_group",
        symmetric=True,
        dynamic=False,
        scale_dtype=torch.float8_e4m3fn,
    )
    scheme = ct["Scheme"](targets=["Linear"], weights=args)
    t = torch.from_numpy(w)
    g = ct["gparam"](t.min(), t.max())
    grouped = t.reshape(t.shape[0], -1, 16)
    scale, zp = ct["qparams"](grouped.amin(-1), grouped.amax(-1), args, global_scale=g)
    sd = ct["Compressor"].compress(
        {"weight": t, "weight_scale": scale, "weight_global_scale": g, "weight_zero_point": zp}, scheme
    )
    return sd, scheme


# ---- scalar formats -----------------------------------------------------------------------------------------------


def test_e4m3_decode_matches_torch_for_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = torch.from_numpy(codes).view(torch.float8_e4m3fn).float().numpy()
    got = nvfp4.e4m3_to_f32(codes)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).sum() == 2
    ok = ~np.isnan(want)
    assert np.array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # bitwise, so -0 is checked too


def test_e4m3_encode_matches_torch_rne_including_ties_and_subnormals():
    rng = np.random.default_rng(1)
    finite = nvfp4.E4M3_TABLE[~np.isnan(nvfp4.E4M3_TABLE)]
    pos = np.unique(finite[finite > 0])
    mids = ((pos[1:] + pos[:-1]) / 2).astype(np.float32)  # exact ties between neighbours
    x = np.concatenate(
        [
            finite,
            mids,
            -mids,
            np.float32(2.0**-10) * np.arange(16, dtype=np.float32),
            rng.uniform(-448, 448, 20000).astype(np.float32),
            (rng.standard_normal(20000) * 2.0 ** rng.integers(-14, 8, 20000)).astype(np.float32),
            np.float32([0.0, -0.0, 448.0, -448.0, 2.0**-6, 2.0**-9, 2.0**-10]),
        ]
    ).astype(np.float32)
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    got = nvfp4.f32_to_e4m3(x)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, f"first mismatches: {x[bad[:5]]} got {got[bad[:5]]} want {want[bad[:5]]}"


def test_e4m3_encode_saturates_and_keeps_nan():
    x = np.float32([449.0, 464.0, 1e6, np.inf, -1e6, -np.inf, np.nan])
    assert nvfp4.f32_to_e4m3(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


def test_bf16_round_trip_matches_torch():
    rng = np.random.default_rng(2)
    all_bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    want = torch.from_numpy(all_bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    got = nvfp4.bf16_to_f32(all_bits)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    # ties: exactly half-way between two bf16 values, both parities
    base = rng.integers(0, 0x7F00, 5000).astype(np.uint32) << 16
    x = np.concatenate(
        [
            (base | 0x8000).view(np.float32),
            (base | 0x18000).view(np.float32),
            rng.standard_normal(50000).astype(np.float32) * 1e3,
            np.float32([0.0, -0.0, np.inf, -np.inf, 3.4e38, -3.4e38, 1e-40]),
        ]
    )
    want16 = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(nvfp4.f32_to_bf16(x), want16)
    assert np.isnan(nvfp4.bf16_to_f32(nvfp4.f32_to_bf16(np.float32([np.nan])))).all()


# ---- pack / unpack / dequant vs compressed-tensors ---------------------------------------------------------------


def test_pack_unpack_bit_identical_to_compressed_tensors():
    ct = _ct()
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 16, (64, 96)).astype(np.uint8)
    values = nvfp4.E2M1_VALUES[codes]
    want = ct["pack"](torch.from_numpy(values)).numpy()
    assert np.array_equal(nvfp4.pack_e2m1(codes), want)
    every_byte = np.arange(256, dtype=np.uint8).reshape(8, 32)
    unpacked = ct["unpack"](torch.from_numpy(every_byte), 8, 64, dtype=torch.float32).numpy()
    mine = nvfp4.E2M1_VALUES[nvfp4.unpack_e2m1(every_byte)]
    assert np.array_equal(mine.view(np.uint32), unpacked.view(np.uint32))
    assert np.array_equal(nvfp4.unpack_e2m1(nvfp4.pack_e2m1(codes)), codes)


def test_dequant_identical_to_compressed_tensors():
    ct = _ct()
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, (32, 64)).astype(np.uint8)
    scale = rng.integers(0, 0x7F, (32, 8)).astype(np.uint8)  # every non-NaN positive e4m3, subnormals included
    g = np.float32(1234.567)
    mine = nvfp4.dequantize_nvfp4(packed, scale, g)
    x_q = ct["unpack"](torch.from_numpy(packed), 32, 128, dtype=torch.float32)
    s = torch.from_numpy(scale).view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    want = ct["dequantize"](x_q, s, global_scale=torch.tensor([g]), dtype=torch.float32).numpy()
    assert np.array_equal(mine, want)


# ---- quantize vs compressed-tensors ---------------------------------------------------------------------------------


def _adversarial_cases() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    cases = {
        "normal": rng.standard_normal((48, 256)).astype(np.float32) * 0.02,
        "heavy": (rng.standard_t(2, (32, 128)) * 1e-3).astype(np.float32),
    }
    z = rng.standard_normal((16, 64)).astype(np.float32)
    z[3] = 0.0
    z[7, :16] = 0.0
    cases["zero_rows_and_blocks"] = z
    cases["all_zero"] = np.zeros((4, 32), np.float32)
    t = rng.standard_normal((16, 64)).astype(np.float32)
    t[2:6] *= np.float32(1e-6)  # block scales underflow e4m3 -> subnormals / zero -> 0.125 replacement
    t[9] *= np.float32(1e-12)
    cases["tiny_rows"] = t
    cases["tiny_tensor"] = (rng.standard_normal((8, 32)) * 1e-30).astype(np.float32)
    cases["huge"] = (rng.standard_normal((8, 32)) * 1e37).astype(np.float32)
    # Exact ties: c = 7/16 makes the global scale 1024 and every block scale an exact power-of-two fraction of
    # 448, so w / (scale/global) lands exactly on each E2M1 midpoint.
    c = np.float32(7 / 16)
    ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.1, 0.3, 4.9, 5.1, 1.0, 0.0, 2.0, 3.0])
    rows = []
    for j in range(4):  # block maxima 6c, 3c, 1.5c, 0.75c
        f = np.float32(2.0**-j)
        row = np.concatenate([[6.0], ties]).astype(np.float32) * c * f
        rows += [row, -row, row[::-1].copy()]
    cases["exact_ties"] = np.tile(np.stack(rows), (1, 4)).astype(np.float32)
    return cases


@pytest.mark.parametrize("case", list(_adversarial_cases()))
def test_quantize_identical_to_compressed_tensors(case):
    ct = _ct()
    w = _adversarial_cases()[case]
    packed, scale, g = nvfp4.quantize_nvfp4(w)
    sd, scheme = _ct_quantize(ct, w)
    assert np.float32(g) == sd["weight_global_scale"].numpy()[0]
    assert np.array_equal(scale, sd["weight_scale"].view(torch.uint8).numpy())
    assert np.array_equal(packed, sd["weight_packed"].numpy()), "codes differ (tie rule or sign of zero)"
    # and the round trip through compressed-tensors' decompress equals ours (it returns bf16)
    dense = ct["Compressor"].decompress(sd, scheme)["weight"].float().numpy()
    mine = nvfp4.dequantize_nvfp4(packed, scale, g)
    assert np.array_equal(nvfp4.bf16_to_f32(nvfp4.f32_to_bf16(mine)), dense)


def test_exact_ties_round_to_even():
    """Independent of the oracle: the midpoints go to the even-mantissa neighbour."""
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want_mag = np.float32([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert np.array_equal(nvfp4.E2M1_VALUES[nvfp4.round_e2m1(mids)], want_mag)
    assert np.array_equal(nvfp4.E2M1_VALUES[nvfp4.round_e2m1(-mids)], -want_mag)


def test_quantize_error_is_small_and_global_scale_is_divisor():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    packed, scale, g = nvfp4.quantize_nvfp4(w)
    assert abs(g * np.abs(w).max() / 2688.0 - 1) < 1e-6
    back = nvfp4.dequantize_nvfp4(packed, scale, g)
    rel = np.linalg.norm(back - w) / np.linalg.norm(w)
    assert 0.03 < rel < 0.15  # 4-bit: clearly lossy, clearly not garbage
    assert np.abs(back).max() <= np.abs(w).max() * 1.0001


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="NaN"):
        nvfp4.quantize_nvfp4(np.full((2, 16), np.nan, np.float32))
