"""Runtime stage (reference backend): greedy and counter-based seeded sampling of one token from softcapped logits.

A sampled token depends only on (logits, sampling params, seed, absolute position of the token being
sampled), never on RNG state, so plain and speculative decoding draw the same token at the same position
(the first generated token of a P-token prompt has position P).

Exact recipe (the CUDA sampler must reproduce it):
  1. Filters on z = float64(softcapped logits) / temperature, in this order:
     top-k (k > 0): keep the k largest z, ties -> lower id; top-p (< 1): softmax over the survivors, walk them
     by descending probability (ties -> lower id) and keep token i while (cumulative prob before i) < top_p;
     min-p (> 0): keep survivors with prob >= min_p * max prob (probs renormalised over the survivors).
  2. Gumbel-max over the survivors: token = argmax_v (z_v + g_v), ties -> lower id, where
       splitmix64(x) = { x += 0x9E3779B97F4A7C15; x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9;
                         x = (x ^ (x >> 27)) * 0x94D049BB133111EB; return x ^ (x >> 31) }   (all mod 2^64)
       s = splitmix64(seed mod 2^64);  k = splitmix64(s ^ position);  h_v = splitmix64(k ^ v)
       u_v = ((h_v >> 41) + 0.5) * 2^-23          (24 significant bits: float32-exact, strictly in (0, 1))
       g_v = -log(-log(u_v))                       (float64)
  Greedy (temperature 0): argmax of the logits, ties -> lower id.
"""

from __future__ import annotations

import numpy as np

from ..backend import SamplingParams

_MASK64 = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function on a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x + _GAMMA
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def position_key(seed: int, position: int) -> np.uint64:
    s = splitmix64(np.array([seed & _MASK64], dtype=np.uint64))
    return splitmix64(s ^ np.uint64(position & _MASK64))[0]


def uniforms(seed: int, position: int, n: int) -> np.ndarray:
    """u_v for v = 0..n-1 as float32 in (0, 1)."""
    h = splitmix64(position_key(seed, position) ^ np.arange(n, dtype=np.uint64))
    return (((h >> np.uint64(41)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0**-23)).astype(np.float32)


def gumbel(seed: int, position: int, n: int) -> np.ndarray:
    return -np.log(-np.log(uniforms(seed, position, n).astype(np.float64)))


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # first maximum = lowest id


def filter_mask(z: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Boolean keep-mask over the vocabulary for temperature-scaled logits z (float64)."""
    n = z.shape[0]
    order = np.argsort(-z, kind="stable")  # descending, ties -> lower id first
    if 0 < params.top_k < n:
        order = order[: params.top_k]
    if params.top_p < 1.0 or params.min_p > 0.0:
        zs = z[order]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        if params.top_p < 1.0:
            before = np.cumsum(p) - p
            keep = before < params.top_p
            keep[0] = True
            order, p = order[keep], p[keep] / p[keep].sum()
        if params.min_p > 0.0:
            order = order[p >= params.min_p * p[0]]
    mask = np.zeros(n, dtype=bool)
    mask[order] = True
    return mask


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """The token at absolute `position` given the softcapped logits [V] that predict it."""
    if params.greedy:
        return greedy(logits)
    z = logits.astype(np.float64) / params.temperature
    mask = filter_mask(z, params)
    score = np.where(mask, z + gumbel(params.seed, position, z.shape[0]), -np.inf)
    return int(np.argmax(score))
