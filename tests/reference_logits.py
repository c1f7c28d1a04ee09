"""Test support: NumPy references of the lm_logits kernels (lm_process, lm_logprobs), which the GPU tests and the
engine emulator compare against; tolerances next to each.

The packed inputs are NumPy structured arrays with the field names of templates/include/thorgen/logits.cuh
(runtime/cuda/logits_params.py builds them; the references read them by field name).
"""

from __future__ import annotations

import numpy as np

from reference_kernels import softcap_ref

F32, F64 = np.float32, np.float64

# lm_process: exact. Each value is float32(float64 recipe on the float32 softcapped value), rounded once, so it
# equals runtime/reference/logits.py process(...) rounded to float32 bit for bit (EXACT softcap); -inf where masked.
TOL_PROCESS = 0.0
# lm_logprobs: absolute error of each logprob (float64 sums in another order; the fast arches' float32 exp and
# tanhf softcap); the top ids are exact with the EXACT softcap.
TOL_LOGPROB = 1e-6
TOL_LOGPROB_FAST = 2e-5


def mask_allowed(words: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab] from a [vocab / 32] u32 mask row (bit v % 32 of word v / 32)."""
    return np.unpackbits(np.asarray(words, "<u4").view(np.uint8), bitorder="little")[:vocab].astype(bool)


def process_ref(
    logits: np.ndarray, cap: float, rows: np.ndarray, counts: np.ndarray, biases: np.ndarray, masks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(processed softcapped logits f32 [T, V], status i32 [T]) of lm_process on pre-softcap logits [T, V]."""
    capped = softcap_ref(logits, cap)
    T, V = capped.shape
    out = np.empty((T, V), F32)
    status = np.zeros(T, np.int32)
    for t in range(T):
        d = rows[t]
        z = capped[t].astype(F64)
        c = counts[int(d["counts_offset"]) : int(d["counts_offset"]) + int(d["n_counts"])]
        ids, n = c["token"].astype(np.int64), c["count"].astype(np.int64)
        r = float(d["repetition_penalty"])
        if r != 1.0:
            with np.errstate(over="ignore"):  # a tiny r overflows to inf, as on the device (status bit 1)
                z[ids] = np.where(z[ids] > 0, z[ids] / r, z[ids] * r)
        hot = n > 0
        z[ids[hot]] -= float(d["frequency_penalty"]) * n[hot] + float(d["presence_penalty"])
        b = biases[int(d["bias_offset"]) : int(d["bias_offset"]) + int(d["n_bias"])]
        z[b["token"].astype(np.int64)] += b["bias"].astype(F64)
        if int(d["mask_row"]) >= 0:
            z[~mask_allowed(masks[int(d["mask_row"])], V)] = -np.inf
        out[t] = z.astype(F32)
        status[t] = (1 if not (out[t] > -np.inf).any() else 0) | (
            2 if (np.isnan(out[t]) | (out[t] == np.inf)).any() else 0
        )
    return out, status


def logprobs_ref(
    logits: np.ndarray, cap: float, out_ids: np.ndarray, top: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(top ids i32 [T, top], their logprobs f64 [T, top], the logprob of out_ids[t] f64 [T]) of the log-softmax of
    the softcapped logits [T, V] (descending, ties -> lower id)."""
    z = softcap_ref(logits, cap).astype(F64)
    z = z - z.max(axis=-1, keepdims=True)
    lp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    order = np.argsort(-lp, axis=-1, kind="stable")[:, :top]
    chosen = np.take_along_axis(lp, np.asarray(out_ids, np.int64)[:, None], -1)[:, 0]
    return order.astype(np.int32), np.take_along_axis(lp, order, -1), chosen
