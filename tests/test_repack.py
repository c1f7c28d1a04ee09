"""CPU tests of the offline weight repack: exact round trips for every tensor kind, artifact checks, atomicity."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from thorgen.model_spec.checkpoint import Checkpoint
from thorgen.model_spec.nvfp4 import bf16_to_f32, quantize_nvfp4
from thorgen.model_spec.synth import write_synthetic_checkpoint
from thorgen.model_spec.tensors import TARGET_PREFIX, drafter_linears, target_layer_tensors, target_linears
from thorgen.model_spec.weight_layout import FP4_ORDERS
from thorgen.runtime.convert import layouts as L
import artifact_readback as AR
from thorgen.runtime.convert import plan as P
from thorgen.runtime.convert import repack as R
from thorgen.runtime.convert.artifact import ArtifactError, WeightsArtifact, find_artifact


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("repack")
    write_synthetic_checkpoint("tiny", root / "model", seed=3)
    return root


@pytest.fixture(scope="module")
def art(tiny):
    # 64-column pieces: the lm_head (K 256) and the drafter matrices are quantized / packed in 4+ pieces
    out = R.repack(tiny / "model", tiny / "art", chunk_cols=64)
    return WeightsArtifact.open(out)


@pytest.fixture(scope="module")
def ckpt(tiny):
    return Checkpoint.open(tiny / "model")


def test_fast_shift_packing_equals_layouts():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (48, 96), dtype=np.uint8)
    scale = rng.integers(0, 0x7E, (48, 12), dtype=np.uint8)
    for order in FP4_ORDERS:
        w, s = P.pack_fp4(packed, scale, order)
        w_ref, s_ref = L.pack_nvfp4(packed, scale, order)
        np.testing.assert_array_equal(w, w_ref)
        np.testing.assert_array_equal(s, s_ref)


def test_every_nvfp4_linear_round_trips(art, ckpt):
    spec = ckpt.spec.target
    for layer in range(spec.num_hidden_layers):
        for lin in target_linears(spec, layer):
            short = lin.prefix[len(TARGET_PREFIX) :]
            if ".experts." in short:
                head, e, proj = short.rsplit(".", 2)
                got = AR.unpack_linear(art, f"{head}.{proj}", expert=int(e))
            else:
                got = AR.unpack_linear(art, short)
            want = ckpt.nvfp4_parts(lin.prefix)
            np.testing.assert_array_equal(got[0], want[0], err_msg=short)
            np.testing.assert_array_equal(got[1], want[1], err_msg=short)
            assert got[2] == want[2], short


def test_tile_scales_are_the_parts_multipliers(art, ckpt):
    qkv = art.array("layers.2.self_attn.qkv_proj.weight_tile_scale")  # full layer: q | k (k_eq_v, no v)
    q = ckpt.nvfp4_parts(TARGET_PREFIX + "layers.2.self_attn.q_proj")[2]
    k = ckpt.nvfp4_parts(TARGET_PREFIX + "layers.2.self_attn.k_proj")[2]
    t = ckpt.spec.target
    q_tiles = t.num_attention_heads * t.global_head_dim // 8
    assert qkv.shape == (q_tiles + t.num_global_key_value_heads * t.global_head_dim // 8,)
    np.testing.assert_array_equal(qkv[:q_tiles], q)
    np.testing.assert_array_equal(qkv[q_tiles:], k)
    gs = ckpt.tensor(TARGET_PREFIX + "layers.2.self_attn.q_proj.weight_global_scale")[0]
    assert q == np.float32(1) / gs  # compressed-tensors stores the divisor; the reader hands out its inverse
    gu = art.array("layers.1.experts.gate_up_proj.weight_tile_scale")[5]  # expert 5: gate, up tiles alternate
    g = ckpt.nvfp4_parts(TARGET_PREFIX + "layers.1.experts.5.gate_proj")[2]
    u = ckpt.nvfp4_parts(TARGET_PREFIX + "layers.1.experts.5.up_proj")[2]
    np.testing.assert_array_equal(gu[0::2], g)
    np.testing.assert_array_equal(gu[1::2], u)


def test_bf16_tensors_are_stored_verbatim(art, ckpt):
    spec = ckpt.spec.target
    names = [TARGET_PREFIX + "embed_tokens.weight", TARGET_PREFIX + "norm.weight"]
    names += [i.name for l in range(spec.num_hidden_layers) for i in target_layer_tensors(spec, l) if i.role == "bf16"]
    for name in names:
        np.testing.assert_array_equal(art.array(name[len(TARGET_PREFIX) :]), ckpt.tensor(name), err_msg=name)


def test_lm_head_is_the_embedding_quantized_at_once(art, ckpt):
    emb = bf16_to_f32(ckpt.tensor(TARGET_PREFIX + "embed_tokens.weight"))
    packed, scale, g = quantize_nvfp4(emb)  # the whole table in one call, its own global scale
    got = AR.unpack_linear(art, "embed_tokens")
    np.testing.assert_array_equal(got[0], packed)
    np.testing.assert_array_equal(got[1], scale)
    assert got[2] == np.float32(1) / g and art.entry("lm_head.weight_multiplier").multiplier == float(got[2])
    assert art.lm_head == "nvfp4"


def test_drafter_weights_round_trip(art, ckpt):
    d = ckpt.spec.drafter
    for layer in range(d.num_hidden_layers):
        for lin in drafter_linears(d, layer):
            raw = ckpt.draft_tensor(lin.prefix + ".weight")
            got = AR.unpack_half(art, "draft." + lin.prefix)
            np.testing.assert_array_equal(got, L.bf16_to_f16_bits(raw), err_msg=lin.prefix)
            # fp16 holds every bf16 value of the fp16 normal range exactly
            f = bf16_to_f32(raw)
            normal = np.abs(f) >= 2.0**-14
            np.testing.assert_array_equal(got.view(np.float16).astype(np.float32)[normal], f[normal])
    np.testing.assert_array_equal(AR.unpack_half(art, "draft.fc"), L.bf16_to_f16_bits(ckpt.draft_tensor("fc.weight")))
    for name in ("hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"):
        np.testing.assert_array_equal(art.array("draft." + name), ckpt.draft_tensor(name))


def test_vision_tower_is_written_in_its_layout(art, ckpt):
    """Every tower tensor of vision_layout is in the artifact with its shape, and holds vision_arrays' bytes (the
    padded fp16 GEMM weights: a padding column of o_proj is zero, a real one is the checkpoint's value)."""
    from thorgen.model_spec.vision_layout import vision_dims, vision_tensors
    from thorgen.runtime.convert.vision import vision_arrays

    spec = ckpt.spec
    want = vision_arrays(spec, ckpt.tensor, lambda n: P.bf16_or_f32(ckpt.tensor(n)))
    for name, (shape, _) in vision_tensors(spec).items():
        got = art.array(name)
        assert tuple(got.shape) == tuple(shape), name
        np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want[name].reshape(-1).view(np.uint8), name)
    d = vision_dims(spec)
    o = L.unpack_half(art.array("vision.layers.1.o").reshape(-1).view(np.uint16), d.hidden, d.heads * d.dp)
    o = o.reshape(d.hidden, d.heads, d.dp)
    assert (o[:, :, d.head_dim :] == 0).all()
    raw = ckpt.tensor("model.vision_tower.encoder.layers.1.self_attn.o_proj.linear.weight")
    np.testing.assert_array_equal(o[:, 1, : d.head_dim], L.bf16_to_f16_bits(raw)[:, d.head_dim : 2 * d.head_dim])


