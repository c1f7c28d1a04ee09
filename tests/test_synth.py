"""Tests for model_spec/synth: determinism, layout, sane weights, the full-preset (direct NVFP4) code path, CLI."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from thorgen.model_spec import nvfp4
from thorgen.model_spec.checkpoint import Checkpoint
from thorgen.model_spec.config import drafter_config, target_config
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.safetensors_io import build_header
from thorgen.model_spec.safetensors_shards import plan_shards
from thorgen.model_spec.synth import write_synthetic_checkpoint
from thorgen.model_spec.synth.writer import FULL_SHARD_BYTES
from thorgen.model_spec.tensors import TARGET_PREFIX, target_tensors, vision_tensors
from thorgen.model_spec.types import ModelSpec

P = TARGET_PREFIX


def _digest(folder) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth") / "tiny"
    write_synthetic_checkpoint("tiny", out, seed=0, progress=False)
    return out


def test_same_seed_same_bytes_other_seed_differs(tiny, tmp_path):
    again = write_synthetic_checkpoint("tiny", tmp_path / "again", seed=0, progress=False)
    other = write_synthetic_checkpoint("tiny", tmp_path / "other", seed=1, progress=False)
    a, b, c = _digest(tiny), _digest(again), _digest(other)
    assert a == b
    weights = [k for k in a if k.endswith(".safetensors")]
    assert len(weights) == 3 and all(a[k] != c[k] for k in weights)
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_worker_count_does_not_change_bytes(tiny, tmp_path):
    """jobs > 1 (worker processes pwrite into preallocated shards) gives the same files as the one-process
    streaming writer that made `tiny` (default jobs is 1 below 256 MB)."""
    four = write_synthetic_checkpoint("tiny", tmp_path / "four", seed=0, progress=False, jobs=4)
    two = write_synthetic_checkpoint("tiny", tmp_path / "two", seed=0, progress=False, jobs=2)
    assert _digest(four) == _digest(tiny) == _digest(two)
    other = write_synthetic_checkpoint("tiny", tmp_path / "other", seed=1, progress=False, jobs=3)
    assert all(_digest(other)[k] != v for k, v in _digest(tiny).items() if k.endswith(".safetensors"))
    with pytest.raises(ValueError, match="jobs"):
        write_synthetic_checkpoint("tiny", tmp_path / "zero", progress=False, jobs=0)
    assert not (tmp_path / "zero").exists() and not list(tmp_path.glob("*.tmp-*"))


def test_layout_and_configs(tiny):
    spec = get_preset("tiny")
    assert json.loads((tiny / "config.json").read_text()) == json.loads(
        json.dumps(target_config(spec.target, spec.vision))
    )
    assert json.loads((tiny / "dflash" / "config.json").read_text()) == json.loads(
        json.dumps(drafter_config(spec.drafter))
    )
    assert json.loads((tiny / "generation_config.json").read_text()) == {
        "bos_token_id": 2,
        "do_sample": True,
        "eos_token_id": [1, 106, 50],
        "pad_token_id": 0,
        "temperature": 1.0,
        "top_k": 64,
        "top_p": 0.95,
    }
    template = (tiny / "chat_template.jinja").read_text()
    assert json.loads((tiny / "tokenizer_config.json").read_text())["chat_template"] == template
    assert (tiny / "model.safetensors.index.json").is_file() and (tiny / "dflash" / "model.safetensors").is_file()
    assert not list(tiny.parent.glob("*.tmp-*"))


def test_refuses_non_empty_dir_and_force_replaces(tiny, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        write_synthetic_checkpoint("tiny", out, progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    write_synthetic_checkpoint("tiny", out, progress=False, force=True)
    assert not (out / "keep.txt").exists() and _digest(out) == _digest(tiny)
    assert not list(tmp_path.glob("busy.*"))


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_synthetic_checkpoint("tiny", tmp_path / "x", progress=False, chat_template_path=tmp_path / "none")
    with pytest.raises(ValueError, match="unknown preset"):
        write_synthetic_checkpoint("nope", tmp_path / "y", progress=False)
    assert list(tmp_path.iterdir()) == []


def _rms(x, axis=-1):
    return np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + 1e-6)


def test_router_spreads_over_experts(tiny):
    """Router of every layer on embedded random tokens (numpy): at least half of the experts get picked."""
    ck = Checkpoint.open(tiny)
    t = ck.spec.target
    rng = np.random.default_rng(0)
    x = ck.weight_f32(P + "embed_tokens.weight")[rng.integers(0, t.vocab_size, 64)] * np.float32(t.embed_scale)
    for layer in range(t.num_hidden_layers):
        p = f"{P}layers.{layer}.router."
        hn = x / _rms(x) * ck.weight_f32(p + "scale") * t.hidden_size**-0.5
        logits = hn @ ck.weight_f32(p + "proj.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[:, : t.top_k_experts]
        assert len(np.unique(top)) >= t.num_experts // 2, layer
        assert probs.max() < 0.9  # not one-hot
        pes = ck.weight_f32(p + "per_expert_scale")
        assert np.all((pes > 0.75) & (pes < 1.25)) and pes.std() > 0.01


def test_weights_are_numerically_sane(tiny):
    ck = Checkpoint.open(tiny)
    t = ck.spec.target
    for layer in range(t.num_hidden_layers):
        p = f"{P}layers.{layer}."
        assert 0.75 < ck.weight_f32(p + "layer_scalar")[0] <= 1.0
        w = ck.linear_f32(p + "self_attn.o_proj")
        assert np.isfinite(w).all() and abs(w.std() * np.sqrt(w.shape[1]) - 1) < 0.1
        qn = ck.weight_f32(p + "self_attn.q_norm.weight")
        assert abs(qn.mean() - t.layer_head_dim(layer) ** -0.25) < 0.05
    emb = ck.weight_f32(P + "embed_tokens.weight")
    assert abs(emb.std() * np.sqrt(t.hidden_size) - 1) < 0.05


# ---- the full-preset code path, without writing 16 GB ------------------------------------------------------------


def _medium() -> ModelSpec:
    tiny = get_preset("tiny")
    target = dataclasses.replace(
        tiny.target,
        hidden_size=512,
        num_hidden_layers=2,
        layer_types=tiny.target.layer_types[1:3],
        intermediate_size=384,
        moe_intermediate_size=192,
        num_experts=8,
        top_k_experts=2,
    )
    drafter = dataclasses.replace(
        tiny.drafter, hidden_size=512, target_layer_ids=(0, 1), num_target_layers=2, intermediate_size=256
    )
    return ModelSpec("medium", target, drafter)


def test_direct_nvfp4_path_on_medium_spec(tmp_path):
    spec = _medium()
    out = write_synthetic_checkpoint(spec, tmp_path / "m", seed=3, progress=False, method="direct", shard_bytes=1 << 20)
    assert json.loads((out / "synth_info.json").read_text())["nvfp4_method"] == "direct"
    assert len(json.loads((out / "model.safetensors.index.json").read_text())["metadata"]) == 1
    assert len(list(out.glob("model-*.safetensors"))) >= 3
    ck = Checkpoint.open(out)
    for prefix in [
        P + "layers.0.self_attn.q_proj",
        P + "layers.1.self_attn.k_proj",
        P + "layers.0.mlp.down_proj",
        P + "layers.1.experts.7.down_proj",
    ]:
        w = ck.linear_f32(prefix)
        want = w.shape[1] ** -0.5
        assert np.isfinite(w).all() and abs(w.std() / want - 1) < 0.05, prefix
        codes = nvfp4.unpack_e2m1(ck.tensor(prefix + ".weight_packed"))
        assert len(np.unique(codes)) == 16  # every code is used, small magnitudes most often
        hist = np.bincount(codes.ravel() & 7, minlength=8)
        assert hist[7] < hist[4]
        gs = ck.tensor(prefix + ".weight_global_scale")[0]
        assert 0.5 < gs * want * 5 / 2688 < 2  # ~ 448*6/amax for amax ~ 5 std, as the quantizer would give
    ck.weight_f32(P + "embed_tokens.weight")


def test_full_preset_streaming_plan():
    spec = get_preset("gemma-4-26b-a4b")
    infos = target_tensors(spec.target)
    # 4 tensors per NVFP4 Linear (sliding layers: q k v o + 3 dense + 128*3 experts; full layers have no v),
    # 13 plain tensors per layer, embedding + final norm. The seed loader counted 47648 for the real file,
    # 356 more: the vision tower (27 ViT layers x 13 + patch projection, position table, std_bias, std_scale)
    # and its projection into the text model, which vision_tensors lists.
    assert len(infos) == 4 * (25 * (4 + 3 + 384) + 5 * (3 + 3 + 384)) + 30 * 13 + 2
    vision = vision_tensors(spec.vision, spec.target.hidden_size)
    assert len(vision) == 356 and len(infos) + len(vision) == 47648
    assert 1.14e9 < sum(t.nbytes for t in vision) < 1.15e9  # 572.8 M bf16 parameters
    header, entries = build_header(infos, {"format": "pt"})
    assert len(header) % 8 == 0 and len(header) < 100 << 20
    assert entries[0].begin == 0 and all(a.end == b.begin for a, b in zip(entries, entries[1:]))
    total = entries[-1].end
    assert 15e9 < total < 17.5e9  # the real NVFP4 file is 16.4 GB
    shards = plan_shards(infos, FULL_SHARD_BYTES)
    sizes = [sum(t.nbytes for t in s) for s in shards]
    assert sum(sizes) == total and max(sizes) <= FULL_SHARD_BYTES and len(shards) == 4
    # per Linear the four NVFP4 parts stay together in one shard (they are generated together)
    where = {t.name: i for i, s in enumerate(shards) for t in s}
    for t in infos:
        if t.role == "input_global_scale":
            assert where[t.name] == where[t.name.replace("input_global_scale", "weight_packed")]


def test_cli(tmp_path):
    from click.testing import CliRunner

    from thorgen.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["synth-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "c"), "--seed", "2"])
    assert res.exit_code == 0, res.output
    assert "[synth]" in res.output and Checkpoint.open(tmp_path / "c").spec.target.vocab_size == 512
    res = runner.invoke(main, ["synth-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "c")])
    assert res.exit_code != 0 and "--force" in res.output
    res = runner.invoke(
        main, ["synth-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "c"), "--force", "--quiet"]
    )
    assert res.exit_code == 0 and "[synth]" not in res.output
    assert json.loads((tmp_path / "c" / "synth_info.json").read_text())["seed"] == 0
    res = runner.invoke(
        main, ["synth-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "j"), "--jobs", "2", "--quiet"]
    )
    assert res.exit_code == 0, res.output
    assert _digest(tmp_path / "j") == _digest(tmp_path / "c")
    res = runner.invoke(main, ["synth-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "k"), "--jobs", "0"])
    assert res.exit_code != 0 and "--jobs" in res.output and not (tmp_path / "k").exists()


def test_vision_quantization_ignore_matches_the_real_config(shared_dir):
    """target_config's quantization ignore list names the tower's Linears as the RedHatAI config does."""
    real = json.loads((shared_dir / "seed_data/reference/redhatai_nvfp4_config.json").read_text())
    spec = get_preset("gemma-4-26b-a4b")
    ours = target_config(spec.target, spec.vision)["quantization_config"]["ignore"]
    assert ours == real["quantization_config"]["ignore"]


def test_tiny_synth_has_image_tokens_and_a_preprocessor_config(tiny_checkpoint):
    from tokenizers import Tokenizer

    vision = get_preset("tiny").vision
    tok = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert (
        [tok.token_to_id(t) for t in ("<|image>", "<|image|>", "<image|>", "<|video|>")]
        == [vision.boi_token_id, vision.image_token_id, vision.eoi_token_id, vision.video_token_id]
        == [60, 61, 62, 63]
    )
    assert tok.encode("a<|image|>b").ids.count(61) == 1
    pre = json.loads((tiny_checkpoint / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Gemma4ImageProcessor" and pre["max_soft_tokens"] == 280
    assert (pre["patch_size"], pre["pooling_kernel_size"], pre["do_normalize"]) == (16, 3, False)


def test_full_synth_tokenizer_puts_image_tokens_at_the_real_ids():
    from thorgen.model_spec.synth.tokenizer import build_tokenizer, media_special_ids

    vision = get_preset("gemma-4-26b-a4b").vision
    tok = build_tokenizer(262144, media_special_ids(vision))
    assert tok.token_to_id("<|image|>") == 258880 and tok.token_to_id("<|image>") == 255999
    assert tok.token_to_id("<image|>") == 258882 and tok.token_to_id("<|video|>") == 258884
