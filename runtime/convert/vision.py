"""Runtime stage (convert): the vision tower's checkpoint tensors rewritten into the artifact's layout
(model_spec/vision_layout.py): fp16 GEMM weights in layouts.pack_half's order, zero-padded to the tiles (the q|k|v
rows fused, o_proj's columns per head to DP, gate|up interleaved and padded to IP, every K to its padded width),
norms and the position tables bf16 as stored, the standardize vectors f32."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ...model_spec.tensors import VISION_LAYER_NORMS, VISION_PREFIX, VISION_PROJECTION
from ...model_spec.types import ModelSpec
from ...model_spec.vision_layout import (
    LAYER_NORMS,
    PATCH_PROJ,
    POS_TABLE,
    PROJECTION,
    STD_BIAS,
    STD_SCALE,
    layer_prefix,
    vision_dims,
    vision_tensors,
)
from .layouts import bf16_to_f16_bits, pack_half, pack_half_gate_up


def _pad_bits(w: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """fp16 bits [n, k] zero-padded (0x0000 = +0.0) to [rows, cols]."""
    out = np.zeros((rows, cols), np.uint16)
    out[: w.shape[0], : w.shape[1]] = w
    return out


def vision_arrays(
    spec: ModelSpec, bf16: Callable[[str], np.ndarray], f32: Callable[[str], np.ndarray]
) -> dict[str, np.ndarray]:
    """The artifact's vision tensors (name -> array: uint16 fp16 / bf16 bits, or float32) from a checkpoint's
    tensors: `bf16(name)` the raw bf16 bits, `f32(name)` a BF16 or F32 tensor as float32."""
    d = vision_dims(spec)

    def half(name: str, rows: int, cols: int) -> np.ndarray:
        return _pad_bits(bf16_to_f16_bits(np.asarray(bf16(name + ".weight"))), rows, cols)

    out = {
        PATCH_PROJ: pack_half(half(f"{VISION_PREFIX}patch_embedder.input_proj", d.hidden, d.patch_dim)),
        POS_TABLE: np.ascontiguousarray(bf16(f"{VISION_PREFIX}patch_embedder.position_embedding_table")),
    }
    for l in range(d.layers):
        src, dst = f"{VISION_PREFIX}encoder.layers.{l}.", layer_prefix(l)
        qkv = [half(f"{src}self_attn.{p}_proj.linear", d.hidden, d.hp) for p in "qkv"]
        o = half(f"{src}self_attn.o_proj.linear", d.hidden, d.hidden).reshape(d.hidden, d.heads, d.head_dim)
        o = _pad_bits(o.reshape(d.hidden * d.heads, d.head_dim), d.hidden * d.heads, d.dp)
        out[dst + "qkv"] = pack_half(np.concatenate(qkv))
        out[dst + "o"] = pack_half(o.reshape(d.hidden, d.heads * d.dp))
        out[dst + "gate_up"] = pack_half_gate_up(
            half(f"{src}mlp.gate_proj.linear", d.ip, d.hp), half(f"{src}mlp.up_proj.linear", d.ip, d.hp)
        )
        out[dst + "down"] = pack_half(half(f"{src}mlp.down_proj.linear", d.hidden, d.ip))
        for p in ("q_norm", "k_norm"):
            out[dst + p] = np.ascontiguousarray(bf16(f"{src}self_attn.{p}.weight"))
        for ours, theirs in zip(LAYER_NORMS, VISION_LAYER_NORMS):
            out[dst + ours] = np.ascontiguousarray(bf16(f"{src}{theirs}.weight"))
    out[STD_BIAS] = np.asarray(f32(f"{VISION_PREFIX}std_bias"), np.float32)
    out[STD_SCALE] = np.asarray(f32(f"{VISION_PREFIX}std_scale"), np.float32)
    out[PROJECTION] = pack_half(half(VISION_PROJECTION, d.text_hidden, d.hp))
    for name, (shape, _) in vision_tensors(spec).items():
        if out[name].size != int(np.prod(shape)):
            raise AssertionError(f"{name}: {out[name].size} elements, the layout says {shape}")
    return out
