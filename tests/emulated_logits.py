"""Test support (not a test module): NumPy stand-ins for the lm_logits kernel templates (lm_process, lm_pick,
lm_logprobs) for the fake CUDA driver of tests/engine_emulator.py.

`LogitsKernels` is a mixin for tests/emulated_kernels.py's KernelEmulator (`class KernelEmulator(LogitsKernels)`):
it uses that class's `v` (fake device memory views) and, for lm_pick, its k_lm_argmax / k_lm_sample with softcap 0.
"""

from __future__ import annotations

import numpy as np

import reference_logits as RL
from thorgen.runtime.cuda.logits_params import LOGIT_ROW, TOKEN_BIAS, TOKEN_COUNT


class LogitsKernels:
    def k_lm_process(self, p, a, n):
        T, V = a["T"], p["V"]
        rows = self.v(a["rows"], LOGIT_ROW, T, "rows")
        n_counts = max([int(r["counts_offset"] + r["n_counts"]) for r in rows if r["n_counts"]] + [0])
        n_bias = max([int(r["bias_offset"] + r["n_bias"]) for r in rows if r["n_bias"]] + [0])
        n_masks = max([int(r["mask_row"]) + 1 for r in rows] + [0])
        counts = self.v(a["counts"], TOKEN_COUNT, n_counts, "counts") if n_counts else np.zeros(0, TOKEN_COUNT)
        biases = self.v(a["biases"], TOKEN_BIAS, n_bias, "biases") if n_bias else np.zeros(0, TOKEN_BIAS)
        masks = (
            self.v(a["masks"], np.uint32, (n_masks, V // 32), "masks") if n_masks else np.zeros((0, V // 32), np.uint32)
        )
        out, status = RL.process_ref(
            self.v(a["logits"], np.float32, (T, V), "logits"), p["SOFTCAP"], rows, counts, biases, masks
        )
        self.v(a["out"], np.float32, (T, V), "out")[:] = out
        self.v(a["status"], np.int32, T, "status")[:] = status

    def k_lm_pick(self, p, a, n):
        """The pick reads values lm_process already softcapped: lm_head's argmax / sampler at softcap 0."""
        if p["STAGE"] == "argmax":
            self.k_lm_argmax({**p, "SOFTCAP": 0.0}, a, n)
        else:
            self.k_lm_sample({**p, "SOFTCAP": 0.0}, a, n)

    def k_lm_logprobs(self, p, a, n):
        if p["STAGE"] != "finish":
            return
        T, V, top = a["T"], p["V"], p["TOPN"]
        ids, lps, chosen = RL.logprobs_ref(
            self.v(a["logits"], np.float32, (T, V), "logits"),
            p["SOFTCAP"],
            self.v(a["out_ids"], np.int32, T, "out_ids"),
            top,
        )
        self.v(a["top_ids"], np.int32, (T, top), "top_ids")[:] = ids
        self.v(a["top_lps"], np.float64, (T, top), "top_lps")[:] = lps
        self.v(a["chosen_lp"], np.float64, T, "chosen_lp")[:] = chosen
