"""Test support (not a test module): shared inputs of the lm_logits kernel tests (CPU and GPU): per-row
processing cases covering each recipe step and their combinations, logits with exact ties, and the reference
recipe's output (runtime/reference/logits.py, rounded to float32 as the kernel stores it)."""

from __future__ import annotations

import numpy as np

from reference_kernels import softcap_ref
from thorgen.runtime.cuda import logits_params as LP
from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference.logits import process

CAP = 30.0
NONE_ALLOWED = 5  # the case that masks every token
ONE_ALLOWED = 6


def cases(rng, V: int):
    """[(params, prompt, output, allowed or None) or None] covering each recipe step and their combinations."""

    def tok(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, V, n)]

    edges = [0, 31, 32, 2047, 2048, V - 1] if V > 2048 else [0, 31, 32, V - 1]
    mask = rng.random(V) < 0.5
    mask[edges[::2]] = False
    one = np.zeros(V, bool)
    one[edges[-1]] = True
    return [
        None,
        (SamplingParams(repetition_penalty=1.3), tok(200), tok(20), None),
        (
            SamplingParams(
                repetition_penalty=0.7,
                frequency_penalty=1.5,
                presence_penalty=-0.5,
                logit_bias=tuple((t, float(rng.normal(0, 20))) for t in set(tok(30) + edges)),
            ),
            tok(100) + edges,
            tok(40) + edges[:3] * 3,
            mask,
        ),
        (SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0), tok(50), tok(60), None),
        (SamplingParams(logit_bias=((edges[1], 150.0), (edges[-1], -150.0))), [], [], mask),  # clamped to +-100
        (SamplingParams(logit_bias=((edges[1], 5.0),)), tok(10), [], np.zeros(V, bool)),  # nothing allowed
        (SamplingParams(repetition_penalty=1.1), tok(30), [], one),  # one token allowed
    ]


def logits(rng, T: int, V: int, scale: float = 12.0) -> np.ndarray:
    x = rng.normal(0, scale, (T, V)).astype(np.float32)
    x[:, 5:V:7] = x[:, 3:4]  # exact ties, also across chunks
    return x


def reference_rows(x, rows):
    """The reference recipe per row (None: softcap only), float32."""
    capped = softcap_ref(x, CAP)
    out = []
    for t, c in enumerate(rows):
        if c is None:
            out.append(capped[t])
        else:
            params, prompt, output, allowed = c
            out.append(process(capped[t], params, prompt, output, allowed).astype(np.float32))
    return np.stack(out)


def pack(rows, V):
    return LP.pack([None if c is None else (c[0], LP.TokenCounts.of(c[1], c[2], V), c[3]) for c in rows], V)
