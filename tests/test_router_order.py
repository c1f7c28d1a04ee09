"""CPU check: router_logits_tiled (the prefill chunk's logits, router.cuh) sums every logit in router_logits' order
(the <= 16-row form, 2 warps a block), so the two are bit-identical on the same inputs. Both kernels' arithmetic is
simulated in float32 NumPy, index for index: the reference's lanes (8-column chunks l, l + 32, ... with sequential
fmaf), its warp_sum butterfly and block_sum<64> norm; the tiled kernel's staging (the thread -> column mapping, the
half-row shared layout, the 64 sum-of-squares classes), its warps' 8 x 8 pair tiles over 256-column chunks and its
recursive-halving warp sum. fmaf is emulated exactly (float64 product and sum rounded to odd, then to float32); rsqrtf
is the same instruction on the same float in both kernels, so one stand-in serves both. The GPU test
(test_kernels_gpu_router.py) asserts the same equality on the device."""

from __future__ import annotations

import numpy as np
import pytest

F32 = np.float32


def fma32(a, b, c):
    """fmaf on float32 arrays, correctly rounded: the float64 product is exact; the float64 sum rounded to odd
    (TwoSum error) then to float32 rounds once (53 >= 24 + 2 bits)."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    fix = (e != 0) & ((s.view(np.int64) & 1) == 0)
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def bf16(bits):
    return (np.asarray(bits, np.uint32) << 16).view(F32)


def to_bf16_bits(v):
    return (np.asarray(v, F32).view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 values will do


def butterfly(v):
    """warp_sum over the last axis (32 lanes): v += shfl_xor(v, o) for o = 16 .. 1; every lane's value (equal)."""
    lanes = np.arange(32)
    for o in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ o]).astype(F32)
    return v


def inv_norm(ss, H, eps):
    """rsqrtf(ss * (1.0f / H) + eps) * rsqrtf((float)H) (the mul-add contracted to an fma, as nvcc does); the same
    stand-in for rsqrtf in both simulations."""

    def rs(v):
        return (1.0 / np.sqrt(np.asarray(v, np.float64))).astype(F32)

    return (rs(fma32(ss, F32(1.0) / F32(H), F32(eps))) * rs(F32(H))).astype(F32)


def ref_router_logits(x, scale_bits, proj_bits, eps):
    """router_logits<H, E, THREADS = 64>: lane l of an expert's warp; block_sum<64> for the norm."""
    T, H = x.shape
    E = proj_bits.shape[0]
    xs = (x * bf16(scale_bits)).astype(F32)  # xs[i] = v * scale[i]
    w = bf16(proj_bits)
    CH = H // 8
    acc = np.zeros((T, E, 32), F32)
    for lane in range(32):
        for c in range(lane, CH, 32):
            for i in range(8 * c, 8 * c + 8):
                acc[:, :, lane] = fma32(xs[:, None, i], w[None, :, i], acc[:, :, lane])
    dot = butterfly(acc)[..., 0]
    ss = np.zeros((T, 64), F32)  # thread i: x[i], x[i + 64], ...
    for i in range(64):
        for v in range(i, H, 64):
            ss[:, i] = fma32(x[:, v], x[:, v], ss[:, i])
    s0, s1 = butterfly(ss[:, :32])[:, 0], butterfly(ss[:, 32:])[:, 0]
    r = np.zeros((T, 32), F32)
    r[:, 0], r[:, 1] = s0, s1
    sst = butterfly(r)[:, 0]  # block_sum's second warp_sum: s0 + s1
    return (dot * inv_norm(sst, H, eps)[:, None]).astype(F32)


