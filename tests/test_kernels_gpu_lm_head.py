"""GPU tests: lm_head epilogue — softcap fused with argmax, and seeded sampling bit-equal to the reference sampler."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
from gpu_harness import PRESETS, GpuRunner
import reference_kernels as R
from thorgen.model_spec.conventions import SAMPLE_PARAMS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("lm_head",))


def peaked_logits(rng, T: int, V: int, boost: float = 16.0, hot: int = 30) -> np.ndarray:
    """Gaussian logits with `hot` boosted tokens per row: ~99% of the mass sits in them even at V = 262144
    (small nucleus, inside the candidates)."""
    x = rng.normal(0, 1.5, (T, V)).astype(np.float32)
    for t in range(T):
        x[t, rng.choice(V, hot, replace=False)] += boost
    return x


@pytest.mark.parametrize("T", [1, 5])
def test_softcap_argmax(runner, T):
    rng = np.random.default_rng(31 + T)
    (k,) = runner.find("lm_argmax__")
    V, cap = k.param("V"), k.param("SOFTCAP")
    logits = rng.normal(0, 8, (T, V)).astype(np.float32)
    grid = (k.grid[0], min(T, 3), 1)
    # two launches over the same scratch: the first must leave best/counters zeroed for the second
    got = runner.run_seq(
        [(k, grid), (k, grid)],
        {"logits": logits, "T": np.int32(T)},
        {
            "capped": ((T, V), np.float32),
            "best": ((T,), np.uint64),
            "counters": ((T,), np.uint32),
            "out_ids": ((T,), np.int32),
        },
    )
    ref_capped = R.softcap_ref(logits, cap)
    if k.param("EXACT"):
        np.testing.assert_array_equal(got["capped"], ref_capped)
    else:
        np.testing.assert_allclose(got["capped"], ref_capped, rtol=3e-7, atol=1e-6)
    np.testing.assert_array_equal(got["out_ids"], R.argmax_ref(got["capped"]))  # exact on the kernel's values
    np.testing.assert_array_equal(got["out_ids"], R.argmax_ref(ref_capped))
    assert not got["best"].any() and not got["counters"].any()


CASES = [  # (temperature, top_k, top_p, min_p, flat logits)
    (0.0, 0, 1.0, 0.0, False),  # greedy through the sampler
    (1.0, 64, 0.95, 0.0, False),  # Gemma's generation defaults: exact (top_k <= C)
    (0.8, 20, 1.0, 0.05, False),  # top-k + min-p
    (1.0, 0, 0.9, 0.0, False),  # top-p alone, nucleus inside the top C (peaked logits)
    (1.3, 0, 1.0, 0.02, False),  # min-p alone, cut inside the top C
    (0.7, 0, 1.0, 0.0, True),  # plain temperature: Gumbel-max over the whole vocabulary
    (1.0, 0, 1.0, 0.01, True),  # min-p keeping more than C tokens: a value filter over the whole vocabulary
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "t{}_k{}_p{}_m{}{}".format(*c[:4], "_flat" if c[4] else ""))
def test_sampling_matches_reference(runner, case):
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.reference.sampling import sample

    temp, top_k, top_p, min_p, flat = case
    prep, select, finish = (runner.find(f"lm_sample_{s}__")[0] for s in ("prep", "select", "finish"))
    V, cap, ws = prep.param("V"), prep.param("SOFTCAP"), prep.param("WS_ROW_BYTES")
    T = 4
    rng = np.random.default_rng(41)
    logits = rng.normal(0, 1.5, (T, V)).astype(np.float32) if flat else peaked_logits(rng, T, V, hot=min(30, V // 16))
    positions = rng.integers(0, 100_000, T).astype(np.int32)
    seed = 0xDEADBEEF12345 + int(temp * 10)
    # one SampleParams per row (a batched step samples each sequence its own way): seeds differ by row
    params = np.array([(temp, top_p, min_p, seed + t, top_k, 0) for t in range(T)], dtype=SAMPLE_PARAMS).view(np.uint8)
    rows = min(T, 3)
    steps = [(prep, (prep.grid[0], rows, 1)), (select, (1, rows, 1)), (finish, (finish.grid[0], rows, 1))]
    got = runner.run_seq(
        steps,
        {"logits": logits, "params": params, "positions": positions, "T": np.int32(T)},
        {
            "workspace": ((T * ws,), np.uint8),
            "counters": ((T,), np.uint32),
            "out_ids": ((T,), np.int32),
            "status": ((T,), np.int32),
        },
    )
    capped = R.softcap_ref(logits, cap)
    want = [
        sample(
            capped[t],
            SamplingParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed + t),
            int(positions[t]),
        )
        for t in range(T)
    ]
    assert not got["status"].any(), "every case here keeps its kept set inside the candidates (exact path)"
    np.testing.assert_array_equal(got["out_ids"], want)
    assert not got["counters"].any()


def test_sampling_wide_nucleus_is_flagged(runner):
    """top-p over flat logits keeps more tokens than the candidates: status says the draw was approximated."""
    prep, select, finish = (runner.find(f"lm_sample_{s}__")[0] for s in ("prep", "select", "finish"))
    V, ws, C = prep.param("V"), prep.param("WS_ROW_BYTES"), prep.param("C")
    if V <= C * 2:
        pytest.skip("vocabulary too small for a nucleus wider than the candidates")
    T = 2
    logits = np.random.default_rng(51).normal(0, 0.1, (T, V)).astype(np.float32)
    params = np.array([(1.0, 0.9, 0.0, 7, 0, 0)] * T, dtype=SAMPLE_PARAMS).view(np.uint8)
    steps = [(prep, (prep.grid[0], T, 1)), (select, (1, T, 1)), (finish, (finish.grid[0], T, 1))]
    got = runner.run_seq(
        steps,
        {"logits": logits, "params": params, "positions": np.arange(T, dtype=np.int32), "T": np.int32(T)},
        {
            "workspace": ((T * ws,), np.uint8),
            "counters": ((T,), np.uint32),
            "out_ids": ((T,), np.int32),
            "status": ((T,), np.int32),
        },
    )
    assert got["status"].tolist() == [1] * T
    assert ((0 <= got["out_ids"]) & (got["out_ids"] < V)).all()
