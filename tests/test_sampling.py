"""Tests for the reference sampler: counter-based RNG, filter order, greedy ties, empirical distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference.sampling import filter_mask, greedy, sample, splitmix64, uniforms

M64 = (1 << 64) - 1


def splitmix64_py(x: int) -> int:
    """Independent pure-Python splitmix64 output function (Vigna's reference constants)."""
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def test_splitmix64_matches_reference_vectors() -> None:
    # The first two outputs of the splitmix64 generator seeded with 0 (published test vector).
    assert int(splitmix64(np.array([0], dtype=np.uint64))[0]) == 0xE220A8397B1DCDAF
    assert int(splitmix64(np.array([0x9E3779B97F4A7C15], dtype=np.uint64))[0]) == 0x6E789E6AA1B965F4
    xs = np.random.default_rng(0).integers(0, 2**63, 50, dtype=np.uint64) * np.uint64(2)
    assert [int(v) for v in splitmix64(xs)] == [splitmix64_py(int(x)) for x in xs]


def test_uniforms_follow_documented_hash() -> None:
    seed, pos = 1234567, 89
    u = uniforms(seed, pos, 300)
    key = splitmix64_py(splitmix64_py(seed) ^ pos)
    want = [((splitmix64_py(key ^ v) >> 41) + 0.5) * 2.0**-23 for v in range(300)]
    assert u.dtype == np.float32
    assert u.tolist() == want  # exact: every value is float32-representable
    assert 0.0 < u.min() and u.max() < 1.0
    # a uniform depends on (seed, position, id) only, not on the vocabulary size asked for
    assert np.array_equal(uniforms(seed, pos, 17), u[:17])
    assert not np.array_equal(uniforms(seed, pos + 1, 300), u)
    assert not np.array_equal(uniforms(seed + 1, pos, 300), u)


def test_sample_depends_only_on_seed_and_position() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, 512).astype(np.float32)
    p = SamplingParams(temperature=1.0, seed=7)
    first = [sample(logits, p, pos) for pos in range(200)]
    # any call order, interleaved with other seeds, gives the same tokens
    for pos in reversed(range(200)):
        sample(logits, SamplingParams(temperature=1.0, seed=8), pos)
        assert sample(logits, p, pos) == first[pos]
    assert len(set(first)) > 20  # it is actually random across positions
    other = [sample(logits, SamplingParams(temperature=1.0, seed=8), pos) for pos in range(200)]
    assert other != first


def test_greedy_ties_go_to_lowest_id() -> None:
    logits = np.zeros(10, dtype=np.float32)
    logits[[3, 7]] = 5.0
    assert greedy(logits) == 3
    assert sample(logits, SamplingParams(), 0) == 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, top_k=1, seed=3),
        SamplingParams(temperature=2.0, top_p=1e-6, seed=4),
        SamplingParams(temperature=2.0, min_p=1.0, seed=5),
    ],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    rng = np.random.default_rng(2)
    for pos in range(60):
        logits = rng.normal(0, 1, 256).astype(np.float32)
        assert sample(logits, params, pos) == int(np.argmax(logits))


def _probs(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


def test_filters_keep_exactly_the_expected_sets() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1.5, 64).astype(np.float32)
    t = 0.8
    p = _probs(logits, t)
    order = sorted(range(64), key=lambda i: -p[i])
    top5 = set(order[:5])
    assert set(np.flatnonzero(filter_mask(logits / t, SamplingParams(temperature=t, top_k=5)))) == top5
    # nucleus: the smallest descending prefix whose mass reaches top_p
    cum, nucleus = 0.0, set()
    for i in order:
        nucleus.add(i)
        cum += p[i]
        if cum >= 0.6:
            break
    assert (
        set(np.flatnonzero(filter_mask(logits.astype(np.float64) / t, SamplingParams(temperature=t, top_p=0.6))))
        == nucleus
    )
    minp = {i for i in range(64) if p[i] >= 0.2 * p.max()}
    assert (
        set(np.flatnonzero(filter_mask(logits.astype(np.float64) / t, SamplingParams(temperature=t, min_p=0.2))))
        == minp
    )
    # order: top-k first, then top-p renormalised over the k survivors
    pk = np.array([p[i] for i in order[:5]])
    pk /= pk.sum()
    keep_k_then_p = {order[j] for j in range(5) if pk[:j].sum() < 0.5}
    got = set(
        np.flatnonzero(filter_mask(logits.astype(np.float64) / t, SamplingParams(temperature=t, top_k=5, top_p=0.5)))
    )
    assert got == keep_k_then_p


def test_samples_respect_min_p() -> None:
    rng = np.random.default_rng(4)
    logits = rng.normal(0, 1, 32).astype(np.float32)
    p = _probs(logits, 1.0)
    allowed = set(np.flatnonzero(p >= 0.3 * p.max()))
    with_filter = [sample(logits, SamplingParams(temperature=1.0, min_p=0.3, seed=9), i) for i in range(400)]
    without = [sample(logits, SamplingParams(temperature=1.0, seed=9), i) for i in range(400)]
    assert set(with_filter) <= allowed
    assert not set(without) <= allowed  # the filter changes something


@pytest.mark.parametrize("top_k", [0, 3])
def test_empirical_distribution_matches_softmax(top_k: int) -> None:
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 1.5, 0.7], dtype=np.float32)
    t, n = 0.7, 12000
    params = SamplingParams(temperature=t, top_k=top_k, seed=2024)
    counts = np.bincount([sample(logits, params, pos) for pos in range(n)], minlength=8)
    p = _probs(logits, t)
    if top_k:
        keep = np.argsort(-p)[:top_k]
        q = np.zeros_like(p)
        q[keep] = p[keep] / p[keep].sum()
        p = q
        assert counts[p == 0].sum() == 0
    support = p > 0
    expected = p[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    # loose bound: mean dof, sd sqrt(2 dof); a wrong distribution gives chi2 in the hundreds here
    assert chi2 < dof + 8 * math.sqrt(2 * dof), (chi2, counts.tolist(), expected.tolist())
