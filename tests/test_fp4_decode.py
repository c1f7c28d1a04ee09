"""CPU test: the sm_90a E2M1 decode of templates/include/thorgen/nvfp4.cuh (fp4_shift_decode), modelled in NumPy
from the header's own masks and multipliers, gives the same half2 bits as the shift-and-mask form the references
were written against, for every value of the bits that reach each register; and every e2m1 x e4m3 scale product
the kernels form in fp16 (hmul2 of those bits and the decoded scale) is exact."""

from __future__ import annotations

import re

import numpy as np

from thorgen.codegen.render import INCLUDE_DIR

MASK32 = np.uint64(0xFFFFFFFF)
KEEP = np.uint64(0x8E008E00)


def _header_decode() -> str:
    text = (INCLUDE_DIR / "thorgen" / "nvfp4.cuh").read_text()
    return text[text.index("void fp4_shift_decode") :].split("}", 1)[0]


def _shift_and_mask(v: np.ndarray) -> list[np.ndarray]:
    """The decode's definition: each register = the word shifted so its codes' S..EEM bits sit at 15, 11-9."""

    def shl(x: np.ndarray, n: int) -> np.ndarray:
        return (x << np.uint64(n)) & MASK32

    return [
        v & KEEP,
        shl(v, 3) & KEEP,
        (shl(v, 6) & np.uint64(0x0E000E00)) | (shl(v, 1) & np.uint64(0x80008000)),
        (shl(v, 9) & np.uint64(0x0E000E00)) | (shl(v, 2) & np.uint64(0x80008000)),
    ]


def _header_model(v: np.ndarray) -> list[np.ndarray]:
    """fp4_shift_decode as the header writes it: r[0], r[1] shift-and-mask, r[2], r[3] (v & MASK) * MUL & KEEP."""
    body = _header_decode()
    products = re.findall(r"r\[(\d)\] = \(\(v & 0x([0-9A-Fa-f]+)u\) \* (\d+)u\) & 0x([0-9A-Fa-f]+)u;", body)
    assert [p[0] for p in products] == ["2", "3"], f"unexpected fp4_shift_decode form:\n{body}"
    out = [v & KEEP, ((v << np.uint64(3)) & MASK32) & KEEP]
    for _, mask, mul, keep in products:
        out.append((((v & np.uint64(int(mask, 16))) * np.uint64(int(mul))) & MASK32) & np.uint64(int(keep, 16)))
    return out


def _words_over_bits(bits: list[int], rng: np.random.Generator) -> np.ndarray:
    """Every assignment of `bits`, the other bits of the word random."""
    n = len(bits)
    idx = np.arange(1 << n, dtype=np.uint64)
    word = rng.integers(0, 1 << 32, size=1 << n, dtype=np.uint64)
    for j, b in enumerate(bits):
        word &= ~np.uint64(1 << b)
        word |= ((idx >> np.uint64(j)) & np.uint64(1)) << np.uint64(b)
    return word


def test_multiply_form_matches_shift_and_mask_for_every_input_bit() -> None:
    rng = np.random.default_rng(7)
    # r[2] reads bits 3-5, 14 of each half, r[3] bits 0-2, 13: all 2^16 values of them, three random backgrounds
    bits = [0, 1, 2, 3, 4, 5, 13, 14, 16, 17, 18, 19, 20, 21, 29, 30]
    words = np.concatenate([_words_over_bits(bits, rng) for _ in range(3)])
    # and every byte value in every byte position
    for pos in range(4):
        base = rng.integers(0, 1 << 32, size=256, dtype=np.uint64) & ~np.uint64(0xFF << (8 * pos))
        words = np.concatenate([words, base | (np.arange(256, dtype=np.uint64) << np.uint64(8 * pos))])
    want, got = _shift_and_mask(words), _header_model(words)
    for r in range(4):
        bad = np.flatnonzero(want[r] != got[r])
        assert bad.size == 0, f"r[{r}] differs for word 0x{int(words[bad[0]]):08x}"


def test_model_detects_a_wrong_multiplier() -> None:
    v = np.arange(1 << 16, dtype=np.uint64) * np.uint64(0x10001)
    wrong = (((v & np.uint64(0x40384038)) * np.uint64(65)) & MASK32) & KEEP
    assert (wrong != _shift_and_mask(v)[2]).any()


def _e4m3(code: np.ndarray) -> np.ndarray:
    e, m = (code >> 3) & 0xF, code & 7
    return np.where(e == 0, m / 8.0 * 2.0**-6, (1 + m / 8.0) * 2.0 ** (e.astype(np.float64) - 7))


def test_e2m1_times_e4m3_is_exact_in_fp16() -> None:
    """The FP4_SHIFT registers hold e2m1 * 2^-14 (the epilogue multiplies 2^14 back in fp32), FP4_NAT ones e2m1:
    every product with a finite positive e4m3 scale (0x00-0x7E) is representable in fp16."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    scales = _e4m3(np.arange(0x7F))
    for factor in (2.0**-14, 1.0):
        exact = np.outer(e2m1 * factor, scales)
        assert (exact.astype(np.float16).astype(np.float64) == exact).all(), f"inexact at factor {factor}"
        # the decoded registers and the scale are fp16 themselves
        assert (np.float16(e2m1 * factor).astype(np.float64) == e2m1 * factor).all()