def test_layout_and_alignment(art):
    assert all(t.offset % 256 == 0 for t in art.tensors.values())
    spans = sorted((t.offset, t.offset + t.nbytes) for t in art.tensors.values())
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert art.header["arch"] == "sm_90a" and art.header["fp4_order"] == "shift"
    art.verify()


def test_bf16_lm_head_and_nat_order(tiny, ckpt):
    out = R.repack(tiny / "model", tiny / "art-bf16", lm_head="bf16", arch="sm_100a")
    a = WeightsArtifact.open(out, arch="sm_100a")
    assert a.lm_head == "bf16" and a.header["fp4_order"] == "nat"
    assert not any(n.startswith("lm_head") for n in a.tensors)
    got = AR.unpack_linear(a, "layers.4.experts.down_proj", expert=15)
    want = ckpt.nvfp4_parts(TARGET_PREFIX + "layers.4.experts.15.down_proj")
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    with pytest.raises(ArtifactError, match="not an arch name"):
        R.repack(tiny / "model", tiny / "art-bad", arch="hopper")


def test_default_output_folder_and_lookup(tiny, ckpt):
    model = tiny / "model2"
    shutil.copytree(tiny / "model", model)
    out = R.repack(model)
    assert out == model.resolve() / f"thorgen-{ckpt.spec.spec_hash[:12]}"
    assert find_artifact(model, ckpt.spec.spec_hash) == out
    with pytest.raises(ArtifactError, match="repack-weights --model"):
        find_artifact(tiny / "model", "0" * 64)


