"""Model spec stage: frozen dataclasses that describe the Gemma-4 text decoder and the DFlash drafter completely.

Field names are the HF `config.json` keys, so a spec reads like the checkpoint it came from.
Dimension glossary used in shape comments across thorgen:
  T tokens, H hidden_size, V vocab_size, Hq query heads, Hkv KV heads, D head dim, E experts, K top-k experts,
  I dense intermediate_size, Ie moe_intermediate_size, B draft block size, L layers.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

SLIDING = "sliding_attention"
FULL = "full_attention"


class SpecError(ValueError):
    """A config that thorgen cannot run: names the key and what is supported."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # "default" (all dims rotate) or "proportional" (first partial_rotary_factor*D/2 freqs rotate)
    rope_theta: float
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "proportional"):
            raise SpecError(f"rope_type {self.rope_type!r} is not supported (default, proportional)")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise SpecError(f"partial_rotary_factor {self.partial_rotary_factor} must lie in (0, 1]")

    def inv_freq(self, head_dim: int) -> list[float]:
        """Per-pair inverse frequencies (length head_dim/2); zeros for pairs that do not rotate."""
        half = head_dim // 2
        if self.rope_type == "default":
            return [1.0 / self.rope_theta ** (2 * j / head_dim) for j in range(half)]
        # proportional: the exponent's denominator is the full head_dim; only the first rope_angles pairs rotate.
        rope_angles = int(self.partial_rotary_factor * head_dim // 2)
        return [1.0 / self.rope_theta ** (2 * j / head_dim) if j < rope_angles else 0.0 for j in range(half)]


@dataclass(frozen=True)
class Gemma4TextSpec:
    """The Gemma-4 text decoder (`text_config` of the checkpoint)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    sliding_window: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    attention_k_eq_v: bool
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k_experts: int
    rope_parameters: tuple[tuple[str, RopeSpec], ...]  # (layer type, rope) pairs; a tuple keeps the spec hashable
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    hidden_activation: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 262144
    bos_token_id: int = 2
    eos_token_id: int = 1
    pad_token_id: int = 0
    enable_moe_block: bool = True
    hidden_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise SpecError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {SLIDING, FULL})
        if bad:
            raise SpecError(f"layer_types {bad} not supported (sliding_attention, full_attention)")
        unsupported = {
            "hidden_size_per_layer_input": (self.hidden_size_per_layer_input, 0, "per-layer embeddings (PLE)"),
            "num_kv_shared_layers": (self.num_kv_shared_layers, 0, "KV sharing between layers"),
            "use_double_wide_mlp": (self.use_double_wide_mlp, False, "double-wide MLP"),
            "attention_bias": (self.attention_bias, False, "attention biases"),
            "enable_moe_block": (self.enable_moe_block, True, "a model without the MoE block"),
            "hidden_activation": (
                self.hidden_activation,
                "gelu_pytorch_tanh",
                "activations other than gelu_pytorch_tanh",
            ),
            "tie_word_embeddings": (self.tie_word_embeddings, True, "an untied lm_head"),
        }
        for key, (value, want, what) in unsupported.items():
            if value != want:
                raise SpecError(f"{key}={value!r}: thorgen does not support {what} (expected {want!r})")
        if not 0 < self.top_k_experts <= self.num_experts:
            raise SpecError(f"top_k_experts {self.top_k_experts} must lie in 1..num_experts ({self.num_experts})")
        for name in ("hidden_size", "intermediate_size", "moe_intermediate_size"):
            if getattr(self, name) % 16:
                raise SpecError(f"{name}={getattr(self, name)} must be a multiple of 16 (the NVFP4 group size)")
        for layer_type, (heads, kv) in {
            SLIDING: (self.num_attention_heads, self.num_key_value_heads),
            FULL: (self.num_attention_heads, self.num_global_key_value_heads),
        }.items():
            if kv <= 0 or heads % kv:
                raise SpecError(f"{layer_type}: {heads} query heads are not a multiple of {kv} KV heads")
        types = dict(self.rope_parameters)
        for layer_type in set(self.layer_types):
            if layer_type not in types:
                raise SpecError(f"rope_parameters has no entry for {layer_type}")
        if self.sliding_window <= 0:
            raise SpecError(f"sliding_window {self.sliding_window} must be positive")

    # ---- per-layer geometry -------------------------------------------------------------------------------------
    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.is_full(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_global_key_value_heads if self.is_full(layer) else self.num_key_value_heads

    def layer_has_v_proj(self, layer: int) -> bool:
        """Full layers with attention_k_eq_v reuse the raw k projection as V."""
        return not (self.is_full(layer) and self.attention_k_eq_v)

    def layer_rope(self, layer: int) -> RopeSpec:
        return dict(self.rope_parameters)[self.layer_types[layer]]

    def layer_window(self, layer: int) -> int | None:
        """Keys j visible to query i iff 0 <= i - j < window (None: plain causal)."""
        return None if self.is_full(layer) else self.sliding_window

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5


@dataclass(frozen=True)
class DFlashSpec:
    """The DFlash block-diffusion drafter (a Qwen3-style stack fed by target hidden-state taps)."""

    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    sliding_window: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    vocab_size: int
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    final_logit_softcapping: float | None = 30.0
    input_embedding_scale: float | None = None  # None: sqrt(hidden_size), the Gemma normaliser (vLLM PR #41703)
    attention_bias: bool = False

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise SpecError(
                f"drafter layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if set(self.layer_types) - {SLIDING, FULL}:
            raise SpecError(f"drafter layer_types {sorted(set(self.layer_types))} not supported")
        if self.hidden_act != "silu":
            raise SpecError(f"drafter hidden_act {self.hidden_act!r} not supported (silu)")
        if self.attention_bias:
            raise SpecError("drafter attention_bias=True is not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise SpecError("drafter query heads must be a multiple of its KV heads")
        if not 2 <= self.block_size <= 64:
            raise SpecError(f"drafter block_size {self.block_size} must lie in 2..64")
        if not self.target_layer_ids or any(not 0 <= i < self.num_target_layers for i in self.target_layer_ids):
            raise SpecError(f"target_layer_ids {self.target_layer_ids} must lie in 0..{self.num_target_layers - 1}")

    @property
    def embed_scale(self) -> float:
        return self.hidden_size**0.5 if self.input_embedding_scale is None else self.input_embedding_scale

    def is_causal(self, layer: int) -> bool:
        """Hybrid DFlash: sliding layers are causal within the block, the full layer is bidirectional."""
        return self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


LINEAR_FORMATS = ("nvfp4", "bf16")


@dataclass(frozen=True)
class LinearFormats:
    """The storage format of the target's linears, per role, as the checkpoint ships them (or as `--quantize`
    rewrites them): `nvfp4` (packed E2M1 + e4m3 block scales + a per-tensor multiplier) or `bf16`. The roles are
    the attention projections (q/k/v/o), the dense MLP (gate/up/down) and the MoE experts; the router, norms,
    embeddings (and so the tied lm_head) and the vision tower are never quantized in any supported checkpoint.
    One format per role for every layer: a checkpoint that mixes formats within a role is refused."""

    attention: str = "nvfp4"
    dense_mlp: str = "nvfp4"
    experts: str = "nvfp4"

    def __post_init__(self) -> None:
        for role in ("attention", "dense_mlp", "experts"):
            if getattr(self, role) not in LINEAR_FORMATS:
                raise SpecError(f"linear format {role}={getattr(self, role)!r}: expected one of {LINEAR_FORMATS}")

    @property
    def all_nvfp4(self) -> bool:
        return self == LinearFormats()


ALL_NVFP4 = LinearFormats()
ALL_BF16 = LinearFormats("bf16", "bf16", "bf16")
EXPERTS_ONLY_NVFP4 = LinearFormats("bf16", "bf16", "nvfp4")


@dataclass(frozen=True)
class Gemma4VisionSpec:
    """The Gemma-4 vision tower (`vision_config`) and the image token ids of the top-level config: a ViT over
    16x16 patches with x/y position tables, 2-D RoPE, 3x3 average pooling and a projection into the text model."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    video_token_id: int
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    standardize: bool = True
    default_output_length: int = 280
    hidden_activation: str = "gelu_pytorch_tanh"

    @property
    def placeholder_ids(self) -> tuple[int, int]:
        """The ids whose rows the tower's soft tokens replace: an image's and a video frame's."""
        return (self.image_token_id, self.video_token_id)

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise SpecError(f"vision head_dim {self.head_dim} must be a multiple of 4 (two rotate-half halves)")
        if self.hidden_activation != "gelu_pytorch_tanh":
            raise SpecError(f"vision hidden_activation {self.hidden_activation!r} not supported (gelu_pytorch_tanh)")
        if not self.standardize:
            raise SpecError("vision standardize=False is not supported")

    @property
    def patch_dim(self) -> int:
        """Values per patch: patch_size^2 RGB pixels, in (py, px, c) order."""
        return self.patch_size * self.patch_size * 3


