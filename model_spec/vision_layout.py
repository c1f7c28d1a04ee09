"""Model-spec stage (shared bottom): the vision tower's artifact layout, which the repack writes and the
`vision_encode` step program reads: padded widths, tensor names, shapes and dtypes, and the largest image.

The tower's widths do not all fit the 64-wide GEMM and attention tiles (the real tower: head_dim 72, intermediate
4304; the tiny one: hidden 144 too). Each is padded to a multiple of 64 with zeros, which keeps every product exact:
a zero weight column meets a zero activation column, a zero gate|up row gives gelu(0) * 0 = 0, a zero q/k/v channel
adds nothing to a score and yields a zero output channel.
  HP = pad(hidden)                GEMM activations [rows, HP] (f16, columns past hidden zero)
  DP = pad(head_dim)              attention q / k / v bf16 [rows, heads, DP]; o_proj's K = heads * DP
  IP = pad(intermediate)          gate|up -> [rows, IP] f16; down's K = IP
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import ModelSpec
from .weight_layout import TILE_K

TILE = TILE_K  # widths pad to the GEMMs' step, a multiple of the tile's rows too and the attention's head-dim tile
# The largest soft-token budget an image may take (HF Gemma4ImageProcessor's max_soft_tokens choices: 70 .. 1120),
# so at most 9 * 1120 = 10080 patches an image. The vision_encode program runs one image of N soft tokens, or B
# images of one patch grid back to back (B N <= MAX_SOFT_TOKENS: the activations sized for the largest image hold them).
MAX_SOFT_TOKENS = 1120
MAX_ENCODE_IMAGES = 4  # the most images one encode takes (four of 280 soft tokens fill the activations)
VISION_ENCODE = "vision.encode"  # the program's key (one image)


def vision_encode_key(images: int) -> str:
    """The program that encodes `images` images of one patch grid at once (rows: an image's soft tokens)."""
    return VISION_ENCODE if images == 1 else f"{VISION_ENCODE} images={images}"


def encode_images_limit(soft_tokens: int) -> int:
    """The most images of `soft_tokens` soft tokens one encode takes: within MAX_ENCODE_IMAGES and the
    activations (MAX_SOFT_TOKENS soft tokens in all)."""
    return max(1, min(MAX_ENCODE_IMAGES, MAX_SOFT_TOKENS // max(1, soft_tokens)))


def pad(n: int) -> int:
    return -(-n // TILE) * TILE


@dataclass(frozen=True)
class VisionDims:
    hidden: int
    heads: int
    head_dim: int
    intermediate: int
    layers: int
    patch_dim: int
    pool: int
    table: int
    text_hidden: int
    eps: float
    theta: float

    @property
    def hp(self) -> int:
        return pad(self.hidden)

    @property
    def dp(self) -> int:
        return pad(self.head_dim)

    @property
    def ip(self) -> int:
        return pad(self.intermediate)

    @property
    def pool_rows(self) -> int:
        """Patches a soft token pools."""
        return self.pool * self.pool

    @property
    def max_patches(self) -> int:
        return self.pool_rows * MAX_SOFT_TOKENS


def vision_dims(spec: ModelSpec) -> VisionDims:
    v = spec.vision
    if v is None:
        raise ValueError(f"model {spec.name} has no vision tower")
    if v.num_attention_heads * v.head_dim != v.hidden_size:
        raise ValueError(f"vision: {v.num_attention_heads} heads x {v.head_dim} != hidden {v.hidden_size}")
    return VisionDims(
        v.hidden_size,
        v.num_attention_heads,
        v.head_dim,
        v.intermediate_size,
        v.num_hidden_layers,
        v.patch_dim,
        v.pooling_kernel_size,
        v.position_embedding_size,
        spec.target.hidden_size,
        v.rms_norm_eps,
        v.rope_theta,
    )


# Artifact tensors (name -> (shape, dtype)). "half": fp16 in layouts.pack_half's GEMM layout (gate|up interleaved in
# 8-row tiles, layouts.pack_half_gate_up); "bf16" / "f32": plain row-major.
PATCH_PROJ, POS_TABLE, STD_BIAS, STD_SCALE, PROJECTION = (
    "vision.patch_proj",
    "vision.pos_table",
    "vision.std_bias",
    "vision.std_scale",
    "vision.projection",
)
LAYER_NORMS = ("input_norm", "post_attention_norm", "pre_feedforward_norm", "post_feedforward_norm")


def layer_prefix(layer: int) -> str:
    return f"vision.layers.{layer}."


def vision_tensors(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    d = vision_dims(spec)
    out = {PATCH_PROJ: ((d.hidden, d.patch_dim), "half"), POS_TABLE: ((2, d.table, d.hidden), "bf16")}
    for l in range(d.layers):
        p = layer_prefix(l)
        out.update(
            {
                p + "qkv": ((3 * d.hidden, d.hp), "half"),
                p + "o": ((d.hidden, d.heads * d.dp), "half"),
                p + "gate_up": ((2 * d.ip, d.hp), "half"),
                p + "down": ((d.hidden, d.ip), "half"),
                p + "q_norm": ((d.head_dim,), "bf16"),
                p + "k_norm": ((d.head_dim,), "bf16"),
            }
        )
        out.update({p + n: ((d.hidden,), "bf16") for n in LAYER_NORMS})
    out.update(
        {STD_BIAS: ((d.hidden,), "f32"), STD_SCALE: ((d.hidden,), "f32"), PROJECTION: ((d.text_hidden, d.hp), "half")}
    )
    return out


# Activations of the program (name -> (row width, dtype) per patch row, or per soft-token row for the pooled ones):
# the runtime sizes them for max_patches / MAX_SOFT_TOKENS rows.
PATCH_ACTS = {
    "vis_patches": ("patch_dim", "u8"),  # the image's uint8 pixels, as preprocessing leaves them
    "vis_pos": (2, "i32"),
    "vis_pin": ("patch_dim", "f16"),
    "vis_x": ("hidden", "f32"),
    "vis_y": ("hidden", "f32"),
    "vis_a": ("hp", "f16"),
    "vis_qkv": ("3hidden", "f32"),
    "vis_q": ("heads_dp", "bf16"),
    "vis_k": ("heads_dp", "bf16"),
    "vis_v": ("heads_dp", "bf16"),
    "vis_attn": ("heads_dp", "f16"),
    "vis_act": ("ip", "f16"),
}
TOKEN_ACTS = {"vis_pooled": ("hp", "f16"), "vis_out": ("text_hidden", "f32")}


def act_width(d: VisionDims, width) -> int:
    return {
        "patch_dim": d.patch_dim,
        "hidden": d.hidden,
        "hp": d.hp,
        "3hidden": 3 * d.hidden,
        "heads_dp": d.heads * d.dp,
        "ip": d.ip,
        "text_hidden": d.text_hidden,
    }.get(width, width)
