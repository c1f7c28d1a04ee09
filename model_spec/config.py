"""Model spec stage: HF `config.json` dicts <-> frozen specs, and the shipped presets.

`spec_from_configs` is the one way a spec is made from a checkpoint; the presets go through the same path
(`preset_configs` returns the dicts a checkpoint of that preset carries), so what synth-checkpoint writes
is exactly what the loader reads back.
"""

from __future__ import annotations

from typing import Any

from .types import (
    ALL_NVFP4,
    FULL,
    SLIDING,
    DFlashSpec,
    Gemma4TextSpec,
    Gemma4VisionSpec,
    LinearFormats,
    ModelSpec,
    RopeSpec,
    SpecError,
)
from .formats import CT_FORMAT
from .tensors import quantization_ignore
from .weight_layout import GROUP

MODELOPT_VERSION = "0.47.0"  # the producer version written into synthetic ModelOpt configs


def _require(cfg: dict, key: str, where: str) -> Any:
    if key not in cfg:
        raise SpecError(f"{where}: missing key {key!r}")
    return cfg[key]


def text_spec_from_config(cfg: dict) -> Gemma4TextSpec:
    """Gemma-4 text spec from a checkpoint config (top-level `gemma4` with `text_config`, or `gemma4_text`)."""
    where = "config.json"
    if cfg.get("model_type") == "gemma4" or "text_config" in cfg:
        cfg = _require(cfg, "text_config", where)
        where = "config.json text_config"
    if cfg.get("model_type") not in (None, "gemma4_text"):
        raise SpecError(f"{where}: model_type {cfg.get('model_type')!r} is not gemma4_text")
    rope = _require(cfg, "rope_parameters", where)
    if not isinstance(rope, dict) or not rope:
        raise SpecError(f"{where}: rope_parameters must map layer types to rope settings")
    rope_specs = []
    for layer_type, params in sorted(rope.items()):
        rope_specs.append(
            (
                layer_type,
                RopeSpec(
                    rope_type=params.get("rope_type", "default"),
                    rope_theta=float(_require(params, "rope_theta", f"{where} rope")),
                    partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
                ),
            )
        )
    eos = cfg.get("eos_token_id", 1)
    eos = eos[0] if isinstance(eos, list) else eos
    required = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "layer_types",
        "sliding_window",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
    )
    for key in required:
        _require(cfg, key, where)
    return Gemma4TextSpec(
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        layer_types=tuple(cfg["layer_types"]),
        sliding_window=int(cfg["sliding_window"]),
        num_attention_heads=int(cfg["num_attention_heads"]),
        num_key_value_heads=int(cfg["num_key_value_heads"]),
        head_dim=int(cfg["head_dim"]),
        global_head_dim=int(cfg.get("global_head_dim") or cfg["head_dim"]),
        num_global_key_value_heads=int(cfg.get("num_global_key_value_heads") or cfg["num_key_value_heads"]),
        attention_k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
        intermediate_size=int(cfg["intermediate_size"]),
        moe_intermediate_size=int(_require(cfg, "moe_intermediate_size", where)),
        num_experts=int(_require(cfg, "num_experts", where)),
        top_k_experts=int(_require(cfg, "top_k_experts", where)),
        rope_parameters=tuple(rope_specs),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        hidden_activation=cfg.get("hidden_activation", "gelu_pytorch_tanh"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 262144)),
        bos_token_id=int(cfg.get("bos_token_id", 2)),
        eos_token_id=int(eos),
        pad_token_id=int(cfg.get("pad_token_id", 0)),
        enable_moe_block=bool(cfg.get("enable_moe_block", True)),
        hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0),
        num_kv_shared_layers=int(cfg.get("num_kv_shared_layers") or 0),
        use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def drafter_spec_from_config(cfg: dict, num_target_layers: int | None = None) -> DFlashSpec:
    where = "drafter config.json"
    dflash = _require(cfg, "dflash_config", where)
    if cfg.get("rope_scaling"):
        raise SpecError(f"{where}: rope_scaling {cfg['rope_scaling']!r} is not supported")
    n_layers = int(_require(cfg, "num_hidden_layers", where))
    layer_types = cfg.get("layer_types") or [SLIDING if cfg.get("use_sliding_window") else FULL] * n_layers
    return DFlashSpec(
        hidden_size=int(_require(cfg, "hidden_size", where)),
        num_hidden_layers=n_layers,
        layer_types=tuple(layer_types),
        num_attention_heads=int(_require(cfg, "num_attention_heads", where)),
        num_key_value_heads=int(_require(cfg, "num_key_value_heads", where)),
        head_dim=int(_require(cfg, "head_dim", where)),
        intermediate_size=int(_require(cfg, "intermediate_size", where)),
        sliding_window=int(cfg.get("sliding_window") or 2048),
        block_size=int(cfg.get("block_size", 16)),
        mask_token_id=int(_require(dflash, "mask_token_id", f"{where} dflash_config")),
        target_layer_ids=tuple(int(i) for i in _require(dflash, "target_layer_ids", f"{where} dflash_config")),
        num_target_layers=int(cfg.get("num_target_layers") or num_target_layers or 0),
        vocab_size=int(_require(cfg, "vocab_size", where)),
        rope_theta=float(cfg.get("rope_theta", 1e6)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        hidden_act=cfg.get("hidden_act", "silu"),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
        input_embedding_scale=dflash.get("input_embedding_scale"),
        attention_bias=bool(cfg.get("attention_bias", False)),
    )


def vision_spec_from_config(cfg: dict) -> Gemma4VisionSpec | None:
    """The vision tower of a Gemma-4 config.json (`vision_config` + the top-level image token ids); None if absent."""
    vc = cfg.get("vision_config")
    if vc is None:
        return None
    where = "config.json vision_config"
    if not isinstance(vc, dict):
        raise SpecError(f"{where} is not an object")
    heads = _require(vc, "num_attention_heads", where)
    if vc.get("num_key_value_heads", heads) != heads:
        raise SpecError(
            f"{where}: num_key_value_heads {vc['num_key_value_heads']} != num_attention_heads {heads} "
            "(the Gemma-4 tower has no grouped-query attention)"
        )
    if vc.get("use_clipped_linears", False):
        raise SpecError(f"{where}: use_clipped_linears=true is not supported")
    rope = vc.get("rope_parameters") or {}
    return Gemma4VisionSpec(
        hidden_size=_require(vc, "hidden_size", where),
        num_hidden_layers=_require(vc, "num_hidden_layers", where),
        num_attention_heads=heads,
        head_dim=_require(vc, "head_dim", where),
        intermediate_size=_require(vc, "intermediate_size", where),
        image_token_id=_require(cfg, "image_token_id", "config.json"),
        boi_token_id=_require(cfg, "boi_token_id", "config.json"),
        eoi_token_id=_require(cfg, "eoi_token_id", "config.json"),
        video_token_id=_require(cfg, "video_token_id", "config.json"),
        patch_size=vc.get("patch_size", 16),
        pooling_kernel_size=vc.get("pooling_kernel_size", 3),
        position_embedding_size=vc.get("position_embedding_size", 10240),
        rope_theta=float(rope.get("rope_theta", 100.0)),
        rms_norm_eps=vc.get("rms_norm_eps", 1e-6),
        standardize=bool(vc.get("standardize", True)),
        default_output_length=vc.get("default_output_length", 280),
        hidden_activation=vc.get("hidden_activation", "gelu_pytorch_tanh"),
    )


def spec_from_configs(target_cfg: dict, drafter_cfg: dict | None = None, name: str = "checkpoint") -> ModelSpec:
    target = text_spec_from_config(target_cfg)
    drafter = None if drafter_cfg is None else drafter_spec_from_config(drafter_cfg, target.num_hidden_layers)
    return ModelSpec(name=name, target=target, drafter=drafter, vision=vision_spec_from_config(target_cfg))


def vision_config(spec: Gemma4VisionSpec) -> dict:
    """The `vision_config` of a Gemma-4 config.json for this tower (the keys transformers reads)."""
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "default_output_length": spec.default_output_length,
        "dtype": "bfloat16",
        "global_head_dim": spec.head_dim,
        "head_dim": spec.head_dim,
        "hidden_activation": spec.hidden_activation,
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": 131072,
        "model_type": "gemma4_vision",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_attention_heads,
        "patch_size": spec.patch_size,
        "pooling_kernel_size": spec.pooling_kernel_size,
        "position_embedding_size": spec.position_embedding_size,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {"rope_theta": spec.rope_theta, "rope_type": "default"},
        "standardize": spec.standardize,
        "use_clipped_linears": False,
    }