# ---- mismatches and damage ---------------------------------------------------------------------------------


def _copy(art, dst):
    shutil.copytree(art.folder, dst)
    return dst


def test_mismatch_errors_name_each_field(art, tmp_path):
    h = art.header
    with pytest.raises(ArtifactError, match=r"spec hash: artifact [0-9a-f]{12} \(model\), model 000000000000"):
        WeightsArtifact.open(art.folder, spec_hash="0" * 64)
    with pytest.raises(ArtifactError, match=rf"layout version: artifact {h['layout_version']}, runtime 999999"):
        WeightsArtifact.open(art.folder, layout_version=999999)
    with pytest.raises(ArtifactError, match="arch: artifact sm_90a, GPU sm_100a"):
        WeightsArtifact.open(art.folder, arch="sm_100a")
    with pytest.raises(ArtifactError) as info:
        WeightsArtifact.open(art.folder, spec_hash="0" * 64, layout_version=999999, arch="sm_120a")
    msg = str(info.value)
    assert "spec hash" in msg and "layout version" in msg and "arch" in msg and "repack-weights" in msg
    WeightsArtifact.open(art.folder, spec_hash=h["spec_hash"], layout_version=L.layout_version(), arch="sm_90a")


def test_truncated_weights_bin(art, tmp_path):
    d = _copy(art, tmp_path / "cut")
    last = max(art.tensors.values(), key=lambda t: t.offset)
    with open(d / "weights.bin", "r+b") as f:
        f.truncate(last.offset + 1)
    with pytest.raises(ArtifactError, match=rf"truncated.*first tensor cut: '{last.name}'"):
        WeightsArtifact.open(d)
    os.remove(d / "weights.bin")
    with pytest.raises(ArtifactError, match="weights.bin is missing"):
        WeightsArtifact.open(d)


def test_checksum_mismatch_names_the_tensor(art, tmp_path):
    d = _copy(art, tmp_path / "flip")
    t = art.entry("layers.3.mlp.down_proj.weight_packed")
    with open(d / "weights.bin", "r+b") as f:
        f.seek(t.offset + 17)
        b = f.read(1)
        f.seek(t.offset + 17)
        f.write(bytes([b[0] ^ 0x40]))
    damaged = WeightsArtifact.open(d)  # sizes still agree: only the checksum can tell
    with pytest.raises(
        ArtifactError, match=r"checksum mismatch in 1 tensor\(s\): layers\.3\.mlp\.down_proj\.weight_packed"
    ):
        damaged.verify()


def test_malformed_manifest(art, tmp_path):
    d = _copy(art, tmp_path / "bad")
    h = json.loads((d / "weights.json").read_text())
    h["tensors"]["norm.weight"]["offset"] += 4
    (d / "weights.json").write_text(json.dumps(h))
    with pytest.raises(ArtifactError, match="'norm.weight' entry is inconsistent"):
        WeightsArtifact.open(d)
    (d / "weights.json").write_text("{")
    with pytest.raises(ArtifactError, match="unreadable"):
        WeightsArtifact.open(d)
    with pytest.raises(ArtifactError, match="not found"):
        WeightsArtifact.open(tmp_path / "nothing")


