"""Model spec stage: the tensor inventory (name, dtype, shape, role) of the target and drafter checkpoints.

One table serves checkpoint validation, synthetic checkpoints, repack and codegen. Names follow the HF Gemma-4
layout (`model.language_model.` prefix, experts stored unfused per expert), each linear in its checkpoint's storage
(compressed-tensors or ModelOpt NVFP4, or bf16; see model_spec/formats.py), the vision tower `model.vision_tower.`
and its projection `model.embed_vision.` (bf16 in every format), and the z-lab DFlash layout (no prefix, bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from .types import ALL_NVFP4, DFlashSpec, Gemma4TextSpec, Gemma4VisionSpec, LinearFormats
from .weight_layout import GROUP

TARGET_PREFIX = "model.language_model."
VISION_PREFIX = "model.vision_tower."
VISION_PROJECTION = "model.embed_vision.embedding_projection"

# Tensors a multimodal checkpoint carries that thorgen does not use (validated as present-or-absent); the vision
# tower's are only ignored when the spec has no tower (a config without vision_config).
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
VISION_PREFIXES = (VISION_PREFIX, "model.embed_vision.")
IGNORED_PREFIXES = VISION_PREFIXES + AUDIO_PREFIXES


def ignored_prefixes(vision: Gemma4VisionSpec | None) -> tuple[str, ...]:
    """Name prefixes whose tensors may be present or absent: audio always, the vision tower without a spec."""
    return AUDIO_PREFIXES if vision is not None else IGNORED_PREFIXES


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: BF16, U8, F8_E4M3, F32
    shape: tuple[int, ...]
    role: str  # "bf16" plain weight, "linear_bf16" a target linear kept bf16, "kv_scale", or the NVFP4 part role
    optional: bool = False
    also_f32: bool = False  # the file may store it as F32 instead (the tower's std_bias / std_scale buffers)

    def accepts(self, dtype: str) -> bool:
        return dtype == self.dtype or (self.also_f32 and dtype == "F32")

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"BF16": 2, "U8": 1, "F8_E4M3": 1, "F32": 4}[self.dtype]


STORAGES = ("compressed-tensors", "modelopt", "bf16")


@dataclass(frozen=True)
class Linear:
    """One projection `y = x @ W.T` with W [out_features, in_features], stored as `storage`: bf16, or NVFP4 in
    the compressed-tensors (divisor global scale [1]) or ModelOpt (0-d multiplier weight_scale_2) naming."""

    prefix: str  # full tensor-name prefix, e.g. model.language_model.layers.0.self_attn.q_proj
    out_features: int
    in_features: int
    storage: str = "compressed-tensors"
    target: bool = True  # a target linear (its bf16 form has role linear_bf16); False for the drafter's

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ValueError(f"linear storage {self.storage!r}: expected one of {STORAGES}")

    @property
    def quantized(self) -> bool:
        return self.storage != "bf16"

    def tensors(self) -> list[TensorInfo]:
        o, i = self.out_features, self.in_features
        if self.storage == "bf16":
            return [TensorInfo(f"{self.prefix}.weight", "BF16", (o, i), "linear_bf16" if self.target else "bf16")]
        if self.storage == "modelopt":
            return [
                TensorInfo(f"{self.prefix}.weight", "U8", (o, i // 2), "weight_packed"),
                TensorInfo(f"{self.prefix}.weight_scale", "F8_E4M3", (o, i // GROUP), "weight_scale"),
                TensorInfo(f"{self.prefix}.weight_scale_2", "F32", (), "weight_scale_2"),
                TensorInfo(f"{self.prefix}.input_scale", "F32", (), "input_scale", optional=True),
            ]
        return [
            TensorInfo(f"{self.prefix}.weight_packed", "U8", (o, i // 2), "weight_packed"),
            TensorInfo(f"{self.prefix}.weight_scale", "F8_E4M3", (o, i // GROUP), "weight_scale"),
            TensorInfo(f"{self.prefix}.weight_global_scale", "F32", (1,), "weight_global_scale"),
            TensorInfo(f"{self.prefix}.input_global_scale", "F32", (1,), "input_global_scale", optional=True),
        ]


def layer_prefix(layer: int) -> str:
    return f"{TARGET_PREFIX}layers.{layer}."


def target_linears(
    spec: Gemma4TextSpec, layer: int, source: str = "compressed-tensors", formats: LinearFormats = ALL_NVFP4
) -> list[Linear]:
    """Every projection of one decoder layer, in dataflow order (attention, dense MLP, experts), each stored as
    its role's format says (`source` names the NVFP4 layout; a bf16 role is plain bf16 in any source)."""
    p, h = layer_prefix(layer), spec.hidden_size
    hd, nq, nkv = spec.layer_head_dim(layer), spec.num_attention_heads, spec.layer_kv_heads(layer)
    nvfp4 = "compressed-tensors" if source == "bf16" else source
    att, mlp, exp = (nvfp4 if f == "nvfp4" else "bf16" for f in (formats.attention, formats.dense_mlp, formats.experts))
    out = [Linear(f"{p}self_attn.q_proj", nq * hd, h, att), Linear(f"{p}self_attn.k_proj", nkv * hd, h, att)]
    if spec.layer_has_v_proj(layer):
        out.append(Linear(f"{p}self_attn.v_proj", nkv * hd, h, att))
    out.append(Linear(f"{p}self_attn.o_proj", h, nq * hd, att))
    i = spec.intermediate_size
    out += [
        Linear(f"{p}mlp.gate_proj", i, h, mlp),
        Linear(f"{p}mlp.up_proj", i, h, mlp),
        Linear(f"{p}mlp.down_proj", h, i, mlp),
    ]
    ie = spec.moe_intermediate_size
    for e in range(spec.num_experts):
        out += [
            Linear(f"{p}experts.{e}.gate_proj", ie, h, exp),
            Linear(f"{p}experts.{e}.up_proj", ie, h, exp),
            Linear(f"{p}experts.{e}.down_proj", h, ie, exp),
        ]
    return out


LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm",
    "post_feedforward_layernorm_1",
    "post_feedforward_layernorm_2",
)


def target_layer_tensors(
    spec: Gemma4TextSpec, layer: int, source: str = "compressed-tensors", formats: LinearFormats = ALL_NVFP4
) -> list[TensorInfo]:
    p, h, hd = layer_prefix(layer), spec.hidden_size, spec.layer_head_dim(layer)
    out = [t for lin in target_linears(spec, layer, source, formats) for t in lin.tensors()]
    if source == "modelopt":  # FP8 KV-cache scales a ModelOpt export may carry (k_eq_v layers have no v_proj)
        out.append(TensorInfo(f"{p}self_attn.k_proj.k_scale", "F32", (), "kv_scale", optional=True))
        if spec.layer_has_v_proj(layer):
            out.append(TensorInfo(f"{p}self_attn.v_proj.v_scale", "F32", (), "kv_scale", optional=True))
    out += [
        TensorInfo(f"{p}self_attn.q_norm.weight", "BF16", (hd,), "bf16"),
        TensorInfo(f"{p}self_attn.k_norm.weight", "BF16", (hd,), "bf16"),
    ]
    out += [TensorInfo(f"{p}{n}.weight", "BF16", (h,), "bf16") for n in LAYER_NORMS]
    out += [
        TensorInfo(f"{p}router.proj.weight", "BF16", (spec.num_experts, h), "bf16"),
        TensorInfo(f"{p}router.scale", "BF16", (h,), "bf16"),
        TensorInfo(f"{p}router.per_expert_scale", "BF16", (spec.num_experts,), "bf16"),
        TensorInfo(f"{p}layer_scalar", "BF16", (1,), "bf16"),
    ]
    return out


def target_tensors(
    spec: Gemma4TextSpec, source: str = "compressed-tensors", formats: LinearFormats = ALL_NVFP4
) -> list[TensorInfo]:
    """Every tensor of the text model in a checkpoint of this source format and per-role linear formats (default:
    RedHatAI's compressed-tensors NVFP4); tied lm_head: no lm_head tensor."""
    out = [TensorInfo(f"{TARGET_PREFIX}embed_tokens.weight", "BF16", (spec.vocab_size, spec.hidden_size), "bf16")]
    for layer in range(spec.num_hidden_layers):
        out += target_layer_tensors(spec, layer, source, formats)
    out.append(TensorInfo(f"{TARGET_PREFIX}norm.weight", "BF16", (spec.hidden_size,), "bf16"))
    return out


