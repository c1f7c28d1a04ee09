"""Repack of every checkpoint format: the header's source/linear formats, byte-identical NVFP4 matrices from the
ModelOpt conversion, bf16 linears as fp16 in the half layout, and `--quantize nvfp4` with its error report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from modelopt_convert import convert_ct_to_modelopt
from thorgen.model_spec.checkpoint import Checkpoint
from thorgen.model_spec.nvfp4 import bf16_to_f32, dequantize_nvfp4, quantize_nvfp4
from thorgen.model_spec.tensors import TARGET_PREFIX, target_linears
from thorgen.runtime.convert import layouts as L
from thorgen.runtime.convert import repack as R
from thorgen.runtime.convert.artifact import WeightsArtifact
from thorgen.model_spec.weight_layout import HALF_LAYOUT

P = TARGET_PREFIX


@pytest.fixture(scope="module")
def arts(tmp_path_factory, tiny_checkpoint, tiny_format_checkpoints):
    root = tmp_path_factory.mktemp("repack_formats")
    mo = convert_ct_to_modelopt(tiny_checkpoint, root / "mo", "all-linear")
    mo_experts = convert_ct_to_modelopt(tiny_checkpoint, root / "mo-experts", "experts-only")
    out = {
        "ct": R.repack(tiny_checkpoint, root / "a-ct", jobs=1),
        "mo": R.repack(mo, root / "a-mo", jobs=2),
        "mo-experts": R.repack(mo_experts, root / "a-mo-experts", jobs=1),
        "bf16": R.repack(tiny_format_checkpoints["bf16"], root / "a-bf16", jobs=1),
        "bf16-q": R.repack(tiny_format_checkpoints["bf16"], root / "a-bf16-q", jobs=2, quantize="nvfp4"),
    }
    return {k: WeightsArtifact.open(v) for k, v in out.items()}


def _bytes(art, name):
    return np.asarray(art.array(name)).tobytes()


def test_header_records_the_formats(arts):
    assert arts["ct"].header["source_format"] == "compressed-tensors"
    assert arts["mo-experts"].header["source_format"] == "modelopt"
    assert arts["mo-experts"].header["linear_formats"] == {"attention": "bf16", "dense_mlp": "bf16", "experts": "nvfp4"}
    assert arts["bf16"].header["linear_formats"] == {"attention": "bf16", "dense_mlp": "bf16", "experts": "bf16"}
    q = arts["bf16-q"].header
    assert q["source_format"] == "bf16" and q["linear_formats"] == {
        "attention": "nvfp4",
        "dense_mlp": "nvfp4",
        "experts": "nvfp4",
    }
    ckpt = Checkpoint.open(arts["ct"].header["source"])
    assert q["spec_hash"] == ckpt.spec.spec_hash  # the all-NVFP4 spec of the same model


def test_modelopt_conversion_repacks_byte_identical(arts):
    ct, mo = arts["ct"], arts["mo"]
    assert set(ct.tensors) == set(mo.tensors)
    for name in ct.tensors:
        assert _bytes(ct, name) == _bytes(mo, name), name
    assert ct.tensors.keys() and all(ct.entry(n).checksum == mo.entry(n).checksum for n in ct.tensors)
    experts = [n for n in ct.tensors if ".experts." in n]
    for name in experts:  # experts-only: the NVFP4 experts are the same bytes as well
        assert _bytes(ct, name) == _bytes(arts["mo-experts"], name), name


def test_bf16_linears_are_their_fp16_values_in_the_half_layout(arts, tiny_format_checkpoints):
    """A bf16 linear is stored for the fp16-weight GEMMs: `<base>.weight_half`, each bf16 weight converted to fp16
    (round to nearest even) in the half layout, fused like the NVFP4 matrices."""
    art = arts["bf16"]
    ck = Checkpoint.open(tiny_format_checkpoints["bf16"])
    e = art.entry("layers.0.mlp.gate_up_proj.weight_half")
    assert e.layout == HALF_LAYOUT and e.dtype == "f16"
    n, k = dict(e.meta)["logical_shape"]
    gate, up = L.deinterleave8(L.unpack_half(np.asarray(art.array(e.name)).view(np.uint16), n, k))
    np.testing.assert_array_equal(gate, L.bf16_to_f16_bits(ck.linear_bf16(P + "layers.0.mlp.gate_proj")))
    np.testing.assert_array_equal(up, L.bf16_to_f16_bits(ck.linear_bf16(P + "layers.0.mlp.up_proj")))
    down = np.asarray(art.array("layers.1.experts.down_proj.weight_half"))[3]  # expert 3
    np.testing.assert_array_equal(
        L.unpack_half(
            down.view(np.uint16), *dict(art.entry("layers.1.experts.down_proj.weight_half").meta)["logical_shape"]
        ),
        L.bf16_to_f16_bits(ck.linear_bf16(P + "layers.1.experts.3.down_proj")),
    )
    assert not any(n.endswith(".weight_packed") and not n.startswith("lm_head") for n in art.tensors)


def test_quantize_nvfp4_is_the_compressed_tensors_layout_with_a_report(arts, tiny_format_checkpoints):
    from artifact_readback import unpack_linear

    art = arts["bf16-q"]
    ck = Checkpoint.open(tiny_format_checkpoints["bf16"])
    w = bf16_to_f32(ck.linear_bf16(P + "layers.3.self_attn.o_proj"))
    packed, scale, g = quantize_nvfp4(w)
    got = unpack_linear(art, "layers.3.self_attn.o_proj")
    np.testing.assert_array_equal(got[0], packed)
    np.testing.assert_array_equal(got[1], scale)
    assert got[2] == np.float32(1) / g
    report = json.loads((art.folder / R.QUANT_REPORT).read_text())
    spec = ck.spec.target
    assert len(report["linears"]) == sum(len(target_linears(spec, layer)) for layer in range(spec.num_hidden_layers))
    err = report["linears"]["layers.3.self_attn.o_proj"]
    deq = dequantize_nvfp4(packed, scale, g)
    # (the norms in float64, as the report takes them: float32 ones differ by ~3e-6 with numpy's summation order)
    diff = (deq - w).astype(np.float64)
    assert err["rms_rel"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(w.astype(np.float64)), rel=1e-6)
    # the synthetic bf16 weight is an NVFP4 grid rounded to bf16, so quantizing it again loses little (0.3% here)
    assert 0 < err["rms_rel"] < 0.02 and 0 < err["max_rel"] < 0.1
    assert report["worst"]["rms_rel"] == max(e["rms_rel"] for e in report["linears"].values())


def test_the_vision_tower_is_the_same_in_every_format(arts):
    """The tower is bf16 in every checkpoint format and never quantized (not by --quantize nvfp4 either): each
    artifact's `vision.*` tensors are the compressed-tensors artifact's bytes."""
    tower = [n for n in arts["ct"].tensors if n.startswith("vision.")]
    assert tower and any(arts["ct"].entry(n).layout == HALF_LAYOUT for n in tower)
    for key in ("mo", "mo-experts", "bf16", "bf16-q"):
        art = arts[key]
        assert [n for n in art.tensors if n.startswith("vision.")] == tower, key
        for name in tower:
            assert _bytes(art, name) == _bytes(arts["ct"], name), (key, name)
