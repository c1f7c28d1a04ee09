"""Tests for model_spec/safetensors_io.py, safetensors_shards.py and checkpoint.py: round trip and every bad-input
error."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from thorgen.model_spec import nvfp4
from thorgen.model_spec.checkpoint import Checkpoint, CheckpointError
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.safetensors_io import INDEX_NAME, SafetensorsFile, StreamingWriter, write_safetensors
from thorgen.model_spec.safetensors_shards import ShardedWriter
from thorgen.model_spec.synth import write_synthetic_checkpoint
from thorgen.model_spec.synth.weights import LinearParts, rng_for, tensor_chunks
from thorgen.model_spec.tensors import TARGET_PREFIX, TensorInfo, drafter_tensors, target_tensors

P = TARGET_PREFIX


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    write_synthetic_checkpoint("tiny", out, seed=0, progress=False)
    return out


@pytest.fixture
def copy(tiny, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny, dst)
    return dst


def _shard_of(folder, name):
    return json.loads((folder / INDEX_NAME).read_text())["weight_map"][name]


def _rewrite(folder, shard, edit):
    """Rewrite one shard: edit(dict name -> (dtype, array)) in place; keeps the index in step."""
    f = SafetensorsFile(folder / shard)
    arrays = {n: (e.dtype, np.array(f.array(n))) for n, e in f.entries.items()}
    del f
    edit(arrays)
    write_safetensors(folder / shard, arrays)
    index = json.loads((folder / INDEX_NAME).read_text())
    wm = {n: s for n, s in index["weight_map"].items() if s != shard or n in arrays}
    wm.update({n: shard for n in arrays})
    index["weight_map"] = wm
    (folder / INDEX_NAME).write_text(json.dumps(index))


def _poke(path, name, raw: bytes, at: int = 0):
    """Overwrite bytes of one tensor in place."""
    f = SafetensorsFile(path)
    start = f.data_start + f.entries[name].begin + at
    del f
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(raw)


# ---- safetensors io ---------------------------------------------------------------------------------------------


def test_written_files_load_with_official_safetensors(tmp_path):
    st_np = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    arrays = {
        "a": ("F32", rng.standard_normal((3, 5)).astype(np.float32)),
        "b": ("U8", rng.integers(0, 256, (7,)).astype(np.uint8)),
        "c": ("I64", np.arange(4, dtype=np.int64)),
        "empty": ("F32", np.zeros((0, 3), np.float32)),
    }
    write_safetensors(tmp_path / "x.safetensors", arrays)
    loaded = st_np.load_file(str(tmp_path / "x.safetensors"))
    for n, (_, a) in arrays.items():
        assert np.array_equal(loaded[n], a) and loaded[n].shape == a.shape
    mine = SafetensorsFile(tmp_path / "x.safetensors")
    for n, (_, a) in arrays.items():
        assert np.array_equal(mine.array(n), a)


def test_bf16_and_fp8_load_with_official_safetensors_torch(tiny):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    ck = Checkpoint.open(tiny)
    index = json.loads((tiny / INDEX_NAME).read_text())["weight_map"]
    for name in [
        P + "embed_tokens.weight",
        P + "layers.2.self_attn.q_proj.weight_scale",
        P + "layers.2.self_attn.q_proj.weight_packed",
        P + "layers.2.self_attn.q_proj.weight_global_scale",
        P + "norm.weight",
    ]:
        with safe_open(str(tiny / index[name]), framework="pt") as f:
            t = f.get_tensor(name)
        raw = ck.tensor(name)
        if t.dtype == torch.bfloat16:
            assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), raw)
        elif t.dtype == torch.float8_e4m3fn:
            assert np.array_equal(t.view(torch.uint8).numpy(), raw)
            assert np.array_equal(t.float().numpy(), nvfp4.e4m3_to_f32(raw))
        else:
            assert np.array_equal(t.numpy(), raw)
    with safe_open(str(tiny / "dflash" / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == {t.name for t in drafter_tensors(get_preset("tiny").drafter)}


def test_streaming_writer_checks_order_and_sizes(tmp_path):
    infos = [TensorInfo("a", "F32", (2,), "bf16"), TensorInfo("b", "U8", (3,), "bf16")]
    with pytest.raises(ValueError, match="expected data for 'a'"):
        with StreamingWriter(tmp_path / "o.safetensors", infos) as w:
            w.append("b", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="expects 8"):
        with StreamingWriter(tmp_path / "o.safetensors", infos) as w:
            w.append("a", np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="'b' was fully written"):
        with StreamingWriter(tmp_path / "o.safetensors", infos) as w:
            w.append("a", np.zeros(2, np.float32))
            w.append("b", np.zeros(1, np.uint8))  # chunked writes are fine, but 2 bytes are still missing


def test_sharded_writer_index(tmp_path):
    infos = [TensorInfo(f"t{i}", "F32", (10,), "bf16") for i in range(5)]
    with ShardedWriter(tmp_path, infos, max_shard_bytes=80) as w:
        for t in infos:
            w.append(t.name, np.full(10, float(t.name[1:]), np.float32))
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 200
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    for name, shard in index["weight_map"].items():
        assert SafetensorsFile(tmp_path / shard).array(name)[0] == float(name[1:])


# ---- checkpoint round trip ----------------------------------------------------------------------------------------


def test_open_reads_spec_configs_and_tokenizer(tiny):
    ck = Checkpoint.open(tiny)
    assert ck.spec.target == get_preset("tiny").target and ck.spec.drafter == get_preset("tiny").drafter
    assert ck.draft_dir == tiny / "dflash"
    assert ck.generation_config["eos_token_id"] == [1, 106, 50]
    assert ck.tokenizer_path == tiny / "tokenizer.json" and ck.tokenizer_path.is_file()
    assert ck.chat_template and "<|turn>" in ck.chat_template
    assert len({f for f in json.loads((tiny / INDEX_NAME).read_text())["weight_map"].values()}) == 2


def test_every_tensor_round_trips(tiny):
    ck = Checkpoint.open(tiny)
    spec = get_preset("tiny")
    linears = LinearParts(0, "quantize")
    for info in target_tensors(spec.target):
        got = ck.tensor(info.name)
        want = np.concatenate([c.ravel() for c in tensor_chunks(info, 0, spec.target.hidden_size, linears)])
        assert got.shape == info.shape, info.name
        assert np.array_equal(got.ravel().view(np.uint8), want.view(np.uint8)), info.name
    for info in drafter_tensors(spec.drafter):
        want = np.concatenate([c.ravel() for c in tensor_chunks(info, 0, spec.drafter.hidden_size, linears)])
        assert np.array_equal(ck.draft_tensor(info.name).ravel(), want), info.name
        assert np.array_equal(ck.draft_weight_f32(info.name).ravel(), nvfp4.bf16_to_f32(want))


def test_linear_f32_is_the_dequantized_float_weight(tiny):
    ck = Checkpoint.open(tiny)
    for prefix in [
        P + "layers.0.self_attn.q_proj",
        P + "layers.2.self_attn.k_proj",
        P + "layers.4.mlp.down_proj",
        P + "layers.5.experts.15.up_proj",
    ]:
        packed, scale, gs = (
            ck.tensor(f"{prefix}.{p}") for p in ("weight_packed", "weight_scale", "weight_global_scale")
        )
        w = ck.linear_f32(prefix)
        assert np.array_equal(w, nvfp4.dequantize_nvfp4(packed, scale, gs[0]))
        # the float weight the synth drew for this prefix (tiny goes through the real quantizer)
        out_f, in_f = w.shape
        ref = rng_for(0, prefix).standard_normal((out_f, in_f), dtype=np.float32) * np.float32(in_f**-0.5)
        assert np.array_equal(nvfp4.quantize_nvfp4(ref)[0], packed)
        assert np.linalg.norm(w - ref) / np.linalg.norm(ref) < 0.15


def test_weight_f32_converts_bf16(tiny):
    ck = Checkpoint.open(tiny)
    raw = ck.tensor(P + "norm.weight")
    assert raw.dtype == np.uint16
    f = ck.weight_f32(P + "norm.weight")
    assert f.dtype == np.float32 and np.array_equal(f, nvfp4.bf16_to_f32(raw))
    assert 0.8 < f.mean() < 1.2
    with pytest.raises(CheckpointError, match="not a BF16/F32"):
        ck.weight_f32(P + "layers.0.mlp.up_proj.weight_packed")


def test_open_without_drafter(copy):
    shutil.rmtree(copy / "dflash")
    ck = Checkpoint.open(copy)
    assert ck.spec.drafter is None and ck.draft_dir is None
    with pytest.raises(CheckpointError, match="no drafter"):
        ck.draft_weight_f32("fc.weight")


def test_input_global_scale_is_optional_and_ignored_prefixes_allowed(copy):
    for shard in sorted({p.name for p in copy.glob("model-*.safetensors")}):
        _rewrite(copy, shard, lambda a: [a.pop(n) for n in list(a) if n.endswith("input_global_scale")])
    first = _shard_of(copy, P + "embed_tokens.weight")
    _rewrite(copy, first, lambda a: a.update({"model.audio_tower.encoder.w": ("BF16", np.zeros(4, np.uint16))}))
    ck = Checkpoint.open(copy)
    assert not ck.has_tensor(P + "layers.0.mlp.up_proj.input_global_scale")


V = "model.vision_tower."


def test_vision_tensors_are_validated_with_a_tower(copy):
    """With vision_config the tower's 13 x layers + 5 tensors are part of the inventory: an unknown one is refused."""
    ck = Checkpoint.open(copy)
    vision = ck.spec.vision
    assert len(ck.vision_inventory) == 13 * vision.num_hidden_layers + 5
    assert ck.weight_f32(V + "encoder.layers.1.mlp.down_proj.linear.weight").shape == (144, 272)
    first = _shard_of(copy, P + "embed_tokens.weight")
    _rewrite(copy, first, lambda a: a.update({V + "encoder.w": ("BF16", np.zeros(4, np.uint16))}))
    with pytest.raises(CheckpointError, match="unexpected") as exc:
        Checkpoint.open(copy)
    assert V + "encoder.w" in str(exc.value)


