"""Checkpoint formats: detection (compressed-tensors, ModelOpt experts-only / all-linear, bf16), each refusal with
its one-line error, the synthetic checkpoints of every format, and the compressed-tensors -> ModelOpt conversion."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from modelopt_convert import convert_ct_to_modelopt
from thorgen.model_spec.checkpoint import Checkpoint, CheckpointError
from thorgen.model_spec.config import target_config
from thorgen.model_spec.formats import detect_format, linear_formats_of
from thorgen.model_spec.nvfp4 import bf16_to_f32, dequantize_nvfp4, e4m3_to_f32, unpack_e2m1
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.safetensors_io import SafetensorsFile, write_safetensors
from thorgen.model_spec.synth import write_synthetic_checkpoint
from thorgen.model_spec.tensors import TARGET_PREFIX, target_linears
from thorgen.model_spec.types import ALL_BF16, ALL_NVFP4, EXPERTS_ONLY_NVFP4, LinearFormats, SpecError

P = TARGET_PREFIX


@pytest.fixture(scope="module")
def formats_root(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("formats")
    for fmt in ("modelopt", "modelopt-all-linear", "bf16"):
        write_synthetic_checkpoint("tiny", root / fmt, seed=0, progress=False, source_format=fmt)
    convert_ct_to_modelopt(tiny_checkpoint, root / "converted", "all-linear")
    convert_ct_to_modelopt(tiny_checkpoint, root / "converted-experts", "experts-only")
    return root


def _prefixes(spec):
    return [lin.prefix for layer in range(spec.num_hidden_layers) for lin in target_linears(spec, layer)]


def test_detection_of_every_format(formats_root, tiny_ckpt):
    assert tiny_ckpt.source_format == "compressed-tensors" and tiny_ckpt.spec.linear_formats == ALL_NVFP4
    want = {
        "modelopt": ("modelopt", EXPERTS_ONLY_NVFP4),
        "modelopt-all-linear": ("modelopt", ALL_NVFP4),
        "bf16": ("bf16", ALL_BF16),
        "converted": ("modelopt", ALL_NVFP4),
        "converted-experts": ("modelopt", EXPERTS_ONLY_NVFP4),
    }
    for name, (source, formats) in want.items():
        ck = Checkpoint.open(formats_root / name)
        assert (ck.source_format, ck.spec.linear_formats) == (source, formats), name
    # the per-role formats enter the spec hash only when they differ from all-NVFP4
    assert Checkpoint.open(formats_root / "bf16").spec.spec_hash != tiny_ckpt.spec.spec_hash
    assert Checkpoint.open(formats_root / "converted").spec.spec_hash == tiny_ckpt.spec.spec_hash


def test_modelopt_conventions_of_the_synthetic_checkpoint(formats_root):
    ck = Checkpoint.open(formats_root / "modelopt")
    spec = ck.spec.target
    hq = json.loads((formats_root / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "NVFP4" and hq["group_size"] == 16 and hq["kv_cache_quant_algo"] == "FP8"
    assert f"{P}layers.0.self_attn*" in hq["exclude_modules"] and "lm_head" in hq["exclude_modules"]
    assert (
        json.loads((formats_root / "modelopt" / "config.json").read_text())["quantization_config"]["quant_method"]
        == "modelopt"
    )
    full = spec.layer_types.index("full_attention")
    assert not ck.has_tensor(f"{P}layers.{full}.self_attn.v_proj.weight")  # k_eq_v: no v_proj
    assert ck.tensor(f"{P}layers.{full}.self_attn.k_proj.k_scale").shape == ()
    for layer in range(spec.num_hidden_layers):
        for e in range(spec.num_experts):
            ex = f"{P}layers.{layer}.experts.{e}."
            g, u = (ck.tensor(ex + p + ".weight_scale_2") for p in ("gate_proj", "up_proj"))
            assert g.shape == () and g == u  # one shared multiplier per expert
            assert ck.tensor(ex + "down_proj.input_scale").shape == ()
    assert ck.linear_bf16(f"{P}layers.0.self_attn.q_proj").dtype == np.uint16


def test_modelopt_dequantization_is_its_multiplier_formula(formats_root):
    ck = Checkpoint.open(formats_root / "modelopt")
    prefix = f"{P}layers.1.experts.2.down_proj"
    packed, scale, s2 = ck.nvfp4_parts(prefix)
    assert s2 == ck.tensor(prefix + ".weight_scale_2")  # as stored: nothing inverted
    np.testing.assert_array_equal(ck.linear_f32(prefix), _modelopt_dequant(packed, scale, s2))


def _modelopt_dequant(packed, scale, s2):
    """NVFP4QTensor.dequantize written out: e2m1(code) * (float32(e4m3(scale)) * weight_scale_2)."""
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    return e2m1[unpack_e2m1(packed)] * np.repeat(e4m3_to_f32(scale) * np.float32(s2), 16, axis=1)


def test_every_format_holds_the_same_model(formats_root, tiny_ckpt):
    spec = tiny_ckpt.spec.target
    bf16 = Checkpoint.open(formats_root / "bf16")
    converted = Checkpoint.open(formats_root / "converted")
    for prefix in _prefixes(spec):
        ct = tiny_ckpt.linear_f32(prefix)
        np.testing.assert_array_equal(bf16.linear_f32(prefix), bf16_to_f32(bf16.linear_bf16(prefix)))
        np.testing.assert_allclose(bf16.linear_f32(prefix), ct, rtol=2**-8, atol=0)  # one bf16 rounding
        got, want = converted.nvfp4_parts(prefix), tiny_ckpt.nvfp4_parts(prefix)
        for a, b in zip(got, want):  # same bytes, and weight_scale_2 is exactly the multiplier CT's divisor gives
            np.testing.assert_array_equal(a, b, err_msg=prefix)


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _refused(folder, match):
    with pytest.raises(CheckpointError, match=match) as info:
        Checkpoint.open(folder)
    assert "\n" not in str(info.value), str(info.value)
    return str(info.value)


def test_refusals_name_the_field_or_tensor(formats_root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(formats_root / "modelopt", bad)
    hq = bad / "hf_quant_config.json"
    original = hq.read_text()
    _edit_json(hq, lambda d: d["quantization"].pop("group_size"))
    _refused(bad, "hf_quant_config.json quantization: missing field 'group_size'")
    hq.write_text(original)
    _edit_json(hq, lambda d: d["quantization"].update(quant_algo="FP8"))
    _refused(bad, "quant_algo 'FP8'")
    hq.write_text(original)
    # a bf16 layer missing from the exclusions: the config now says layer 1's attention is NVFP4
    _edit_json(hq, lambda d: d["quantization"]["exclude_modules"].remove(f"{P}layers.1.self_attn*"))
    _refused(bad, r"attention linears mix formats: .*layers.1.self_attn.q_proj")
    _edit_json(
        hq,
        lambda d: d["quantization"]["exclude_modules"].__setitem__(
            slice(None), [p for p in d["quantization"]["exclude_modules"] if "self_attn" not in p]
        ),
    )
    _refused(bad, r"tensor '.*self_attn.q_proj.weight' is BF16 but .* says .* is NVFP4")


def test_refusals_of_scales_with_the_wrong_shape_or_dtype(formats_root, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(formats_root / "converted", bad)
    f = SafetensorsFile(bad / "model.safetensors")
    arrays = {n: (e.dtype, np.array(f.array(n))) for n, e in f.entries.items()}
    del f
    name = f"{P}layers.0.experts.1.up_proj.weight_scale_2"
    arrays[name] = ("F32", arrays[name][1].reshape(1))  # [1] instead of 0-d
    write_safetensors(bad / "model.safetensors", arrays)
    _refused(bad, rf"tensor '{name}' is F32\[1\], expected F32\[\]")
    arrays[name] = ("BF16", np.array(0x3F80, np.uint16))
    write_safetensors(bad / "model.safetensors", arrays)
    _refused(bad, rf"tensor '{name}' is BF16\[\], expected F32\[\]")
    arrays[name] = ("F32", np.array(-1.0, np.float32))
    write_safetensors(bad / "model.safetensors", arrays)
    _refused(bad, "global scale must be finite and > 0")


def test_unequal_gate_up_multipliers_are_served_exactly(tiny_checkpoint, tiny_ckpt, tmp_path):
    gate = f"{P}layers.0.experts.4.gate_proj"
    odd = {gate: np.float32(tiny_ckpt.nvfp4_parts(gate)[2] * np.float32(1.5))}
    ck = Checkpoint.open(convert_ct_to_modelopt(tiny_checkpoint, tmp_path / "mo", "all-linear", odd))
    up = gate.replace("gate_proj", "up_proj")
    assert ck.nvfp4_parts(gate)[2] == odd[gate] != ck.nvfp4_parts(up)[2]
    packed, scale, _ = tiny_ckpt.nvfp4_parts(gate)
    np.testing.assert_array_equal(ck.linear_f32(gate), _modelopt_dequant(packed, scale, odd[gate]))
    np.testing.assert_allclose(ck.linear_f32(gate), dequantize_nvfp4(packed, scale, 1.0) * odd[gate], rtol=2e-7)


def test_detect_format_config_rules():
    spec = get_preset("tiny").target
    cfg = target_config(spec, None, "modelopt", EXPERTS_ONLY_NVFP4)
    fmt = detect_format(cfg, None)  # the flat config.json form alone
    assert fmt.source == "modelopt" and linear_formats_of(fmt, _prefixes(spec)) == EXPERTS_ONLY_NVFP4
    assert linear_formats_of(detect_format(target_config(spec, None, "bf16"), None), []) == ALL_BF16
    with pytest.raises(SpecError, match="disagrees"):
        detect_format(
            target_config(spec),
            {
                "producer": {"name": "modelopt"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "kv_cache_quant_algo": None,
                    "exclude_modules": [],
                },
            },
        )
    with pytest.raises(SpecError, match="compressed-tensors checkpoint quantizes every linear"):
        target_config(spec, None, "compressed-tensors", LinearFormats(experts="bf16"))


def test_every_format_carries_the_bf16_vision_tower(formats_root, tiny_ckpt, tmp_path):
    """The tower is validated and read the same in every format (bf16, excluded from quantization); one stored as
    NVFP4 (a quantized tower linear) is refused, naming the tensor."""
    tower = [t.name for t in tiny_ckpt.vision_inventory]
    assert tower and tiny_ckpt.spec.vision is not None
    ignore = json.loads((tiny_ckpt.model_dir / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.vision_tower.encoder.layers.0.self_attn.q_proj.linear" in ignore
    for name in ("modelopt", "modelopt-all-linear", "bf16", "converted", "converted-experts"):
        ck = Checkpoint.open(formats_root / name)
        assert ck.spec.vision == tiny_ckpt.spec.vision and [t.name for t in ck.vision_inventory] == tower, name
        for t in tower:
            np.testing.assert_array_equal(ck.tensor(t), tiny_ckpt.tensor(t), err_msg=f"{name} {t}")
    bad = tmp_path / "bad"
    shutil.copytree(formats_root / "converted-experts", bad)  # (one model.safetensors)
    f = SafetensorsFile(bad / "model.safetensors")
    arrays = {n: (e.dtype, np.array(f.array(n))) for n, e in f.entries.items()}
    del f
    q = "model.vision_tower.encoder.layers.1.self_attn.q_proj.linear"
    out, k = arrays.pop(q + ".weight")[1].shape
    arrays |= {
        q + ".weight": ("U8", np.zeros((out, k // 2), np.uint8)),
        q + ".weight_scale": ("F8_E4M3", np.zeros((out, k // 16), np.uint8)),
    }
    write_safetensors(bad / "model.safetensors", arrays)
    with pytest.raises(CheckpointError, match=rf"tensor '{q}.weight' is U8\[{out}, {k // 2}\], expected BF16"):
        Checkpoint.open(bad)