def test_failed_repack_leaves_previous_artifact_intact(tiny, art, monkeypatch):
    out = tiny / "art-atomic"
    R.repack(tiny / "model", out, lm_head="bf16")
    before = (out / "weights.json").read_text()
    calls = {"n": 0}
    real = P.pack_matrix

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(P, "pack_matrix", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        R.repack(tiny / "model", out)
    assert (out / "weights.json").read_text() == before
    assert not [p for p in tiny.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    monkeypatch.setattr(P, "pack_matrix", real)
    R.repack(tiny / "model", out)  # replaces the previous artifact
    assert WeightsArtifact.open(out).lm_head == "nvfp4"
    assert not [p for p in tiny.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_worker_count_does_not_change_the_artifact(tiny, tmp_path):
    """jobs=3 (forked workers pwrite at planned offsets and hash their own tensors) == the one-process writer."""
    one = R.repack(tiny / "model", tmp_path / "one", jobs=1)
    three = R.repack(tiny / "model", tmp_path / "three", jobs=3)
    assert (one / "weights.bin").read_bytes() == (three / "weights.bin").read_bytes()
    m1, m3 = (json.loads((d / "weights.json").read_text()) for d in (one, three))
    assert m1 == m3 and len(m1["tensors"]) > 200
    WeightsArtifact.open(three).verify()
    with pytest.raises(ArtifactError, match="jobs"):
        R.repack(tiny / "model", tmp_path / "zero", jobs=0)
    assert not (tmp_path / "zero").exists()


def test_worker_failure_leaves_previous_artifact_intact(tiny, monkeypatch, tmp_path):
    out = tmp_path / "art"
    R.repack(tiny / "model", out, lm_head="bf16", jobs=2)
    before = (out / "weights.json").read_text()
    calls = {"n": 0}
    real = P.pack_matrix

    def failing(*a, **k):  # inherited by the forked workers: each fails on its 5th matrix
        calls["n"] += 1
        if calls["n"] >= 5:
            raise RuntimeError("disk on fire")
        return real(*a, **k)

    monkeypatch.setattr(P, "pack_matrix", failing)
    with pytest.raises(RuntimeError, match="disk on fire"):
        R.repack(tiny / "model", out, jobs=2)
    assert (out / "weights.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_repack_cli(tiny, tmp_path):
    from click.testing import CliRunner

    from thorgen.runtime.convert.cli import repack_weights

    out = tmp_path / "cli-art"
    res = CliRunner().invoke(
        repack_weights, ["--model", str(tiny / "model"), "--out", str(out), "--verify", "--lm-head", "bf16"]
    )
    assert res.exit_code == 0, res.output
    assert "verified" in res.output and str(out) in res.output
    assert WeightsArtifact.open(out).lm_head == "bf16"
    res = CliRunner().invoke(
        repack_weights,
        ["--model", str(tiny / "model"), "--out", str(tmp_path / "j2"), "-q", "--lm-head", "bf16", "--jobs", "2"],
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "j2" / "weights.bin").read_bytes() == (out / "weights.bin").read_bytes()
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(repack_weights, ["--model", str(tmp_path / "empty"), "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "config.json" in res.output and not (tmp_path / "x").exists()


def test_column_chunked_packing_equals_whole(tiny, art, monkeypatch):
    """The lm_head and drafter matrices packed in one piece (lm_head quantized in 48-row blocks) give the same bytes
    as in 64-column pieces (a chunking bug would change checksums)."""
    monkeypatch.setattr(P, "LM_HEAD_ROW_BLOCK", 48)
    small = WeightsArtifact.open(R.repack(tiny / "model", tiny / "art-chunks", chunk_cols=1 << 20))
    assert small.tensors.keys() == art.tensors.keys()
    differ = [n for n in art.tensors if small.entry(n).checksum != art.entry(n).checksum]
    assert differ == []