def test_vision_standardize_buffers_may_be_f32_and_missing_tower_tensors_are_named(copy):
    name = V + "std_scale"
    _rewrite(copy, _shard_of(copy, name), lambda a: a.update({name: ("F32", np.full(144, 0.1, np.float32))}))
    ck = Checkpoint.open(copy)
    assert ck.weight_f32(name).dtype == np.float32 and np.allclose(ck.weight_f32(name), 0.1)
    gone = V + "encoder.layers.0.self_attn.q_norm.weight"
    _rewrite(copy, _shard_of(copy, gone), lambda a: a.pop(gone))
    with pytest.raises(CheckpointError, match="missing") as exc:
        Checkpoint.open(copy)
    assert gone in str(exc.value)


def test_vision_tensors_are_ignored_without_a_tower(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["vision_config"] = None
    (copy / "config.json").write_text(json.dumps(cfg))
    first = _shard_of(copy, P + "embed_tokens.weight")
    _rewrite(copy, first, lambda a: a.update({V + "encoder.w": ("BF16", np.zeros(4, np.uint16))}))
    ck = Checkpoint.open(copy)
    assert ck.spec.vision is None and ck.vision_inventory == []


# ---- bad checkpoints ------------------------------------------------------------------------------------------------


def test_missing_tensor(copy):
    name = P + "layers.5.mlp.down_proj.weight_scale"
    _rewrite(copy, _shard_of(copy, name), lambda a: a.pop(name))
    with pytest.raises(CheckpointError, match="missing") as exc:
        Checkpoint.open(copy)
    assert name in str(exc.value) and str(copy) in str(exc.value)


def test_extra_tensor(copy):
    name = P + "layers.0.self_attn.bogus.weight"
    shard = _shard_of(copy, P + "layers.0.self_attn.q_proj.weight_packed")
    _rewrite(copy, shard, lambda a: a.update({name: ("BF16", np.zeros(3, np.uint16))}))
    with pytest.raises(CheckpointError, match="unexpected") as exc:
        Checkpoint.open(copy)
    assert name in str(exc.value) and shard in str(exc.value)


def test_wrong_dtype(copy):
    name = P + "layers.1.input_layernorm.weight"
    _rewrite(copy, _shard_of(copy, name), lambda a: a.update({name: ("F32", np.ones(256, np.float32))}))
    with pytest.raises(CheckpointError, match="is F32\\[256\\], expected BF16\\[256\\]") as exc:
        Checkpoint.open(copy)
    assert name in str(exc.value) and _shard_of(copy, name) in str(exc.value)


def test_wrong_shape(copy):
    name = P + "layers.2.self_attn.q_norm.weight"  # full layer: head_dim 128
    _rewrite(copy, _shard_of(copy, name), lambda a: a.update({name: ("BF16", np.zeros(64, np.uint16))}))
    with pytest.raises(CheckpointError, match=r"BF16\[64\], expected BF16\[128\]") as exc:
        Checkpoint.open(copy)
    assert name in str(exc.value)


def test_wrong_drafter_shape(copy):
    arrays = {}
    f = SafetensorsFile(copy / "dflash" / "model.safetensors")
    arrays = {n: (e.dtype, np.array(f.array(n))) for n, e in f.entries.items()}
    arrays["fc.weight"] = ("BF16", np.zeros((256, 512), np.uint16))
    del f
    write_safetensors(copy / "dflash" / "model.safetensors", arrays)
    with pytest.raises(CheckpointError, match="drafter") as exc:
        Checkpoint.open(copy)
    assert "fc.weight" in str(exc.value)


def test_truncated_file(copy):
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    with open(shard, "r+b") as fh:
        fh.truncate(shard.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="truncated") as exc:
        Checkpoint.open(copy)
    assert shard.name in str(exc.value) and "tensor" in str(exc.value)


def test_truncated_header(copy):
    shard = sorted(copy.glob("model-*.safetensors"))[0]
    with open(shard, "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(CheckpointError, match="header length") as exc:
        Checkpoint.open(copy)
    assert shard.name in str(exc.value)


@pytest.mark.parametrize("value", [np.nan, np.inf, 0.0, -3.0])
def test_bad_global_scale(copy, value):
    name = P + "layers.3.experts.7.gate_proj.weight_global_scale"
    _poke(copy / _shard_of(copy, name), name, struct.pack("<f", value))
    with pytest.raises(CheckpointError, match="global scale must be finite and > 0") as exc:
        Checkpoint.open(copy)
    assert name in str(exc.value) and _shard_of(copy, name) in str(exc.value)


def test_nan_block_scale_raises_on_use(copy):
    prefix = P + "layers.1.self_attn.o_proj"
    name = prefix + ".weight_scale"
    _poke(copy / _shard_of(copy, name), name, b"\x7f", at=37)
    ck = Checkpoint.open(copy)  # lazily checked
    ck.linear_f32(P + "layers.1.self_attn.q_proj")
    with pytest.raises(CheckpointError, match="NaN") as exc:
        ck.linear_f32(prefix)
    assert name in str(exc.value) and _shard_of(copy, name) in str(exc.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda q: q.update(format="pack-quantized"), "format"),
        (lambda q: q.update(quant_method="gptq"), "quant_method"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=32), "not NVFP4"),
    ],
)
def test_unsupported_quantization(copy, edit, match):
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg["quantization_config"])
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=match) as exc:
        Checkpoint.open(copy)
    assert "config.json" in str(exc.value)


