"""GPU tests: the lm_logits family — lm_process bit-equal to the reference recipe, the token pick over processed
logits (argmax and the seeded sampler around lm_head's select) equal to the reference sampler, and device logprobs
against the reference log-softmax; tiny and full-size vocabularies."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
import logits_cases as LC
from gpu_harness import PRESETS, GpuRunner
import reference_logits as RL
from thorgen.model_spec.conventions import SAMPLE_PARAMS
from thorgen.runtime.cuda import logits_params as LP

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("lm_head", "lm_logits"))


def _one(runner, prefix):
    (k,) = runner.find(prefix)
    return k


def _process(runner, x, b, rows_y):
    """Runs lm_process twice (the first must leave its counters zeroed); (out, status, counters)."""
    k = _one(runner, "lm_process__")
    T, V = x.shape
    grid = (k.grid[0], rows_y, 1)
    got = runner.run_seq(
        [(k, grid), (k, grid)],
        {"logits": x, "rows": b.rows, "counts": b.counts, "biases": b.biases, "masks": b.masks, "T": np.int32(T)},
        {"out": ((T, V), np.float32), "counters": ((2 * T,), np.uint32), "status": ((T,), np.int32)},
    )
    return got["out"], got["status"], got["counters"]


def test_process_matches_the_reference(runner):
    k = _one(runner, "lm_process__")
    V, cap = k.param("V"), k.param("SOFTCAP")
    rng = np.random.default_rng(3)
    rows = LC.cases(rng, V)
    x = LC.logits(rng, len(rows), V)
    b = LC.pack(rows, V)
    out, status, counters = _process(runner, x, b, 3)  # 3 < T: the rows loop grid-stride
    want, want_status = RL.process_ref(x, cap, b.rows, b.counts, b.biases, b.masks)
    if k.param("EXACT"):
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(out, LC.reference_rows(x, rows))
    else:  # tanhf softcap: within 2 ulp; the masks exactly
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(want))
        fin = np.isfinite(want)
        np.testing.assert_allclose(out[fin], want[fin], rtol=3e-7, atol=1e-6)
    assert status.tolist() == want_status.tolist()
    assert status[LC.NONE_ALLOWED] == LP.STATUS_NONE_ALLOWED and not counters.any()


def _pick(runner, processed, params, positions):
    """lm_pick argmax (greedy params) or prep -> lm_sample select -> lm_pick finish over processed logits."""
    T = processed.shape[0]
    rows = min(T, 3)
    if params["temperature"][0] == 0.0:
        k = _one(runner, "lm_pick_argmax__")
        got = runner.run_seq(
            [(k, (k.grid[0], rows, 1))],
            {"logits": processed, "T": np.int32(T)},
            {"best": ((T,), np.uint64), "counters": ((T,), np.uint32), "out_ids": ((T,), np.int32)},
        )
        assert not got["best"].any() and not got["counters"].any()
        return got["out_ids"], np.zeros(T, np.int32)
    prep, finish = _one(runner, "lm_pick_prep__"), _one(runner, "lm_pick_finish__")
    (select,) = [s for s in runner.find("lm_sample_select__") if s.param("EXACT") == prep.param("EXACT")]
    ws = prep.param("WS_ROW_BYTES")
    assert select.param("WS_ROW_BYTES") == ws
    steps = [(prep, (prep.grid[0], rows, 1)), (select, (1, rows, 1)), (finish, (finish.grid[0], rows, 1))]
    got = runner.run_seq(
        steps,
        {"logits": processed, "params": params.view(np.uint8), "positions": positions, "T": np.int32(T)},
        {
            "workspace": ((T * ws,), np.uint8),
            "counters": ((T,), np.uint32),
            "out_ids": ((T,), np.int32),
            "status": ((T,), np.int32),
        },
    )
    assert not got["counters"].any()
    return got["out_ids"], got["status"]


PICKS = [  # (temperature, top_k, min_p): each exact in the sampler (top_k <= C, or a min-p value filter)
    (0.0, 0, 0.0),
    (1.0, 20, 0.0),
    (0.7, 0, 0.0),
    (1.3, 0, 0.2),
]


@pytest.mark.parametrize("pick", PICKS, ids=lambda c: "t{}_k{}_m{}".format(*c))
def test_pick_over_processed_logits_matches_the_reference_sampler(runner, pick):
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.reference.sampling import sample

    temp, top_k, min_p = pick
    V = _one(runner, "lm_process__").param("V")
    rng = np.random.default_rng(5)
    rows = [c for i, c in enumerate(LC.cases(rng, V)) if i != LC.NONE_ALLOWED]  # a pick from nothing is undefined
    x = LC.logits(rng, len(rows), V, scale=3.0)
    b = LC.pack(rows, V)
    processed, status, _ = _process(runner, x, b, len(rows))
    assert not status.any()
    seed = 0xC0FFEE + int(temp * 10)
    params = np.array([(temp, 1.0, min_p, seed, top_k, 0)] * len(rows), dtype=SAMPLE_PARAMS)  # one per row
    positions = rng.integers(0, 100_000, len(rows)).astype(np.int32)
    ids, st = _pick(runner, processed, params, positions)
    sp = SamplingParams(temperature=temp, top_k=top_k, min_p=min_p, seed=seed)
    want = [sample(processed[t], sp, int(positions[t])) for t in range(len(rows))]
    assert not st.any() and ids.tolist() == want
    assert ids[LC.ONE_ALLOWED - 1] == V - 1  # the only allowed token (case ONE_ALLOWED, shifted by the drop)
    if _one(runner, "lm_process__").param("EXACT"):  # the device's processed rows are the reference's
        ref = LC.reference_rows(x, rows)
        assert ids.tolist() == [sample(ref[t], sp, int(positions[t])) for t in range(len(rows))]


@pytest.mark.parametrize("T", [1, 5])
def test_logprobs_match_the_reference(runner, T):
    prep, finish = _one(runner, "lm_logprobs_prep__"), _one(runner, "lm_logprobs_finish__")
    V, cap, top, ws = prep.param("V"), prep.param("SOFTCAP"), prep.param("TOPN"), prep.param("WS_ROW_BYTES")
    rng = np.random.default_rng(9 + T)
    x = LC.logits(rng, T, V)
    x[-1, 40:80] = 100.0  # 40 tied maxima: the top entries are the lowest ids
    picked = rng.integers(0, V, T).astype(np.int32)
    rows = min(T, 3)
    got = runner.run_seq(
        [(prep, (prep.grid[0], rows, 1)), (finish, (1, rows, 1))],
        {"logits": x, "out_ids": picked, "T": np.int32(T)},
        {
            "workspace": ((T * ws,), np.uint8),
            "top_ids": ((T, top), np.int32),
            "top_lps": ((T, top), np.float64),
            "chosen_lp": ((T,), np.float64),
        },
    )
    ids, lps, chosen = RL.logprobs_ref(x, cap, picked, top)
    tol = RL.TOL_LOGPROB if prep.param("EXACT") else RL.TOL_LOGPROB_FAST
    np.testing.assert_allclose(got["chosen_lp"], chosen, atol=tol, rtol=0)
    np.testing.assert_allclose(got["top_lps"], lps, atol=tol, rtol=0)
    if prep.param("EXACT"):
        np.testing.assert_array_equal(got["top_ids"], ids)
    assert got["top_ids"][-1].tolist() == list(range(40, 40 + top))
    assert (np.diff(got["top_lps"], axis=-1) <= 0).all()