def tiled_router_logits(x, scale_bits, proj_bits, eps, BT, BE):
    """router_logits_tiled<H, E, BT, BE, THREADS>: block by block, thread by thread, as router.cuh indexes."""
    T, H = x.shape
    E = proj_bits.shape[0]
    KC, TG, EG = 256, BT // 8, BE // 8
    XH, WARPS = KC // 2 + 16, TG * EG
    XROW, THREADS = 2 * XH, 32 * WARPS
    XI, WI = BT * (KC // 16) // THREADS, BE * (KC // 8) // THREADS
    assert H % KC == 0 and XI * THREADS == BT * KC // 16 and WI * THREADS == BE * KC // 8
    ssc = bf16(scale_bits)
    out = np.full((T, E), np.nan, F32)
    tid = np.arange(THREADS)
    warp, lane = tid // 32, tid % 32
    tg, eg = warp % TG, warp // TG
    for by in range(-(-T // BT)):
        t0 = by * BT
        xb = np.zeros((BT, H), F32)
        xb[: min(BT, T - t0)] = x[t0 : t0 + BT]
        for bx in range(E // BE):
            e0 = bx * BE
            acc = np.zeros((THREADS, 64), F32)
            ss = np.zeros((XI, THREADS, 4), F32)
            for c in range(H // KC):
                kc = c * KC
                xs = np.full(BT * XROW, np.nan, F32)
                ws = np.full((BE * KC // 8, 8), np.nan, F32)
                for r in range(XI):
                    u = tid + THREADS * r
                    tt, q = u // 16, u % 16
                    for m in range(4):
                        col = kc + 4 * q + 64 * m
                        for k in range(4):
                            v = xb[tt, col + k]
                            ss[r, :, k] = fma32(v, v, ss[r, :, k])
                            xs[tt * XROW + (q % 2) * XH + 4 * (q // 2 + 8 * m) + k] = (v * ssc[col + k]).astype(F32)
                for r in range(WI):
                    u = tid + THREADS * r
                    row, col = e0 + u[:, None] // (KC // 8), kc + 8 * (u[:, None] % (KC // 8)) + np.arange(8)
                    ws[u] = bf16(proj_bits[row, col])
                lo = [xs[((8 * tg + i) * XROW)[:, None] + 4 * lane[:, None] + np.arange(4)] for i in range(8)]
                hi = [xs[((8 * tg + i) * XROW + XH)[:, None] + 4 * lane[:, None] + np.arange(4)] for i in range(8)]
                xa, xb2 = np.stack(lo, 1), np.stack(hi, 1)
                xv = np.concatenate([xa, xb2], 2)  # [thread, token i, 8 columns 8l .. 8l + 7]
                for j in range(8):
                    wr = ws[(8 * eg + j) * (KC // 8) + lane]  # [thread, 8]
                    for i in range(8):
                        a = acc[:, 8 * i + j]
                        for k in range(8):
                            a = fma32(xv[:, i, k], wr[:, k], a)
                        acc[:, 8 * i + j] = a
            sq = np.full(BT * 64, np.nan, F32)
            for r in range(XI):
                u = tid + THREADS * r
                for k in range(4):
                    sq[(u // 16) * 64 + 4 * (u % 16) + k] = ss[r, :, k]
            sq = sq.reshape(BT, 64)
            inv_s = inv_norm((butterfly(sq[:, :32])[:, 0] + butterfly(sq[:, 32:])[:, 0]).astype(F32), H, eps)
            a = acc.reshape(WARPS, 32, 64)  # the recursive halving (halve_pairs<16>)
            ln = np.arange(32)
            for O in (16, 8, 4, 2, 1):
                up = (ln & O) != 0
                lo, hi = a[:, :, : O * 2], a[:, :, O * 2 : O * 4]
                keep = np.where(up[None, :, None], hi, lo)
                send = np.where(up[None, :, None], lo, hi)
                a = (keep + send[:, ln ^ O]).astype(F32)
            for w in range(WARPS):
                for l in range(32):
                    i, t = l >> 2, t0 + 8 * tg[32 * w] + (l >> 2)
                    if t < T:
                        for k in range(2):
                            e = e0 + 8 * eg[32 * w] + 2 * (l & 3) + k
                            out[t, e] = a[w, l, k] * inv_s[8 * tg[32 * w] + i]
    return out


@pytest.mark.parametrize("T,H,E,BE", [(21, 512, 32, 32), (9, 256, 16, 16), (16, 2816, 32, 32)])
def test_tiled_order_bit_identical(T, H, E, BE):
    rng = np.random.default_rng(T + H + E)
    x = rng.normal(0, 3, (T, H)).astype(F32)
    scale = to_bf16_bits(rng.normal(1, 0.2, H))
    proj = to_bf16_bits(rng.normal(0, 1, (E, H)))
    ref = ref_router_logits(x, scale, proj, 1e-6)
    got = tiled_router_logits(x, scale, proj, 1e-6, 16, BE)
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
    # the check has teeth: one sequential fmaf chain per logit (another order) differs in some bits
    xs, w = (x * bf16(scale)).astype(F32), bf16(proj)
    seq = np.zeros((T, E), F32)
    for i in range(H):
        seq = fma32(xs[:, None, i], w[None, :, i], seq)
    ss = np.zeros(T, F32)
    for i in range(H):
        ss = fma32(x[:, i], x[:, i], ss)
    other = (seq * inv_norm(ss, H, 1e-6)[:, None]).astype(F32)
    assert (other.view(np.uint32) != ref.view(np.uint32)).mean() > 0.05


def test_fma32_exact():
    """The fmaf emulation against exact rational arithmetic on random and cancelling operands."""
    from fractions import Fraction

    rng = np.random.default_rng(3)
    a = rng.normal(0, 1, 2000).astype(F32)
    b = rng.normal(0, 1, 2000).astype(F32)
    c = np.concatenate([rng.normal(0, 1e-3, 1000), -(a[1000:].astype(np.float64) * b[1000:])]).astype(F32)
    got = fma32(a, b, c)
    for ai, bi, ci, gi in zip(a, b, c, got):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        lo = np.float32(float(exact))  # float64 rounding then float32 may double-round: check the neighbours
        cands = [np.nextafter(lo, F32(-np.inf)), lo, np.nextafter(lo, F32(np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact), int(np.asarray(v).view(np.uint32)) & 1))
        assert gi == best, (ai, bi, ci, gi, best)