def test_no_quantization_config(copy):
    cfg = json.loads((copy / "config.json").read_text())
    del cfg["quantization_config"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config"):
        Checkpoint.open(copy)


def test_unsupported_architecture_in_config(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["text_config"]["hidden_size_per_layer_input"] = 256
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size_per_layer_input"):
        Checkpoint.open(copy)


def test_missing_config(copy):
    (copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        Checkpoint.open(copy)


def test_broken_config_json(copy):
    (copy / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot parse"):
        Checkpoint.open(copy)


def test_missing_shard(copy):
    shard = sorted(copy.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="is missing") as exc:
        Checkpoint.open(copy)
    assert shard.name in str(exc.value)


def test_missing_weights_and_tokenizer(copy, tmp_path):
    (copy / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Checkpoint.open(copy)
    with pytest.raises(CheckpointError, match="not a directory"):
        Checkpoint.open(tmp_path / "nowhere")


def test_chat_template_falls_back_to_tokenizer_config(copy):
    (copy / "chat_template.jinja").unlink()
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    assert Checkpoint.open(copy).chat_template == cfg["chat_template"]
    del cfg["chat_template"]
    (copy / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Checkpoint.open(copy).chat_template is None


def test_open_does_not_read_tensor_data(tiny, monkeypatch):
    """Opening maps files; only the small global scales are touched (checked via the arrays handed out)."""
    from thorgen.model_spec import safetensors_io

    seen = []
    orig = safetensors_io.SafetensorsFile.array
    monkeypatch.setattr(
        safetensors_io.SafetensorsFile, "array", lambda self, name: seen.append(name) or orig(self, name)
    )
    Checkpoint.open(tiny)
    assert seen and all(n.endswith("global_scale") for n in seen)
