"""GPU test: a sequence's step has the same bits alone and in any batch (batch invariance). Sequences of
different lengths are prefilled into their own KV lanes; each one's next step runs alone (the one-row decode
graph: GEMVs, the fused router, the split decode attention) and then inside batched steps of 2..32 rows (the 16-
and 32-row GEMMs, rowwise attention over fewer blocks, the many-row MoE), at the same position with the same token.
Its logits must be bit-identical each time, so greedy and seeded tokens cannot depend on the batch.

Tiny preset always; the full-size model too when THORGEN_FULL_MODEL (a synthetic or real checkpoint, repacked) and
THORGEN_FULL_KERNELS (its built kernels) are set:
  THORGEN_KERNELS=<tiny build> python -m pytest -m gpu -q -rA tests/test_engine_batch_invariance_gpu.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
BUCKETS = (2, 5, 16, 17, 32)  # 2..16 rows: the 16-row kernels; 17..32: the 32-row ones


def _models(built) -> list[tuple[str, object, object]]:
    out = [("tiny", *built)]
    full, kernels = os.environ.get("THORGEN_FULL_MODEL"), os.environ.get("THORGEN_FULL_KERNELS")
    if full and kernels:
        out.append(("full", full, kernels))
    return out


def _logits(eng, rows: int) -> np.ndarray:
    V = eng.spec.target.vocab_size
    return eng.act["logits"].view(0, 4 * V * rows).download(np.float32, (rows, V))


@pytest.fixture(scope="module")
def models(built):
    return _models(built)


def test_a_step_has_the_same_bits_alone_and_in_any_batch(models):
    from thorgen.runtime.cuda.backend import open_backend

    for name, model, kernels in models:
        backend = open_backend(model, kernels_dir=kernels, max_num_seqs=32, ctx=4096)
        try:
            eng = backend.engine
            rng = np.random.default_rng(9)
            base = 600 if name == "full" else 40  # past a few key tiles and the tiny preset's sliding window
            prompts = [[2] + rng.integers(256, 4000, base + 13 * i).tolist() for i in range(32)]
            firsts = [eng.prefill(p, lane=i) for i, p in enumerate(prompts)]
            alone = []
            for i, (p, tok) in enumerate(zip(prompts, firsts)):
                alone.append((eng.steps.wait(eng.steps.launch_one(len(p), token=tok, lane=i))[0], _logits(eng, 1)[0]))
            failures = []
            for n in BUCKETS:
                order = rng.permutation(32)[:n]  # any lanes, any rows
                rows = [(int(i), len(prompts[i]), firsts[i], None) for i in order]
                toks = eng.steps.wait(eng.steps.launch_batch(rows))
                got = _logits(eng, n)
                for r, i in enumerate(order):
                    same = np.array_equal(got[r].view(np.uint32), alone[i][1].view(np.uint32))
                    if not same or toks[r] != alone[i][0]:
                        diff = np.abs(got[r].astype(np.float64) - alone[i][1])
                        failures.append(
                            f"{name}: lane {i} as row {r} of {n}: {int((diff > 0).sum())} logits "
                            f"differ (max {diff.max():.3g}), token {toks[r]} vs {alone[i][0]} alone"
                        )
            print(f"{name}: {len(BUCKETS)} batches, {sum(BUCKETS)} rows compared, {len(failures)} differ")
            assert not failures, "\n".join(failures[:20])
        finally:
            backend.close()
