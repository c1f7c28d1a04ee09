"""Model spec stage (synthetic checkpoints): deterministic random weights that keep activations sane.

Every tensor gets its own generator seeded from (seed, tensor name), so output does not depend on write order
or chunking. Scale choices (why activations stay finite and non-degenerate through every layer):
  * embed_tokens ~ N(0, 1/sqrt(H)): after the x sqrt(H) embed scale the residual starts at rms ~1, and the tied
    logits norm(x) @ E.T have std ~1 (a spread, not one-hot, distribution).
  * every projection ~ N(0, 1/sqrt(fan_in)): unit-rms inputs give unit-rms outputs.
  * RMSNorm weights ~ 1 +- 5%; the post-attention / post-FFN norms re-normalise each branch, so the residual
    grows only ~sqrt(2) per layer, and layer_scalar in [0.8, 1.0] damps it.
  * q_norm / k_norm ~ D^-1/4: Gemma-4 attention uses scale 1.0, so unit-rms q and k would give logits of std
    sqrt(D) (one-hot attention); D^-1/4 each makes q.k ~ N(0, 1).
  * router.proj ~ N(0, 1), router.scale ~ 1 +- 10%, per_expert_scale in [0.8, 1.2]: the router input is
    rmsnorm(x) * scale / sqrt(H), so logits have std ~1 and the top-k spreads over all experts.
  * vision tower: projections and norms as above; the x/y position tables ~ N(0, 0.5) (patch embeddings stay
    O(1)); the standardize buffers match what the pooled, x sqrt(Hv) features look like (per channel a spread of
    ~sqrt(Hv) around a mean of the same order): std_bias ~ N(0, sqrt(Hv)/2), std_scale ~ U(0.5, 1.5)/sqrt(Hv),
    so (pooled - std_bias) * std_scale is O(1) before the weightless RMSNorm.
NVFP4 projections, two methods (same distribution):
  * "quantize" (tiny preset, default below QUANTIZE_LIMIT elements): float weights through quantize_nvfp4.
  * "direct" (full preset): codes and block scales sampled straight from the statistics of a quantized unit
    Gaussian (computed once), and the global scale set to 2688/(A*sigma) exactly as the quantizer would for a
    tensor of std sigma and absolute max A*sigma, so the dequantized weight has std ~sigma. No float weight is
    ever materialised: the 16 GB preset streams at disk speed.
Other formats are the same model: a bf16 linear (a bf16 checkpoint, or a role ModelOpt leaves bf16) is the bf16 of
the dequantized compressed-tensors weight; a ModelOpt NVFP4 linear is quantized with ModelOpt's arithmetic from the
same float weight, gate and up sharing one weight_scale_2 (the larger amax of the two), as ModelOpt exports them
("direct": the compressed-tensors bytes with weight_scale_2 = 1/global, which gate and up share already).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Iterator

import numpy as np

from ..nvfp4 import (
    E2M1_VALUES,
    dequantize_nvfp4,
    e4m3_to_f32,
    f32_to_bf16,
    modelopt_scale_2,
    quantize_nvfp4,
    quantize_nvfp4_modelopt,
)
from ..tensors import TensorInfo
from ..weight_layout import GROUP

QUANTIZE_LIMIT = 50_000_000  # total NVFP4 elements below which "auto" quantizes real float weights
CHUNK_ELEMENTS = 1 << 22  # bf16 tensors are generated in row chunks of at most this many elements
UNIT_AMAX = 5.0  # absolute max, in std units, assumed for a large Gaussian weight (sets the global scale)
INPUT_GLOBAL_SCALE = np.float32(2688.0 / 8.0)  # activation amax ~8 for unit-rms inputs (W4A16 never reads it)


def rng_for(seed: int, name: str) -> np.random.Generator:
    digest = hashlib.blake2b(name.encode(), digest_size=16).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.default_rng(np.random.SeedSequence([int(seed)] + words))


# ---- plain bf16 tensors -------------------------------------------------------------------------------------------


def _bf16_rule(name: str, shape: tuple[int, ...], hidden: int) -> tuple[str, float, float]:
    """(distribution, a, b) for a plain weight: ("normal", mean, std) or ("uniform", low, high)."""
    if name.endswith("embed_tokens.weight"):
        return "normal", 0.0, hidden**-0.5
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        d = shape[0]
        return "normal", d**-0.25, 0.05 * d**-0.25
    if name.endswith(".weight") and len(shape) == 1 and "norm" in name.split(".")[-2]:
        # every other RMSNorm weight (the seven layer norms, final norm, drafter norms and hidden_norm)
        return "normal", 1.0, 0.05
    if name.endswith("router.proj.weight"):
        return "normal", 0.0, 1.0
    if name.endswith("router.scale"):
        return "normal", 1.0, 0.1
    if name.endswith("router.per_expert_scale"):
        return "uniform", 0.8, 1.2
    if name.endswith("position_embedding_table"):
        return "normal", 0.0, 0.5
    if name.endswith("std_bias"):
        return "normal", 0.0, 0.5 * shape[0] ** 0.5
    if name.endswith("std_scale"):
        return "uniform", 0.5 * shape[0] ** -0.5, 1.5 * shape[0] ** -0.5
    if name.endswith("layer_scalar"):
        return "uniform", 0.8, 1.0
    if name.endswith(".weight") and len(shape) == 2:  # drafter projections and fc
        return "normal", 0.0, shape[1] ** -0.5
    raise ValueError(f"synth: no initialisation rule for tensor {name!r} {shape}")


def bf16_chunks(info: TensorInfo, seed: int, hidden: int) -> Iterator[np.ndarray]:
    """bf16 bit patterns of one plain tensor, in row chunks."""
    kind, a, b = _bf16_rule(info.name, info.shape, hidden)
    rng = rng_for(seed, info.name)
    rows = info.shape[0]
    row_elems = max(1, int(np.prod(info.shape[1:], dtype=np.int64)))
    step = max(1, CHUNK_ELEMENTS // row_elems)
    for r in range(0, rows, step):
        shape = (min(step, rows - r),) + tuple(info.shape[1:])
        if kind == "normal":
            x = rng.standard_normal(shape, dtype=np.float32)
            x *= np.float32(b)  # in place: same float32 ops as x * b + a, one 16 MB temporary fewer
            x += np.float32(a)
        else:
            x = rng.uniform(a, b, shape).astype(np.float32)
        yield f32_to_bf16(x)


# ---- NVFP4 projections --------------------------------------------------------------------------------------------

_TABLES: tuple[np.ndarray, np.ndarray, np.float32] | None = None  # handed over by the parent (see writer.py)


def set_unit_tables(tables: tuple[np.ndarray, np.ndarray, np.float32]) -> None:
    """Use tables computed elsewhere (a worker process gets the parent's instead of re-quantizing the sample:
    that costs ~50 MB of transient memory per worker, all at pool start)."""
    global _TABLES
    _TABLES = tables


def unit_tables() -> tuple[np.ndarray, np.ndarray, np.float32]:
    return _TABLES if _TABLES is not None else _compute_unit_tables()


@lru_cache(maxsize=1)
def _compute_unit_tables() -> tuple[np.ndarray, np.ndarray, np.float32]:
    """(byte LUT over 65536 random u16, scale LUT over 4096, unit global scale) from a quantized N(0,1) sample.

    The unit global scale makes the sampled weight's std exactly 1 in expectation (~2688/5, the quantizer's
    value for a Gaussian whose amax is 5 std); a weight of std sigma then gets global = g_unit / sigma.
    """
    rng = np.random.default_rng(20260401)
    packed, scale, _ = quantize_nvfp4(
        rng.standard_normal((1024, 2048), dtype=np.float32), global_scale=np.float32(2688.0 / UNIT_AMAX)
    )
    nibbles = np.concatenate([packed.ravel() & 0xF, packed.ravel() >> 4])
    # 256 equally likely slots per nibble, filled by quantiles of the observed code distribution
    nib_lut = np.sort(nibbles)[(np.arange(256) * nibbles.size) // 256 + nibbles.size // 512].astype(np.uint8)
    r = np.arange(65536)
    byte_lut = (nib_lut[r & 0xFF] | (nib_lut[r >> 8] << 4)).astype(np.uint8)
    s = np.sort(scale.ravel())  # e4m3 bytes of positive values sort in value order
    scale_lut = s[(np.arange(4096) * s.size) // 4096 + s.size // 8192].astype(np.uint8)
    # Codes and scales are drawn independently, which loses the small code/scale correlation of the real
    # quantizer (a scale rounded up gets smaller codes); fold the resulting std change into the global scale.
    mean_sq_code = float(np.mean(E2M1_VALUES[nib_lut].astype(np.float64) ** 2))
    mean_sq_scale = float(np.mean(e4m3_to_f32(scale_lut).astype(np.float64) ** 2))
    g_unit = np.float32(np.sqrt(mean_sq_code * mean_sq_scale))
    return byte_lut, scale_lut, g_unit


Nvfp4Parts = tuple[np.ndarray, np.ndarray, np.float32]


def direct_nvfp4(rng: np.random.Generator, out_f: int, in_f: int, std: float) -> Nvfp4Parts:
    """(packed, scale, global) sampled directly: dequantizes to a weight of std ~std."""
    byte_lut, scale_lut, g_unit = unit_tables()
    r = np.frombuffer(rng.bytes(out_f * in_f), dtype=np.uint16)  # one u16 per packed byte
    packed = byte_lut[r].reshape(out_f, in_f // 2)
    rs = np.frombuffer(rng.bytes(2 * out_f * (in_f // GROUP)), dtype=np.uint16) >> 4
    scale = scale_lut[rs].reshape(out_f, in_f // GROUP)
    return packed, scale, np.float32(g_unit / np.float32(std))


def float_weight(seed: int, prefix: str, out_f: int, in_f: int) -> np.ndarray:
    """The float32 weight the "quantize" method draws for one linear (std 1/sqrt(in_f))."""
    return rng_for(seed, prefix).standard_normal((out_f, in_f), dtype=np.float32) * np.float32(in_f**-0.5)


def ct_parts(seed: int, method: str, prefix: str, out_f: int, in_f: int) -> Nvfp4Parts:
    """The compressed-tensors (packed, scale, divisor global) of one linear."""
    if method == "direct":
        return direct_nvfp4(rng_for(seed, prefix), out_f, in_f, in_f**-0.5)
    return quantize_nvfp4(float_weight(seed, prefix, out_f, in_f))


GATE_UP_PARTNER = {"gate_proj": "up_proj", "up_proj": "gate_proj"}


def modelopt_parts(seed: int, method: str, prefix: str, out_f: int, in_f: int) -> Nvfp4Parts:
    """ModelOpt (packed, scale, weight_scale_2 multiplier) of one linear; gate and up share weight_scale_2."""
    if method == "direct":  # gate and up have the same fan-in, so the same sampled global scale
        packed, scale, g = ct_parts(seed, method, prefix, out_f, in_f)
        return packed, scale, np.float32(1.0) / g
    w = float_weight(seed, prefix, out_f, in_f)
    head, proj = prefix.rsplit(".", 1)
    amax = float(np.abs(w).max())
    if proj in GATE_UP_PARTNER:
        amax = max(amax, float(np.abs(float_weight(seed, f"{head}.{GATE_UP_PARTNER[proj]}", out_f, in_f)).max()))
    return quantize_nvfp4_modelopt(w, modelopt_scale_2(amax))


class LinearParts:
    """Produces the tensors of each Linear once (its NVFP4 parts are written consecutively): compressed-tensors or
    ModelOpt NVFP4 parts, or the bf16 weight of a linear the format keeps bf16."""

    def __init__(self, seed: int, method: str) -> None:
        if method not in ("quantize", "direct"):
            raise ValueError(f"synth: NVFP4 method {method!r} (quantize, direct)")
        self.seed, self.method = seed, method
        self._prefix: str | None = None
        self._parts: dict[str, np.ndarray] = {}

    def part(self, info: TensorInfo) -> np.ndarray:
        if info.role == "kv_scale":  # ModelOpt's FP8 KV scales: 1.0, as its fp8_cast KV recipe writes them
            return np.array(1.0, np.float32)
        prefix, suffix = info.name.rsplit(".", 1)
        if info.role == "linear_bf16":
            out_f, in_f = info.shape
            return f32_to_bf16(dequantize_nvfp4(*ct_parts(self.seed, self.method, prefix, out_f, in_f)))
        if prefix != self._prefix:
            if info.role != "weight_packed":
                raise ValueError(f"synth: {info.name} must follow its packed weight")
            out_f, in_f = info.shape[0], info.shape[1] * 2
            self._prefix = prefix
            if suffix == "weight":  # ModelOpt names the packed weight plainly `weight`
                packed, scale, s2 = modelopt_parts(self.seed, self.method, prefix, out_f, in_f)
                self._parts = {
                    "weight_packed": packed,
                    "weight_scale": scale,
                    "weight_scale_2": np.array(s2),
                    "input_scale": np.array(np.float32(1.0) / INPUT_GLOBAL_SCALE),
                }
            else:
                packed, scale, g = ct_parts(self.seed, self.method, prefix, out_f, in_f)
                self._parts = {
                    "weight_packed": packed,
                    "weight_scale": scale,
                    "weight_global_scale": np.array([g], np.float32),
                    "input_global_scale": np.array([INPUT_GLOBAL_SCALE], np.float32),
                }
        return self._parts[info.role]


def tensor_chunks(info: TensorInfo, seed: int, hidden: int, linears: LinearParts) -> Iterator[np.ndarray]:
    """The bytes of one inventory tensor (bf16 as uint16 chunks, linear parts whole)."""
    if info.role == "bf16":
        yield from bf16_chunks(info, seed, hidden)
    else:
        yield linears.part(info)
