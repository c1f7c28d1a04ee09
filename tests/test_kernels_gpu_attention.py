"""GPU tests: attention (decode / verify with split-K merged in the same launch, prefill chunks, drafter hybrid
masks) against the NumPy reference, bf16 and fp8 caches, ring-buffer wrap-around and long linear contexts. Cache
slots the queries must not see are filled with NaN, so any leak of a masked key (or of an unloaded row) fails the
test; the split workspace starts as NaN too, so a merge that reads a part before its block wrote it fails. Split
kernels run both ways, merging in the kernel (counters given; what decode uses) and leaving the partials to an
attn_comb launch (counters null; what 16-query steps use); merging in the kernel they run twice per case: the
second launch needs the merge counters back at zero (checked) and must reproduce the first bit for bit. Paged
kernels (the target's full layers) read their keys through a scrambled page table over a pool whose spare pages are
NaN, built from the same linear caches the reference reads."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from thorgen.runtime.reference import engine_attention as EA  # noqa: E402
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


def _paged(kern, kcs: list, vcs: list, rng) -> dict:
    """A paged kernel's inputs for linear per-lane caches kcs[lane] / vcs[lane] [slots, Hkv, D]: every lane's pages
    scattered over one pool (plus two spare pages of NaN), the page table [lanes, pitch] saying where (entries past
    a lane's pages point at a spare page)."""
    page, pitch, kv = kern.param("page"), kern.param("pitch"), kern.param("kv_dtype")
    n = -(-max(c.shape[0] for c in kcs) // page)
    order = rng.permutation(len(kcs) * n + 2)
    table = np.full((len(kcs), pitch), order[-1], np.int32)
    shape = ((len(kcs) * n + 2) * page,) + kcs[0].shape[1:]
    pk, pv = np.full(shape, NAN_BITS[kv], kcs[0].dtype), np.full(shape, NAN_BITS[kv], kcs[0].dtype)
    for lane, (kc, vc) in enumerate(zip(kcs, vcs)):
        table[lane, :n] = order[lane * n : (lane + 1) * n]
        for b in range(-(-kc.shape[0] // page)):
            dst, src = slice(table[lane, b] * page, table[lane, b] * page + page), slice(b * page, (b + 1) * page)
            rows = kc[src].shape[0]
            pk[dst][:rows], pv[dst][:rows] = kc[src], vc[src]
    return {"kc": pk, "vc": pv, "pages": table}


def _run(runner, kern, q, kc, vc, m, p0, partials: bool = False, fused: bool = True):
    """out [m, Hq, D] fp16 (and, `partials`, the split kernel's (O, (max, sum)) parts [nsplit, m, Hq, ...]);
    split kernels merge in the kernel (`fused`) or through the attn_comb kernel."""
    d, hq, ns = kern.param("d"), kern.param("hq"), kern.param("nsplit")
    positions = np.arange(p0, p0 + m, dtype=np.int32)
    # one sequence (no rowwise lanes); an image-block variant's key bound at each query's own position is causal
    inputs = {
        "q": q,
        "kc": kc,
        "vc": vc,
        "positions": positions,
        "m": np.int32(m),
        "kv_hi": positions,
        "out": np.full((m, hq, d), np.nan, np.float16),
        "rowwise": 0,
        "lane_bytes": 0,
    }
    if kern.param("page"):
        inputs |= _paged(kern, [kc], [vc], np.random.default_rng(p0 + m))
    outputs = {"out": ((m, hq, d), np.float16)}
    if ns == 1:
        return runner.run_seq([(kern, None)], inputs, outputs)["out"]
    inputs["ws"] = np.full(kern.param("ws_floats"), np.nan, np.float32)
    if not fused:  # counters null: the kernel leaves its partials to the combine kernel
        comb = [
            c
            for c in runner.find("attn_comb__")
            if c.param("d") == d
            and c.param("hq") == hq
            and c.param("nsplit") == ns
            and c.param("mmax") == kern.param("mmax")
        ][0]
        return runner.run_seq([(kern, None), (comb, (m * hq, 1, 1))], inputs, outputs)["out"]
    inputs["counters"] = np.zeros(kern.param("cnt_words"), np.uint32)
    outputs |= {"ws": ((kern.param("ws_floats"),), np.float32), "counters": ((kern.param("cnt_words"),), np.uint32)}
    first = runner.run_seq([(kern, None)], inputs, outputs)
    np.testing.assert_array_equal(first["counters"], 0, err_msg=f"{kern.name}: counters not left zeroed")
    again = runner.run_seq([(kern, None), (kern, None)], inputs, outputs)  # the 2nd launch relies on zeroed counters
    np.testing.assert_array_equal(
        again["out"].view(np.uint16),
        first["out"].view(np.uint16),
        err_msg=f"{kern.name} m={m} p0={p0}: a second launch differs",
    )
    if not partials:
        return first["out"]
    mmax, ws = kern.param("mmax"), first["ws"]
    o = ws[: ns * mmax * hq * d].reshape(ns, mmax, hq, d)[:, :m]
    ml = ws[ns * mmax * hq * d : ns * mmax * hq * (d + 2)].reshape(ns, mmax, hq, 2)[:, :m]
    return first["out"], o, ml


def _parts_written(kern, m: int, p0: int) -> int:
    """Split parts a launch that merges in the kernel writes: every split, but for one query no more than its key
    tiles' chunks of TPP (attention.cuh: a query's parts depend on its own key range only)."""
    shape, window = EA.AttnShape.of(kern.param_dict), kern.param("window")
    if m != 1:
        return shape.nsplit
    t_lo = (max(0, p0 - window + 1) if window else 0) // shape.tk
    chunks = EA.split_chunks(t_lo, p0 // shape.tk - t_lo + 1, shape)
    return chunks if chunks <= shape.nsplit else shape.nsplit


def _merge64(o: np.ndarray, ml: np.ndarray) -> np.ndarray:
    """float64 merge of split parts: sum_z 2^(m_z - M) O_z / sum_z 2^(m_z - M) l_z over the parts with l_z > 0."""
    o, m_, l_ = o.astype(np.float64), ml[..., 0].astype(np.float64), ml[..., 1].astype(np.float64)
    ok = l_ > 0
    mx = np.where(ok, m_, -np.inf).max(axis=0)
    e = np.where(ok, np.exp2(np.where(ok, m_, 0.0) - mx), 0.0)
    return (e[..., None] * o).sum(0) / (e * l_).sum(0)[..., None]


def test_attention(runner):
    kernels = runner.find("attn_dec__") + runner.find("attn_pre__")
    assert kernels
    tiny = runner.spec.name == "tiny"
    failures = []
    for i, kern in enumerate(kernels):
        for m, p0 in _cases(kern, tiny):
            rng = np.random.default_rng(100 * i + m + p0)
            q, kc, vc, ref = _build(rng, kern, m, p0)
            tol = R.TOL_ATTN[kern.param("kv_dtype")]
            for fused in (True, False) if kern.param("nsplit") > 1 else (True,):
                err = R.norm_err(_run(runner, kern, q, kc, vc, m, p0, fused=fused), ref)
                if not err <= tol:
                    failures.append(f"{kern.name} m={m} p0={p0} fused={fused}: error {err:.2e} > {tol}")
    assert not failures, "\n".join(failures)


def test_attention_split_matches_unsplit(runner):
    """Flash-decoding splits + combine equal one pass (within rounding) on the same inputs."""
    dec = [k for k in runner.find("attn_dec__") if k.param("nsplit") > 1 and k.param("kv_dtype") == "bf16"]
    if not dec:
        pytest.skip("no split decode kernel")
    kern = dec[0]
    pre = [
        k
        for k in runner.find("attn_pre__")
        if all(k.param(x) == kern.param(x) for x in ("d", "hq", "hkv", "ring", "window", "causal", "kv_dtype"))
    ][0]
    rng = np.random.default_rng(5)
    m, p0 = 16, (kern.param("ring") or 2048) + 100
    q, kc, vc, ref = _build(rng, kern, m, p0)
    b = _run(runner, pre, q, kc, vc, m, p0)
    for fused in (True, False):
        a = _run(runner, kern, q, kc, vc, m, p0, fused=fused)
        assert R.norm_err(a, b) <= 2e-3
        assert R.norm_err(a, ref) <= R.TOL_ATTN["bf16"]


def test_split_merge_matches_its_partials(runner):
    """The in-kernel merge (one level for small groups, two for large ones: m = 1 and m = 16 exercise both on the
    full-attention kernels) equals a float64 merge of the kernel's own partials up to the fp16 output rounding; a
    one-query launch with fewer key tiles than splits (the tiny drafter's 32-key window) writes a part a tile.
    Isolates the merge from the attention math: a race (a part read before its block wrote it: NaN) or a wrong
    level-1 part fails here even where the attention tolerance would hide it."""
    dec = [k for k in runner.find("attn_dec__") if k.param("nsplit") > 1 and k.param("kv_dtype") == "bf16"]
    if not dec:
        pytest.skip("no split decode kernel")
    failures = []
    for i, kern in enumerate(dec):
        for m in (1, 16):
            p0 = (kern.param("ring") or 3000) + 77
            q, kc, vc, _ = _build(np.random.default_rng(900 + i * 16 + m), kern, m, p0)
            out, o, ml = _run(runner, kern, q, kc, vc, m, p0, partials=True)
            n = _parts_written(kern, m, p0)
            if not (np.isnan(o[n:]).all() and np.isnan(ml[n:]).all()):
                failures.append(f"{kern.name} m={m}: a split past its {n} key tiles wrote a part")
            err = R.norm_err(out, _merge64(o[:n], ml[:n]))
            if not err <= 1e-3:
                failures.append(f"{kern.name} m={m}: merge error {err:.2e}")
    assert not failures, "\n".join(failures)


def test_attention_rowwise_lanes(runner):
    """Batched decode (rowwise): query i is its own sequence's token at position p_i in KV lane lanes[i] of a
    cache holding several lanes; each row equals the reference over its own lane, at every split count the launch
    may use (gridDim.z <= nsplit: the planner's ROWWISE_SPLITS for m rows, one, and all), bit for bit what the
    one-query decode launch gives that row alone (batch invariance). The other lanes' slots and each lane's unread
    slots are NaN, so reading another sequence's keys fails."""
    failures = []
    tiny = runner.spec.name == "tiny"
    for i, kern in enumerate(k for k in runner.find("attn_dec__tgt_")):
        d, hq, hkv, ring, window = (kern.param(x) for x in ("d", "hq", "hkv", "ring", "window"))
        kv = kern.param("kv_dtype")
        far = (ring * 2 + 5) if ring else (3000 if tiny else 20000)
        sixteen = ([700 + 13 * j for j in range(16)], [(5 * j) % 16 for j in range(16)])  # a full bucket
        for positions, lanes in (([7, far, 0], [2, 0, 3]), ([far + j for j in range(5)], [4, 1, 3, 0, 2]), sixteen):
            rng = np.random.default_rng(1000 + 10 * i + len(positions))
            m, n_lanes = len(positions), max(lanes) + 1
            slots = ring if ring else max(positions) + 41
            kc = np.full((n_lanes, slots, hkv, d), NAN_BITS[kv], R.kv_store(np.zeros(1, np.float32), kv).dtype)
            vc = kc.copy()
            q = R.kv_store(rng.normal(0, 2.0 / np.sqrt(d), (m, hq, d)).astype(np.float32), "bf16")
            refs = []
            for r, (p, lane) in enumerate(zip(positions, lanes)):
                pos = np.arange(p + 1)
                if window:
                    pos = pos[pos >= max(0, p - window + 1)]
                used = (pos % ring) if ring else pos
                for c in (kc, vc):
                    c[lane, used] = R.kv_store(rng.normal(0, 1, (len(used), hkv, d)).astype(np.float32), kv)
                refs.append(
                    R.attention_ref(q[r : r + 1], kc[lane], vc[lane], kv, p, ring, window, True, kern.param("scale"))
                )
            eb = kc.dtype.itemsize
            inputs = {
                "q": q,
                "kc": kc,
                "vc": vc,
                "positions": np.asarray(positions, np.int32),
                "m": np.int32(m),
                "out": np.full((m, hq, d), np.nan, np.float16),
                "lanes": np.asarray(lanes, np.int32),
                "lane_bytes": np.int64(slots * hkv * d * eb),
                "rowwise": np.int32(1),
            }
            if kern.param("page"):  # the lanes' pages in one pool (lane_bytes unused)
                inputs |= _paged(kern, list(kc), list(vc), rng)
            outputs = {"out": ((m, hq, d), np.float16)}
            if kern.param("nsplit") > 1:
                inputs["ws"] = np.full(kern.param("ws_floats"), np.nan, np.float32)
                inputs["counters"] = np.zeros(kern.param("cnt_words"), np.uint32)
                outputs["counters"] = ((kern.param("cnt_words"),), np.uint32)
            ns = kern.param("nsplit")
            # each row alone: the one-query decode launch (non-rowwise, its lane) that a one-row step runs
            alone = []
            for r, (p, lane) in enumerate(zip(positions, lanes)):
                one = dict(
                    inputs,
                    q=q[r : r + 1],
                    positions=np.asarray([p], np.int32),
                    m=np.int32(1),
                    lanes=np.asarray([lane], np.int32),
                    rowwise=np.int32(0),
                    out=np.full((1, hq, d), np.nan, np.float16),
                )
                alone.append(runner.run_seq([(kern, (1, hkv, ns))], one, {"out": ((1, hq, d), np.float16)})["out"])
            alone = np.concatenate(alone)
            # every split count a launch may use: the planner's for m rows, one, and the most
            for z in sorted({1, ns, kern.param("ROWWISE_SPLITS")[m - 1]} if ns > 1 else {1}):
                got = runner.run_seq([(kern, (m, hkv, z))], inputs, outputs)
                if "counters" in got and got["counters"].any():
                    failures.append(f"{kern.name} splits={z}: counters not left zeroed")
                err = R.norm_err(got["out"], np.concatenate(refs))
                if not err <= R.TOL_ATTN[kv]:
                    failures.append(f"{kern.name} positions={positions} lanes={lanes} splits={z}: error {err:.2e}")
                differ = (got["out"].view(np.uint16) != alone.view(np.uint16)).any(axis=(1, 2))
                if differ.any():  # batch invariance: a row's bits are its one-row step's
                    failures.append(
                        f"{kern.name} positions={positions} splits={z}: rows {np.nonzero(differ)[0]} "
                        f"differ from the same query launched alone"
                    )
    assert not failures, "\n".join(failures)
