"""The NumPy reference target vs HF transformers' Gemma4ForCausalLM (float32, eager) on the synthetic tiny checkpoint.

HF gets the DEQUANTIZED NVFP4 weights, with the per-expert Linears fused the way its in-memory experts are:
`experts.gate_up_proj` [E, 2*Ie, H] = concat(gate, up) along the output axis (its forward does
`linear(x, gate_up_proj[e]).chunk(2)` -> gate first), `experts.down_proj` [E, H, Ie].
Embedding normaliser: HF multiplies by its float32 buffer sqrt(H) cast to the weight dtype (float32 here);
the reference uses float32(sqrt(H)) too, and for tiny (H=256) that is exactly 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from thorgen.model_spec.config import target_config
from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.reference.backend import ReferenceBackend
from thorgen.runtime.reference.model import TargetModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_state_dict(ckpt, spec) -> dict:
    """The checkpoint's weights under HF's names (runtime/bench/peer.py, what `bench --peer hf` loads), float32."""
    from thorgen.runtime.bench.peer import hf_state_dict as peer_state

    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in peer_state(ckpt).items()}


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    spec = tiny_ckpt.spec.target
    cfg = transformers.Gemma4TextConfig(**target_config(spec)["text_config"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(cfg).eval().float()
    missing, unexpected = model.load_state_dict(hf_state_dict(tiny_ckpt, spec), strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if k != "lm_head.weight"], missing
    return model


def prompt(n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [2] + [int(t) for t in rng.integers(5, 512, n - 1)]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_prefill_logits_match_hf(tiny_ckpt, hf_model) -> None:
    ids = prompt(40, 1)  # longer than the tiny sliding window (16)
    assert len(ids) > tiny_ckpt.spec.target.sliding_window
    ref = TargetModel(tiny_ckpt)
    ours = ref.forward(ids, ref.new_cache()).logits
    theirs = hf_logits(hf_model, ids)
    err = rel(ours, theirs)
    print(f"\nreference vs HF Gemma4ForCausalLM float32, 40-token prefill logits: rel err {err:.3e}")
    assert err <= TOL
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_incremental_decode_and_verify_match_hf(tiny_ckpt, hf_model) -> None:
    """Prefill 20, 6 one-token decodes, then an 11-token verify chunk == HF's full forward over all 37."""
    ids = prompt(37, 2)
    ref = TargetModel(tiny_ckpt)
    cache = ref.new_cache()
    rows = [ref.forward(ids[:20], cache).logits]
    rows += [ref.forward([t], cache).logits for t in ids[20:26]]
    rows.append(ref.forward(ids[26:], cache).logits)
    ours = np.concatenate(rows)
    err = rel(ours, hf_logits(hf_model, ids))
    print(f"\nreference (KV-cached decode + verify) vs HF: rel err {err:.3e}")
    assert err <= TOL
    # a rollback then re-run of the same tokens reproduces the logits
    cache.truncate(30)
    again = ref.forward(ids[30:], cache).logits
    assert rel(again, ours[30:]) <= 1e-6


def test_greedy_32_tokens_match_hf_generate(tiny_ckpt, hf_model) -> None:
    for seed in (3, 4):
        ids = prompt(40, seed)
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        theirs = out[0, len(ids) :].tolist()
        ours = ReferenceBackend(tiny_ckpt).generate(ids, 32, SamplingParams()).token_ids
        assert ours == theirs


def _hf_model_of(ckpt):
    cfg = transformers.Gemma4TextConfig(**target_config(ckpt.spec.target)["text_config"])
    cfg._attn_implementation = "eager"
    model = transformers.Gemma4ForCausalLM(cfg).eval().float()
    missing, unexpected = model.load_state_dict(hf_state_dict(ckpt, ckpt.spec.target), strict=False)
    assert not unexpected and not [k for k in missing if k != "lm_head.weight"], (missing, unexpected)
    return model


# The bf16 form of the tiny model and the ModelOpt experts-only conversion of its compressed-tensors checkpoint
# (tests/modelopt_convert.py: the experts' exact bytes, attention + dense MLP as bf16) hold the compressed-tensors
# weights rounded to bf16 (every linear, or attention + dense MLP). One bf16 rounding per weight (2^-9 relative)
# moves 40-token prefill logits by 4.2% relative (both forms, measured), most of it from the router's top-k
# flipping on near-ties; FORMAT_TOL leaves headroom and every greedy token must still agree.
FORMAT_TOL = 0.08


def test_bf16_checkpoint_matches_hf_and_its_compressed_tensors_form(
    tiny_checkpoint, tiny_ckpt, tiny_format_checkpoints, tmp_path
) -> None:
    from modelopt_convert import convert_ct_to_modelopt
    from thorgen.model_spec.checkpoint import Checkpoint

    ids = prompt(40, 1)
    bf16 = Checkpoint.open(tiny_format_checkpoints["bf16"])
    ref = TargetModel(bf16)
    ours = ref.forward(ids, ref.new_cache()).logits
    theirs = hf_logits(_hf_model_of(bf16), ids)
    assert rel(ours, theirs) <= TOL
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))
    ct = TargetModel(tiny_ckpt)
    ct_logits = ct.forward(ids, ct.new_cache()).logits
    mo = TargetModel(Checkpoint.open(convert_ct_to_modelopt(tiny_checkpoint, tmp_path / "mo", "experts-only")))
    mo_logits = mo.forward(ids, mo.new_cache()).logits
    errs = rel(ours, ct_logits), rel(mo_logits, ct_logits)
    print(f"\nbf16 vs HF {rel(ours, theirs):.2e}; vs compressed-tensors: bf16 {errs[0]:.2e}, modelopt {errs[1]:.2e}")
    assert max(errs) <= FORMAT_TOL and min(errs) > 0
    for logits in (ours, mo_logits):
        assert np.array_equal(logits.argmax(-1), ct_logits.argmax(-1))
