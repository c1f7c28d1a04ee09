"""GPU tests: attention (decode / verify with split-K + combine, prefill chunks, drafter hybrid masks) against the
NumPy reference, bf16 and fp8 caches, ring-buffer wrap-around and long linear contexts. Cache slots the queries
must not see are filled with NaN, so any leak of a masked key (or of an unloaded row) fails the test."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner  # noqa: E402

pytestmark = pytest.mark.gpu
NAN_BITS = {"bf16": 0x7FC0, "fp8e4m3": 0x7F}


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("attention",))


def _cases(kern, tiny: bool) -> list[tuple[int, int]]:
    """(m, p0) cases: short and long contexts, ring wrap-around, partial query blocks."""
    ring, window = kern.param("ring"), kern.param("window")
    far = (ring or 4096) * 2 + 5 if ring else (3000 if tiny else 20000)
    if kern.name.startswith("attn_dec"):
        return [(1, 0), (1, 37), (1, far), (16, 3), (16, far), (7, far + 1)]
    return [(100, 0), (77, far), (37, 5)] if window else [(100, 0), (77, far)]


def _build(rng, kern, m: int, p0: int):
    d, hq, hkv, ring, window = (kern.param(x) for x in ("d", "hq", "hkv", "ring", "window"))
    kv, causal = kern.param("kv_dtype"), kern.param("causal")
    slots = ring if ring else p0 + m + 40
    qstd = 2.0 / np.sqrt(d)
    q = R.kv_store(rng.normal(0, qstd, (m, hq, d)).astype(np.float32), "bf16")
    kc = R.kv_store(rng.normal(0, 1, (slots, hkv, d)).astype(np.float32), kv)
    vc = R.kv_store(rng.normal(0, 1, (slots, hkv, d)).astype(np.float32), kv)
    # Poison every slot no query may read: positions beyond the last key, and (rings) positions out of the window.
    pos = np.arange(p0 + m)
    need = np.ones(p0 + m, bool)
    if window:
        need &= pos >= max(0, p0 - window + 1)
    used = np.zeros(slots, bool)
    used[(pos[need] % ring) if ring else pos[need]] = True
    kc[~used] = NAN_BITS[kv]
    vc[~used] = NAN_BITS[kv]
    ref = R.attention_ref(q, kc, vc, kv, p0, ring, window, causal, kern.param("scale"))
    return q, kc, vc, ref


def _run(runner, kern, q, kc, vc, m, p0):
    d, hq = kern.param("d"), kern.param("hq")
    inputs = {"q": q, "kc": kc, "vc": vc, "positions": np.arange(p0, p0 + m, dtype=np.int32), "m": np.int32(m),
              "out": np.full((m, hq, d), np.nan, np.float16)}
    outputs = {"out": ((m, hq, d), np.float16)}
    if kern.param("nsplit") > 1:
        comb = [c for c in runner.find("attn_comb__") if c.param("d") == d and c.param("hq") == hq
                and c.param("nsplit") == kern.param("nsplit")][0]
        inputs["ws"] = np.full(kern.param("ws_floats"), np.nan, np.float32)
        steps = [(kern, None), (comb, (m * hq, 1, 1))]
    else:
        steps = [(kern, None)]
    return runner.run_seq(steps, inputs, outputs)["out"]


def test_attention(runner):
    kernels = runner.find("attn_dec__") + runner.find("attn_pre__")
    assert kernels
    tiny = runner.spec.name == "tiny"
    failures = []
    for i, kern in enumerate(kernels):
        for m, p0 in _cases(kern, tiny):
            rng = np.random.default_rng(100 * i + m + p0)
            q, kc, vc, ref = _build(rng, kern, m, p0)
            out = _run(runner, kern, q, kc, vc, m, p0)
            err = R.norm_err(out, ref)
            tol = R.TOL_ATTN[kern.param("kv_dtype")]
            if not err <= tol:
                failures.append(f"{kern.name} m={m} p0={p0}: error {err:.2e} > {tol}")
    assert not failures, "\n".join(failures)


def test_attention_split_matches_unsplit(runner):
    """Flash-decoding splits + combine equal one pass (within rounding) on the same inputs."""
    dec = [k for k in runner.find("attn_dec__") if k.param("nsplit") > 1 and k.param("kv_dtype") == "bf16"]
    if not dec:
        pytest.skip("no split decode kernel")
    kern = dec[0]
    pre = [k for k in runner.find("attn_pre__") if all(k.param(x) == kern.param(x) for x in
                                                        ("d", "hq", "hkv", "ring", "window", "causal", "kv_dtype"))][0]
    rng = np.random.default_rng(5)
    m, p0 = 16, (kern.param("ring") or 2048) + 100
    q, kc, vc, ref = _build(rng, kern, m, p0)
    a = _run(runner, kern, q, kc, vc, m, p0)
    b = _run(runner, pre, q, kc, vc, m, p0)
    assert R.norm_err(a, b) <= 2e-3
    assert R.norm_err(a, ref) <= R.TOL_ATTN["bf16"]
