"""The NumPy DFlash drafter vs z-lab's own `dflash` package (DFlashDraftModel, torch, float32) on the tiny checkpoint.

The oracle gets the drafter's bf16 weights as float32, the target taps from the reference target, and its
draft-input embedding through its own path (`dflash_config.input_embedding_scale`, set to sqrt(H), the Gemma
normaliser). Its per-layer masks come from `layer_types`: sliding layers causal with their window, the full
layer bidirectional ("Hybrid DFlash"). The prompt (40) is longer than the tiny drafter window (32).
"""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec.config import drafter_config
from thorgen.model_spec.tensors import drafter_tensors
from thorgen.runtime.reference.drafter import DFlashDrafter
from thorgen.runtime.reference.model import TargetModel

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
dflash_model = pytest.importorskip("dflash.model")

TOL = 1e-4
P = 40


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_oracle(ckpt, is_causal: bool | None = None):
    spec = ckpt.spec.drafter
    cfg = drafter_config(spec)
    cfg.pop("rope_scaling", None)
    theta = cfg.pop("rope_theta")
    cfg["dflash_config"]["input_embedding_scale"] = float(spec.hidden_size) ** 0.5
    if is_causal is not None:  # dflash's override: the same causality for every layer (used to show the mask matters)
        cfg["is_causal"] = is_causal
    from transformers import Qwen3Config

    qcfg = Qwen3Config(**cfg, rope_parameters={"rope_type": "default", "rope_theta": theta})
    qcfg._attn_implementation = "sdpa"
    model = dflash_model.DFlashDraftModel(qcfg).eval().float()
    sd = {t.name: torch.from_numpy(ckpt.draft_weight_f32(t.name)) for t in drafter_tensors(spec)}
    model.load_state_dict(sd, strict=True)
    return model


class _Target(torch.nn.Module):
    """Just what dflash needs from a target: input embeddings and the (tied) lm_head."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(*table.shape)
        self.embed.weight.data = torch.from_numpy(table.copy())
        self.lm_head = torch.nn.Linear(table.shape[1], table.shape[0], bias=False)
        self.lm_head.weight.data = torch.from_numpy(table.copy())

    def get_input_embeddings(self):
        return self.embed


def oracle_logits(model, target: _Target, taps: np.ndarray, block: list[int], start: int) -> np.ndarray:
    ids = torch.tensor([block])
    scale = float(dflash_model._draft_value(model.config, "input_embedding_scale", 1.0))
    with torch.no_grad():
        noise = dflash_model._raw_input_embeddings(target, ids, scale)
        h = model(
            position_ids=torch.arange(start + len(block))[None],
            noise_embedding=noise,
            target_hidden=torch.from_numpy(taps[:start])[None],
        )
        return model.compute_logits(h, target.lm_head)[0].numpy()


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    target = TargetModel(tiny_ckpt)
    drafter = DFlashDrafter(tiny_ckpt, target)
    rng = np.random.default_rng(11)
    ids = [2] + [int(t) for t in rng.integers(5, 512, P + 7)]
    out = target.forward(ids, target.new_cache(), taps=drafter.tap_layers)
    taps = np.concatenate([out.taps[l] for l in drafter.tap_layers], axis=-1)
    return target, drafter, taps, _Target(target.embedding_table())


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_embed_scale_default_is_sqrt_hidden(tiny_ckpt) -> None:
    spec = tiny_ckpt.spec.drafter
    assert spec.embed_scale == pytest.approx(spec.hidden_size**0.5)


def test_draft_logits_match_dflash(tiny_ckpt, setup) -> None:
    target, drafter, taps, tgt = setup
    assert P > tiny_ckpt.spec.drafter.sliding_window
    block = [77] + [drafter.spec.mask_token_id] * (drafter.block_size - 1)
    ctx = drafter.new_context()
    ctx.append(taps[:25])
    drafter.sync_context(ctx)  # the context K/V built in two pieces, as during decoding
    ctx.append(taps[25:P])
    ours = drafter.block_logits(ctx, block, P)
    theirs = oracle_logits(make_oracle(tiny_ckpt), tgt, taps, block, P)
    err = rel(ours, theirs)
    print(f"\ndrafter vs dflash DFlashDraftModel: rel err {err:.3e}")
    assert err <= TOL
    assert drafter.propose(ctx, 77, P) == [int(i) for i in theirs[1:].argmax(-1)]
    # the hybrid mask matters: all-causal or all-bidirectional oracles disagree with it
    for is_causal in (True, False):
        other = oracle_logits(make_oracle(tiny_ckpt, is_causal), tgt, taps, block, P)
        assert rel(other, theirs) > 100 * TOL
    # so does the sqrt(H) draft-embedding scale
    unscaled = make_oracle(tiny_ckpt)
    unscaled.config.dflash_config["input_embedding_scale"] = 1.0
    assert rel(oracle_logits(unscaled, tgt, taps, block, P), theirs) > 100 * TOL


def test_context_rollback_matches_fresh_context(tiny_ckpt, setup) -> None:
    target, drafter, taps, tgt = setup
    block = [123] + [drafter.spec.mask_token_id] * (drafter.block_size - 1)
    ctx = drafter.new_context()
    ctx.append(taps)
    drafter.sync_context(ctx)
    ctx.truncate(P - 3)  # rollback crops taps and context K/V together
    ours = drafter.block_logits(ctx, block, P - 3)
    fresh = drafter.new_context()
    fresh.append(taps[: P - 3])
    assert np.array_equal(drafter.block_logits(fresh, block, P - 3), ours)
    theirs = oracle_logits(make_oracle(tiny_ckpt), tgt, taps, block, P - 3)
    assert rel(ours, theirs) <= TOL
    with pytest.raises(ValueError):
        drafter.block_logits(ctx, block, P)  # the block must start right after the context