def drafter_linears(spec: DFlashSpec, layer: int) -> list[Linear]:
    p, h = f"layers.{layer}.", spec.hidden_size
    hd, nq, nkv, i = spec.head_dim, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size
    shapes = (
        ("self_attn.q_proj", nq * hd, h),
        ("self_attn.k_proj", nkv * hd, h),
        ("self_attn.v_proj", nkv * hd, h),
        ("self_attn.o_proj", h, nq * hd),
        ("mlp.gate_proj", i, h),
        ("mlp.up_proj", i, h),
        ("mlp.down_proj", h, i),
    )
    return [Linear(p + name, o, k, "bf16", target=False) for name, o, k in shapes]


def drafter_tensors(spec: DFlashSpec) -> list[TensorInfo]:
    """Every tensor of a z-lab DFlash drafter (bf16; embedding and lm_head are shared from the target)."""
    h = spec.hidden_size
    out = [
        TensorInfo("fc.weight", "BF16", (h, len(spec.target_layer_ids) * h), "bf16"),
        TensorInfo("hidden_norm.weight", "BF16", (h,), "bf16"),
    ]
    for layer in range(spec.num_hidden_layers):
        out += [t for lin in drafter_linears(spec, layer) for t in lin.tensors()]
        out += [
            TensorInfo(f"layers.{layer}.self_attn.q_norm.weight", "BF16", (spec.head_dim,), "bf16"),
            TensorInfo(f"layers.{layer}.self_attn.k_norm.weight", "BF16", (spec.head_dim,), "bf16"),
            TensorInfo(f"layers.{layer}.input_layernorm.weight", "BF16", (h,), "bf16"),
            TensorInfo(f"layers.{layer}.post_attention_layernorm.weight", "BF16", (h,), "bf16"),
        ]
    out.append(TensorInfo("norm.weight", "BF16", (h,), "bf16"))
    return out


VISION_LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def vision_linears(spec: Gemma4VisionSpec, layer: int) -> list[Linear]:
    """The bf16 projections of one vision encoder layer (q, k, v, o, gate, up, down; no grouped-query attention)."""
    p = f"{VISION_PREFIX}encoder.layers.{layer}."
    h, hd, i = spec.hidden_size, spec.head_dim, spec.intermediate_size
    inner = spec.num_attention_heads * hd
    shapes = (
        ("self_attn.q_proj", inner, h),
        ("self_attn.k_proj", inner, h),
        ("self_attn.v_proj", inner, h),
        ("self_attn.o_proj", h, inner),
        ("mlp.gate_proj", i, h),
        ("mlp.up_proj", i, h),
        ("mlp.down_proj", h, i),
    )
    return [Linear(f"{p}{name}.linear", o, k, "bf16", target=False) for name, o, k in shapes]


def vision_tensors(spec: Gemma4VisionSpec, text_hidden: int) -> list[TensorInfo]:
    """Every tensor of the vision tower and its projection into the text model (bf16, never quantized):
    13 per encoder layer, the patch projection and x/y position tables, the standardize buffers, the projection."""
    h = spec.hidden_size
    out = Linear(f"{VISION_PREFIX}patch_embedder.input_proj", h, spec.patch_dim, "bf16", target=False).tensors()
    out.append(
        TensorInfo(
            f"{VISION_PREFIX}patch_embedder.position_embedding_table",
            "BF16",
            (2, spec.position_embedding_size, h),
            "bf16",
        )
    )
    for layer in range(spec.num_hidden_layers):
        p = f"{VISION_PREFIX}encoder.layers.{layer}."
        out += [t for lin in vision_linears(spec, layer) for t in lin.tensors()]
        out += [TensorInfo(f"{p}self_attn.{n}.weight", "BF16", (spec.head_dim,), "bf16") for n in ("q_norm", "k_norm")]
        out += [TensorInfo(f"{p}{n}.weight", "BF16", (h,), "bf16") for n in VISION_LAYER_NORMS]
    out += [
        TensorInfo(f"{VISION_PREFIX}std_bias", "BF16", (h,), "bf16", also_f32=True),
        TensorInfo(f"{VISION_PREFIX}std_scale", "BF16", (h,), "bf16", also_f32=True),
    ]
    out += Linear(VISION_PROJECTION, text_hidden, h, "bf16", target=False).tensors()
    return out


def quantization_ignore(vision: Gemma4VisionSpec | None) -> list[str]:
    """The vision Linears the real config's quantization `ignore` list names (module paths, no `.weight`)."""
    if vision is None:
        return []
    names = [f"{VISION_PREFIX}patch_embedder.input_proj"]
    names += [lin.prefix for layer in range(vision.num_hidden_layers) for lin in vision_linears(vision, layer)]
    return names + [VISION_PROJECTION]
