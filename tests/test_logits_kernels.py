"""CPU tests of the lm_logits kernel family (logits processing on the device): the host packing
(runtime/cuda/logits_params.py) and its device layouts, the NumPy references against runtime/reference/logits.py
(tiny and full-size vocabularies, -inf masks, ties, biases on masked tokens), chunk-level models of the two kernels'
algorithms, the engine-emulator stand-ins, and (slow) nvcc builds of the family for sm_90a."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
import logits_cases as LC
import reference_logits as RL
from thorgen.codegen.families.lm_logits import LOGPROB_CANDIDATES, PLAIN_ROW_WORDS
from reference_kernels import softcap_ref
from thorgen.codegen.render import INCLUDE_DIR
from thorgen.runtime.cuda import logits_params as LP
from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference.logits import token_logprob

CAP = LC.CAP


# ---- layouts ------------------------------------------------------------------------------------------------------
def test_dtypes_match_the_header():
    text = (INCLUDE_DIR / "thorgen" / "logits.cuh").read_text()
    for struct, dt in (("LogitRow", LP.LOGIT_ROW), ("TokenCount", LP.TOKEN_COUNT), ("TokenBias", LP.TOKEN_BIAS)):
        size = re.search(rf"sizeof\({struct}\) == (\d+)", text)
        assert size and int(size.group(1)) == dt.itemsize, struct
        offsets = dict(re.findall(rf"offsetof\({struct}, (\w+)\) == (\d+)", text))
        assert offsets and all(dt.fields[f][1] == int(o) for f, o in offsets.items()), (struct, offsets)
        assert set(offsets) <= set(dt.names)
    assert np.array(PLAIN_ROW_WORDS, np.uint32).view(LP.LOGIT_ROW)[0] == LP.plain_row()


def test_token_counts_incremental_equals_scratch():
    rng = np.random.default_rng(1)
    prompt, output = list(rng.integers(0, 50, 40)), list(rng.integers(0, 80, 30))
    tc = LP.TokenCounts(prompt, 64)
    for t in output:
        tc.add(int(t))
    ids = sorted({t for t in prompt + output if t < 64})
    assert tc.entries()["token"].tolist() == ids
    assert tc.entries()["count"].tolist() == [output.count(t) for t in ids]
    assert (LP.TokenCounts.of(prompt, output, 64).entries() == tc.entries()).all()


def test_mask_words_from_bools_and_llguidance_words():
    rng = np.random.default_rng(2)
    allowed = rng.random(600) < 0.3  # longer than the vocabulary: the tail is dropped
    words = LP.mask_words(allowed, 512)
    assert words.shape == (16,) and (RL.mask_allowed(words, 512) == allowed[:512]).all()
    short = LP.mask_words(words[:5], 512)  # a tokenizer with fewer ids: the rest is disallowed
    assert (RL.mask_allowed(short, 512) == np.r_[allowed[:160], np.zeros(352, bool)]).all()


# ---- lm_process ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [512, 262144])
def test_process_ref_equals_the_reference_recipe(V):
    rng = np.random.default_rng(V)
    cases = LC.cases(rng, V)
    logits = LC.logits(rng, len(cases), V)
    b = LC.pack(cases, V)
    got, status = RL.process_ref(logits, CAP, b.rows, b.counts, b.biases, b.masks)
    np.testing.assert_array_equal(got, LC.reference_rows(logits, cases))  # bit for bit, -inf included
    assert status.tolist() == [LP.STATUS_NONE_ALLOWED if t == LC.NONE_ALLOWED else 0 for t in range(len(cases))]
    assert np.isneginf(got[2][~cases[2][3]]).all()  # biased, penalised and masked: still -inf


def test_process_status_flags_overflow():
    V = 512
    logits = np.full((1, V), 5.0, np.float32)
    b = LP.pack([(SamplingParams(repetition_penalty=0.5), LP.TokenCounts([3], V), None)], V)
    b.rows["repetition_penalty"] = 1e-310  # (SamplingParams refuses it; the kernel must still flag its overflow)
    got, status = RL.process_ref(logits, CAP, b.rows, b.counts, b.biases, b.masks)
    assert got[0, 3] == np.inf and status.tolist() == [LP.STATUS_NON_FINITE]


def _chunk_model(logits, cap, rows, counts, biases, masks, chunk):
    """lm_process's algorithm, block by block: softcap + mask into the chunk, binary-searched entry ranges, the
    counted tokens (with their bias) then the biased tokens not counted, one float32 rounding each."""
    T, V = logits.shape
    out = np.empty((T, V), np.float32)
    for t in range(T):
        d = rows[t]
        cnt = counts[d["counts_offset"] : d["counts_offset"] + d["n_counts"]]
        bs = biases[d["bias_offset"] : d["bias_offset"] + d["n_bias"]]
        ok = RL.mask_allowed(masks[d["mask_row"]], V) if d["mask_row"] >= 0 else np.ones(V, bool)
        r, f, p = float(d["repetition_penalty"]), float(d["frequency_penalty"]), float(d["presence_penalty"])
        for lo in range(0, V, chunk):
            buf = np.where(ok[lo : lo + chunk], softcap_ref(logits[t, lo : lo + chunk], cap), -np.inf).astype(
                np.float32
            )
            c0, c1 = np.searchsorted(cnt["token"], [lo, lo + chunk])
            b0, b1 = np.searchsorted(bs["token"], [lo, lo + chunk])
            for e in cnt[c0:c1]:
                if not ok[e["token"]]:
                    continue
                z = float(buf[e["token"] - lo])
                if r != 1.0:
                    z = z / r if z > 0 else z * r
                if e["count"] > 0:
                    z -= f * float(e["count"]) + p
                j = b0 + np.searchsorted(bs["token"][b0:b1], e["token"])
                if j < b1 and bs["token"][j] == e["token"]:
                    z += float(bs["bias"][j])
                buf[e["token"] - lo] = z
            for e in bs[b0:b1]:
                if ok[e["token"]] and e["token"] not in cnt["token"][c0:c1]:
                    buf[e["token"] - lo] = float(buf[e["token"] - lo]) + float(e["bias"])
            out[t, lo : lo + chunk] = buf
    return out


def test_the_kernel_algorithm_equals_the_reference():
    V, chunk = 8192, 2048  # four chunks: entries on both sides of each boundary
    rng = np.random.default_rng(7)
    cases = LC.cases(rng, V)
    logits = LC.logits(rng, len(cases), V)
    b = LC.pack(cases, V)
    want, _ = RL.process_ref(logits, CAP, b.rows, b.counts, b.biases, b.masks)
    np.testing.assert_array_equal(_chunk_model(logits, CAP, b.rows, b.counts, b.biases, b.masks, chunk), want)


def test_pack_skips_what_is_off():
    V = 512
    b = LP.pack(
        [
            None,
            (SamplingParams(frequency_penalty=1.0), LP.TokenCounts.of([1, 2], [2, 2, 9], V), None),
            (SamplingParams(temperature=1.0), None, None),
        ],
        V,
    )
    assert b.counts.tolist() == [(2, 2), (9, 1)]  # prompt-only ids matter to repetition alone
    assert b.rows["n_counts"].tolist() == [0, 2, 0] and b.biases.shape == (0,) and b.masks.shape == (0, 16)
    with pytest.raises(ValueError, match="TokenCounts"):
        LP.pack([(SamplingParams(repetition_penalty=2.0), None, None)], V)


# ---- lm_logprobs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("V", [512, 262144])
def test_logprobs_ref_equals_the_reference(V):
    rng = np.random.default_rng(11 + V)
    logits = LC.logits(rng, 3, V)
    logits[1, 100:140] = 100.0  # 40 tied maxima: the top 20 are the lowest ids
    picked = rng.integers(0, V, 3).astype(np.int32)
    ids, lps, chosen = RL.logprobs_ref(logits, CAP, picked, 20)
    capped = softcap_ref(logits, CAP)
    for t in range(3):
        lp, top = token_logprob(capped[t], int(picked[t]), 20)
        assert chosen[t] == pytest.approx(lp, abs=1e-12)
        assert ids[t].tolist() == [i for i, _ in top]
        np.testing.assert_allclose(lps[t], [v for _, v in top], atol=1e-12, rtol=0)
    assert ids[1].tolist() == list(range(100, 120))


def test_logprobs_chunked_merge_equals_the_reference():
    """lm_logprobs' algorithm: per-chunk top K and (max, sum exp), then the merged top N and log Z."""
    V, chunk = 262144, 2048
    rng = np.random.default_rng(13)
    logits = LC.logits(rng, 2, V)
    picked = np.array([0, V - 1], np.int32)
    c = softcap_ref(logits, CAP).astype(np.float64).reshape(2, V // chunk, chunk)
    m = c.max(-1)
    s = np.exp(c - m[..., None]).sum(-1)
    order = np.argsort(-c, axis=-1, kind="stable")[..., :LOGPROB_CANDIDATES]
    cand_ids = (order + np.arange(V // chunk)[None, :, None] * chunk).reshape(2, -1)
    cand_vals = np.take_along_axis(c, order, -1).reshape(2, -1)
    want_ids, want_lps, want_chosen = RL.logprobs_ref(logits, CAP, picked, 20)
    for t in range(2):
        M = m[t].max()
        ls = np.log((s[t] * np.exp(m[t] - M)).sum())
        k = np.lexsort((cand_ids[t], -cand_vals[t]))[:20]
        assert cand_ids[t][k].tolist() == want_ids[t].tolist()
        np.testing.assert_allclose((cand_vals[t][k] - M) - ls, want_lps[t], atol=RL.TOL_LOGPROB, rtol=0)
        cv = softcap_ref(logits[t, picked[t]], CAP).astype(np.float64)
        assert (cv - M) - ls == pytest.approx(want_chosen[t], abs=RL.TOL_LOGPROB)


# ---- the engine emulator's stand-ins -------------------------------------------------------------------------------
class _Memory:
    """Enough of tests/fake_driver.FakeDriver for the stand-ins: named buffers as views."""

    def __init__(self, arrays: dict) -> None:
        self.arrays = {k: np.ascontiguousarray(v).view(np.uint8).ravel() for k, v in arrays.items()}

    def view(self, addr, dtype, shape, what=""):
        dt = np.dtype(dtype)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        return self.arrays[addr][: int(np.prod(shape)) * dt.itemsize].view(dt).reshape(shape)


def test_emulated_kernels_follow_the_references():
    from emulated_kernels import KernelEmulator
    from thorgen.runtime.cuda.engine import SAMPLE_PARAMS
    from thorgen.runtime.reference.sampling import sample

    class Emu(KernelEmulator):  # (KernelEmulator includes LogitsKernels)
        pass

    V = 512
    rng = np.random.default_rng(17)
    cases = LC.cases(rng, V)[:5]
    T = len(cases)
    logits = LC.logits(rng, T, V)
    b = LC.pack(cases, V)
    sp = np.zeros(T, SAMPLE_PARAMS)  # one record per row (the sampler reads params[row])
    sp["temperature"], sp["top_k"], sp["top_p"], sp["seed"] = 0.8, 40, 1.0, 99
    mem = _Memory(
        {
            "logits": logits,
            "rows": b.rows,
            "counts": b.counts,
            "biases": b.biases,
            "masks": b.masks,
            "out": np.zeros((T, V), np.float32),
            "status": np.zeros(T, np.int32),
            "out_ids": np.zeros(T, np.int32),
            "params": sp,
            "positions": np.arange(T, dtype=np.int32),
            "top_ids": np.zeros((T, 20), np.int32),
            "top_lps": np.zeros((T, 20)),
            "chosen_lp": np.zeros(T),
        }
    )
    emu = Emu(mem)
    names = {k: k for k in mem.arrays}
    emu.k_lm_process({"V": V, "SOFTCAP": CAP}, {**names, "T": T}, "lm_process")
    ref = LC.reference_rows(logits, cases)
    np.testing.assert_array_equal(mem.view("out", np.float32, (T, V)), ref)
    emu.k_lm_pick({"V": V, "STAGE": "finish"}, {**names, "logits": "out", "T": T}, "lm_pick_finish")
    want = [sample(ref[t], SamplingParams(temperature=0.8, top_k=40, seed=99), t) for t in range(T)]
    assert mem.view("out_ids", np.int32, T).tolist() == want
    emu.k_lm_logprobs({"V": V, "SOFTCAP": CAP, "TOPN": 20, "STAGE": "finish"}, {**names, "T": T}, "lm_logprobs")
    ids, lps, chosen = RL.logprobs_ref(logits, CAP, np.array(want, np.int32), 20)
    assert (mem.view("top_ids", np.int32, (T, 20)) == ids).all()
    assert (mem.view("top_lps", np.float64, (T, 20)) == lps).all()
    assert (mem.view("chosen_lp", np.float64, T) == chosen).all()
    emu.k_lm_pick({"V": V, "STAGE": "argmax"}, {**names, "logits": "out", "T": T}, "lm_pick_argmax")
    assert mem.view("out_ids", np.int32, T).tolist() == np.argmax(ref, -1).tolist()


# ---- nvcc -----------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny", "gemma-4-26b-a4b"])
def test_family_compiles_for_sm_90a(preset, tmp_path):
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.builder import compile_sources
    from thorgen.codegen.nvcc import NvccNotFound, find_nvcc
    from thorgen.codegen.plan import plan
    from thorgen.codegen.render import render
    from thorgen.model_spec.presets import get_preset

    try:
        find_nvcc()
    except NvccNotFound as exc:
        pytest.skip(str(exc))
    spec, arch = get_preset(preset), get_arch("sm_90a")
    ks = [k for k in plan(spec, arch) if k.family == "lm_logits"]
    assert {k.template for k in ks} == {"lm_process.cu.j2", "lm_pick.cu.j2", "lm_logprobs.cu.j2"}
    results = compile_sources({k.name: render(k, arch, spec.spec_hash) for k in ks}, arch, tmp_path, jobs=2)
    for k in ks:
        cubin, res = results[k.name]
        assert cubin[:4] == b"\x7fELF" and res.info[k.name].spills == 0, k.name