@dataclass(frozen=True)
class ModelSpec:
    """A target model plus (optionally) its drafter: the unit that codegen plans and the runtime runs."""

    name: str
    target: Gemma4TextSpec
    drafter: DFlashSpec | None = field(default=None)
    vision: Gemma4VisionSpec | None = field(default=None)
    linear_formats: LinearFormats = field(default=ALL_NVFP4)

    def __post_init__(self) -> None:
        d = self.drafter
        if d is None:
            return
        t = self.target
        if d.hidden_size != t.hidden_size:
            raise SpecError(f"drafter hidden_size {d.hidden_size} != target hidden_size {t.hidden_size}")
        if d.vocab_size != t.vocab_size:
            raise SpecError(f"drafter vocab_size {d.vocab_size} != target vocab_size {t.vocab_size}")
        if d.num_target_layers != t.num_hidden_layers:
            raise SpecError(f"drafter num_target_layers {d.num_target_layers} != target layers {t.num_hidden_layers}")

    def to_json(self) -> str:
        """Canonical JSON of the numerics-relevant fields (the display name is left out)."""
        body = {"target": asdict(self.target), "drafter": None if self.drafter is None else asdict(self.drafter)}
        # Keys added later appear only when they differ from the default, so older specs keep their hashes.
        if self.vision is not None:
            body["vision"] = asdict(self.vision)
        if not self.linear_formats.all_nvfp4:
            body["linear_formats"] = asdict(self.linear_formats)
        return json.dumps(body, sort_keys=True, separators=(",", ":"))

    @property
    def spec_hash(self) -> str:
        """sha256 of the canonical JSON of every numerics field: stable across runs and machines."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()
