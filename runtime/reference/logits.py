"""Runtime stage (reference backend): logits processing (penalties, logit_bias, grammar mask) and logprobs.

The processing recipe (the CUDA backend must reproduce it before it may accept these fields), on the float64
softcapped logits l of the position being sampled, with prompt + output tokens so far:
  1. repetition_penalty r != 1: for every distinct id in prompt + output: l = l / r if l > 0 else l * r;
  2. for every id in the output with count c: l -= frequency_penalty * c + presence_penalty;
  3. l[id] += bias for each logit_bias entry;
  4. a grammar's disallowed ids get -inf.
  5. one rounding to float32 (the value the device stores; the recipe's steps run in float64 before it).
Then the plain sampler (temperature, filters, Gumbel-max by seed and position) runs on l. Logprobs are the
log-softmax of the softcapped logits before step 1 (the model's own distribution, as vLLM reports them).
"""

from __future__ import annotations

import numpy as np

from ..backend import SamplingParams, TokenLogprob


def process(
    logits: np.ndarray, params: SamplingParams, prompt: list[int], output: list[int], allowed: np.ndarray | None
) -> np.ndarray:
    """Steps 1-5 of the recipe on one row of softcapped logits [V]; returns a new float64 row of float32 values,
    so that a seeded sample picks from the values the device's lm_pick picks from."""
    out = logits.astype(np.float64)
    vocab = out.shape[0]
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt + output, dtype=np.int64))
        seen = seen[seen < vocab]
        r = params.repetition_penalty
        out[seen] = np.where(out[seen] > 0, out[seen] / r, out[seen] * r)
    if output and (params.frequency_penalty or params.presence_penalty):
        counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=vocab)[:vocab]
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    for token, bias in params.logit_bias:
        out[token] += bias
    if allowed is not None:
        out[~allowed] = -np.inf
    with np.errstate(over="ignore"):  # an overflow becomes inf, which the callers refuse (as the device does)
        return out.astype(np.float32).astype(np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The chosen token's logprob and the `top` most likely ids (ties -> lower id) with theirs."""
    lp = log_softmax(logits)
    order = np.argsort(-lp, kind="stable")[:top]
    return float(lp[token]), tuple((int(i), float(lp[i])) for i in order)