def preprocessor_config(spec: Gemma4VisionSpec) -> dict:
    """The `preprocessor_config.json` of a Gemma-4 checkpoint (Gemma4ImageProcessor: no normalisation, the model
    maps [0, 1] to [-1, 1] itself; bicubic resize; the default soft-token budget)."""
    return {
        "do_convert_rgb": True,
        "do_normalize": False,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.0, 0.0, 0.0],
        "image_processor_type": "Gemma4ImageProcessor",
        "image_seq_length": spec.default_output_length,
        "image_std": [1.0, 1.0, 1.0],
        "max_soft_tokens": spec.default_output_length,
        "patch_size": spec.patch_size,
        "pooling_kernel_size": spec.pooling_kernel_size,
        "processor_class": "Gemma4Processor",
        "resample": 3,
        "rescale_factor": 1.0 / 255.0,
    }


# ---- writing configs (synth-checkpoint) ------------------------------------------------------------------------


def _nvfp4_scheme(dynamic: bool | str, observer: str) -> dict:
    return {
        "actorder": None,
        "block_structure": None,
        "dynamic": dynamic,
        "group_size": GROUP,
        "num_bits": 4,
        "observer": observer,
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn",
        "strategy": "tensor_group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }


def modelopt_exclusions(spec: Gemma4TextSpec, formats: LinearFormats) -> list[str]:
    """ModelOpt's exclude_modules for these per-role formats: per layer `self_attn*` / `mlp*` when that role is
    bf16, always `router*`, then lm_head and the vision tower (the exporter's shortest wildcards)."""
    out = []
    for i in range(spec.num_hidden_layers):
        p = f"model.language_model.layers.{i}."
        out += [p + "self_attn*"] if formats.attention == "bf16" else []
        out += [p + "mlp*"] if formats.dense_mlp == "bf16" else []
        out.append(p + "router*")
    return out + ["lm_head", "model.embed_vision*", "model.vision_tower*"]


def _modelopt_quantization(spec: Gemma4TextSpec, formats: LinearFormats) -> dict:
    scheme = {"dynamic": False, "group_size": GROUP, "num_bits": 4, "type": "float"}
    return {
        "config_groups": {"group_0": {"input_activations": scheme, "targets": ["Linear"], "weights": scheme}},
        "ignore": modelopt_exclusions(spec, formats),
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quant_algo": "NVFP4",
        "quant_method": "modelopt",
    }


def hf_quant_config(spec: Gemma4TextSpec, formats: LinearFormats) -> dict:
    """The `hf_quant_config.json` a ModelOpt NVFP4 export of this spec carries."""
    return {
        "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": "FP8",
            "group_size": GROUP,
            "exclude_modules": modelopt_exclusions(spec, formats),
        },
    }


