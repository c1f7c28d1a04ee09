"""Model spec: presets, config round trips, validation errors, spec_hash stability and the tensor inventory."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from thorgen.model_spec import PRESETS, SpecError, get_preset, spec_from_configs
from thorgen.model_spec.config import drafter_config, target_config
from thorgen.model_spec.formats import detect_format
from thorgen.model_spec.tensors import drafter_tensors, target_tensors

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "seed_data" / "reference"


def _real_configs() -> tuple[dict, dict]:
    if not REFERENCE.is_dir():
        pytest.skip("../shared/seed_data is absent")
    return (
        json.loads((REFERENCE / "redhatai_nvfp4_config.json").read_text()),
        json.loads((REFERENCE / "dflash_draft_config.json").read_text()),
    )


def test_real_config_matches_full_preset() -> None:
    target, drafter = _real_configs()
    assert detect_format(target, None).source == "compressed-tensors"
    spec = spec_from_configs(target, drafter)
    assert spec.spec_hash == get_preset("gemma-4-26b-a4b").spec_hash


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_round_trip(name: str) -> None:
    spec = PRESETS[name]
    again = spec_from_configs(target_config(spec.target, spec.vision), drafter_config(spec.drafter), name=name)
    assert again == spec
    assert detect_format(target_config(spec.target), None).source == "compressed-tensors"


def test_full_preset_geometry() -> None:
    t = get_preset("gemma-4-26b-a4b").target
    assert t.full_layers == (5, 11, 17, 23, 29)
    assert (t.layer_head_dim(0), t.layer_kv_heads(0), t.layer_has_v_proj(0)) == (256, 8, True)
    assert (t.layer_head_dim(5), t.layer_kv_heads(5), t.layer_has_v_proj(5)) == (512, 2, False)
    inv = t.layer_rope(5).inv_freq(512)
    assert len(inv) == 256 and sum(f > 0 for f in inv) == 64 and inv[1] == pytest.approx(1e6 ** (-2 / 512))
    assert all(f > 0 for f in t.layer_rope(0).inv_freq(256))


def test_tiny_preset_exercises_the_architecture() -> None:
    spec = get_preset("tiny")
    t = spec.target
    assert t.full_layers and t.attention_k_eq_v
    assert t.top_k_experts < t.num_experts and t.vocab_size >= 512
    assert t.sliding_window < 32  # shorter than the test prompts
    assert max(spec.drafter.target_layer_ids) < t.num_hidden_layers


def test_spec_hash_is_stable_across_processes() -> None:
    code = "from thorgen.model_spec import get_preset; print(get_preset('tiny').spec_hash)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == get_preset("tiny").spec_hash
    changed = dataclasses.replace(
        get_preset("tiny"), target=dataclasses.replace(get_preset("tiny").target, sliding_window=32)
    )
    assert changed.spec_hash != out


@pytest.mark.parametrize(
    "key,value,words",
    [
        ("hidden_size_per_layer_input", 256, "per-layer embeddings"),
        ("num_kv_shared_layers", 10, "KV sharing"),
        ("hidden_activation", "silu", "gelu_pytorch_tanh"),
        ("top_k_experts", 0, "top_k_experts"),
    ],
)
def test_unsupported_configs_raise_spec_error(key: str, value: object, words: str) -> None:
    cfg = target_config(get_preset("tiny").target)
    cfg["text_config"][key] = value
    with pytest.raises(SpecError, match=words):
        spec_from_configs(cfg)


def test_layer_types_length_and_rope_are_checked() -> None:
    cfg = target_config(get_preset("tiny").target)
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    with pytest.raises(SpecError, match="layer_types"):
        spec_from_configs(cfg)
    cfg = target_config(get_preset("tiny").target)
    cfg["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
    with pytest.raises(SpecError, match="yarn"):
        spec_from_configs(cfg)


def test_unsupported_quantization_is_rejected() -> None:
    cfg = target_config(get_preset("tiny").target)
    cfg["quantization_config"]["format"] = "int4-pack-quantized"
    with pytest.raises(SpecError, match="int4-pack-quantized"):
        detect_format(cfg, None)
    cfg["quantization_config"]["quant_method"] = "gptq"
    with pytest.raises(SpecError, match="gptq"):
        detect_format(cfg, None)
    del cfg["quantization_config"]  # no quantization_config: Google's bf16 checkpoint
    assert detect_format(cfg, None).source == "bf16"


def test_full_inventory_matches_the_published_shapes() -> None:
    spec = get_preset("gemma-4-26b-a4b")
    tensors = {t.name: t for t in target_tensors(spec.target)}
    # 25 sliding layers x 391 linears + 5 full layers x 390 (no v_proj), 4 tensors each, plus 13 plain tensors
    # per layer and embed + final norm: the text part of the seed's expected 47648 (the rest is the vision tower).
    assert len(tensors) == (25 * 391 + 5 * 390) * 4 + 30 * 13 + 2
    p = "model.language_model.layers."
    expect = {  # MODEL_FACTS §2.2 packed / scale shapes
        f"{p}0.self_attn.q_proj.weight_packed": (4096, 1408),
        f"{p}0.self_attn.q_proj.weight_scale": (4096, 176),
        f"{p}0.self_attn.k_proj.weight_packed": (2048, 1408),
        f"{p}0.self_attn.o_proj.weight_scale": (2816, 256),
        f"{p}5.self_attn.q_proj.weight_packed": (8192, 1408),
        f"{p}5.self_attn.k_proj.weight_packed": (1024, 1408),
        f"{p}5.self_attn.o_proj.weight_packed": (2816, 4096),
        f"{p}5.self_attn.o_proj.weight_scale": (2816, 512),
        f"{p}3.mlp.down_proj.weight_packed": (2816, 1056),
        f"{p}3.mlp.down_proj.weight_scale": (2816, 132),
        f"{p}3.experts.127.up_proj.weight_packed": (704, 1408),
        f"{p}3.experts.0.down_proj.weight_scale": (2816, 44),
        "model.language_model.embed_tokens.weight": (262144, 2816),
    }
    for name, shape in expect.items():
        assert tensors[name].shape == shape, name
    assert f"{p}5.self_attn.v_proj.weight_packed" not in tensors
    assert tensors[f"{p}0.self_attn.q_proj.weight_scale"].dtype == "F8_E4M3"
    nvfp4_bytes = sum(t.nbytes for t in tensors.values())
    # The real single-shard file is 16.4 GB including the bf16 vision tower (~0.4 B params, ~0.8 GB).
    assert 14.8e9 < nvfp4_bytes < 16.4e9


def test_drafter_inventory() -> None:
    d = get_preset("gemma-4-26b-a4b").drafter
    tensors = {t.name: t for t in drafter_tensors(d)}
    assert tensors["fc.weight"].shape == (2816, 16896)
    assert tensors["layers.4.self_attn.k_proj.weight"].shape == (1024, 2816)
    assert tensors["layers.0.mlp.down_proj.weight"].shape == (2816, 5632)
    assert all(t.dtype == "BF16" for t in tensors.values())
    assert 0.8e9 < sum(t.nbytes for t in tensors.values()) < 0.95e9