def _ct_quantization(spec: Gemma4TextSpec, vision: Gemma4VisionSpec | None) -> dict:
    ignore = [f"model.language_model.layers.{i}.router.proj" for i in range(spec.num_hidden_layers)]
    ignore += quantization_ignore(vision) + ["lm_head"]
    return {
        "config_groups": {
            "group_0": {
                "format": CT_FORMAT,
                "input_activations": _nvfp4_scheme("local", "static_minmax"),
                "output_activations": None,
                "targets": ["Linear"],
                "weights": _nvfp4_scheme(False, "memoryless_minmax"),
            }
        },
        "format": CT_FORMAT,
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.14.1.a20260326",
    }


def target_config(
    spec: Gemma4TextSpec,
    vision: Gemma4VisionSpec | None = None,
    source: str = "compressed-tensors",
    formats: LinearFormats = ALL_NVFP4,
) -> dict:
    """The `config.json` of a checkpoint of this spec (vision_config null without a tower) in one source format:
    RedHatAI's compressed-tensors NVFP4 (every linear), NVIDIA's ModelOpt NVFP4 (`formats` says which roles stay
    bf16; hf_quant_config() is its second file) or Google's bf16 (no quantization_config)."""
    if source == "compressed-tensors" and not formats.all_nvfp4:
        raise SpecError(f"a compressed-tensors checkpoint quantizes every linear, not {formats}")
    quantization = {
        "compressed-tensors": lambda: _ct_quantization(spec, vision),
        "bf16": lambda: None,
        "modelopt": lambda: _modelopt_quantization(spec, formats),
    }.get(source)
    if quantization is None:
        raise SpecError(f"source format {source!r}: expected compressed-tensors, modelopt or bf16")
    text = {
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "attention_k_eq_v": spec.attention_k_eq_v,
        "bos_token_id": spec.bos_token_id,
        "dtype": "bfloat16",
        "enable_moe_block": spec.enable_moe_block,
        "eos_token_id": spec.eos_token_id,
        "final_logit_softcapping": spec.final_logit_softcapping,
        "global_head_dim": spec.global_head_dim,
        "head_dim": spec.head_dim,
        "hidden_activation": spec.hidden_activation,
        "hidden_size": spec.hidden_size,
        "hidden_size_per_layer_input": spec.hidden_size_per_layer_input,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "layer_types": list(spec.layer_types),
        "max_position_embeddings": spec.max_position_embeddings,
        "model_type": "gemma4_text",
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_attention_heads": spec.num_attention_heads,
        "num_experts": spec.num_experts,
        "num_global_key_value_heads": spec.num_global_key_value_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_kv_shared_layers": spec.num_kv_shared_layers,
        "pad_token_id": spec.pad_token_id,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": {
            t: ({"partial_rotary_factor": r.partial_rotary_factor} if r.rope_type == "proportional" else {})
            | {"rope_theta": r.rope_theta, "rope_type": r.rope_type}
            for t, r in spec.rope_parameters
        },
        "sliding_window": spec.sliding_window,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "top_k_experts": spec.top_k_experts,
        "use_bidirectional_attention": "vision",
        "use_cache": True,
        "use_double_wide_mlp": spec.use_double_wide_mlp,
        "vocab_size": spec.vocab_size,
        "vocab_size_per_layer_input": spec.vocab_size,
    }
    images = (
        {}
        if vision is None
        else {
            "boi_token_id": vision.boi_token_id,
            "eoi_token_id": vision.eoi_token_id,
            "image_token_id": vision.image_token_id,
            "video_token_id": vision.video_token_id,
            "vision_soft_tokens_per_image": vision.default_output_length,
        }
    )
    return (
        images
        | {
            "architectures": ["Gemma4ForConditionalGeneration"],
            "audio_config": None,
            "dtype": "bfloat16",
            "eos_token_id": [spec.eos_token_id, 106],
            "initializer_range": 0.02,
            "model_type": "gemma4",
        }
        | ({} if source == "bf16" else {"quantization_config": quantization()})
        | {
            "text_config": text,
            "tie_word_embeddings": spec.tie_word_embeddings,
            "transformers_version": "5.5.0",
            "vision_config": None if vision is None else vision_config(vision),
        }
    )


def drafter_config(spec: DFlashSpec, bos: int = 2, eos: int = 1, pad: int = 0) -> dict:
    """The `config.json` of a z-lab-layout DFlash drafter for this spec."""
    dflash: dict[str, Any] = {"mask_token_id": spec.mask_token_id, "target_layer_ids": list(spec.target_layer_ids)}
    if spec.input_embedding_scale is not None:
        dflash["input_embedding_scale"] = spec.input_embedding_scale
    return {
        "architectures": ["DFlashDraftModel"],
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "block_size": spec.block_size,
        "bos_token_id": bos,
        "dflash_config": dflash,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "final_logit_softcapping": spec.final_logit_softcapping,
        "head_dim": spec.head_dim,
        "hidden_act": spec.hidden_act,
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "layer_types": list(spec.layer_types),
        "max_position_embeddings": 262144,
        "max_window_layers": spec.num_hidden_layers,
        "model_type": "qwen3",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "num_target_layers": spec.num_target_layers,
        "pad_token_id": pad,
        "rms_norm_eps": spec.rms_norm_eps,
        "sliding_window": spec.sliding_window,
        "tie_word_embeddings": False,
        "transformers_version": "5.6.0",
        "use_cache": True,
        "use_sliding_window": True,
        "vocab_size": spec.vocab_size,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
    }
