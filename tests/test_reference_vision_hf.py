"""The NumPy vision tower and the reference language model with images vs HF transformers (float32, eager) on the
synthetic tiny checkpoint: Gemma4VisionModel (+ the embed_vision projection) and Gemma4ForConditionalGeneration
with mm_token_type_ids, on images longer than the sliding window (16) so the window clamp of the image block is
exercised. A reference with a wrong mask (the overlay on full layers too, or causal everywhere) must fail.

Needs a transformers with the sliding-only image mask (transformers #46711, fixed by PR #46850)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.config import target_config
from thorgen.runtime.media.images import load_image
from thorgen.runtime.media.prompts import expand_image_tokens
from thorgen.runtime.reference import model as model_module
from thorgen.runtime.reference.model import TargetModel
from thorgen.runtime.reference.ops import window_visible
from thorgen.runtime.reference.vision import VisionModel

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def image_bytes(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth content (a random low-resolution grid, upscaled) rather than pure noise: closer to a photo
    small = rng.integers(0, 256, (max(h // 20, 2), max(w // 20, 2), 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.BILINEAR).save(buf, format="PNG")
    return buf.getvalue()


def hf_config(spec):
    cfg = target_config(spec.target, spec.vision)
    cfg.pop("quantization_config")
    config = transformers.Gemma4Config(**cfg)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    return config


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    from thorgen.runtime.bench.peer import hf_state_dict

    spec = tiny_ckpt.spec
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(hf_config(spec)).eval().float()
    state = {"model.language_model." + k[len("model.") :]: v for k, v in hf_state_dict(tiny_ckpt).items()}
    state |= {t.name: tiny_ckpt.weight_f32(t.name) for t in tiny_ckpt.vision_inventory}
    state = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if k != "lm_head.weight"], missing
    return model


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


IMAGES = {"wide": (200, 330, 1), "tall": (500, 120, 2)}


@pytest.fixture(scope="module")
def images(tiny_ckpt):
    return {k: load_image(image_bytes(h, w, s), tiny_ckpt.spec.vision, 70) for k, (h, w, s) in IMAGES.items()}


def hf_pixels(images):
    n = max(i.patches.shape[0] for i in images)
    pv = np.zeros((len(images), n, images[0].patches.shape[1]), np.float32)
    pos = np.full((len(images), n, 2), -1, np.int64)
    for b, img in enumerate(images):
        pv[b, : img.patches.shape[0]] = img.pixel_values()
        pos[b, : img.patches.shape[0]] = img.positions
    return torch.from_numpy(pv), torch.from_numpy(pos)


def test_vision_tower_matches_hf(tiny_ckpt, hf_model, images) -> None:
    ours_model = VisionModel(tiny_ckpt)
    batch = [images["wide"], images["tall"]]
    pv, pos = hf_pixels(batch)  # HF pads the shorter image: the padding must not change its rows
    with torch.no_grad():
        theirs = hf_model.model.get_image_features(pixel_values=pv, image_position_ids=pos)
    theirs = getattr(theirs, "pooler_output", theirs)
    theirs = (theirs if isinstance(theirs, torch.Tensor) else torch.cat(list(theirs))).numpy().reshape(-1, 256)
    ours = np.concatenate([ours_model.encode(i) for i in batch])
    assert ours.shape == theirs.shape == (sum(i.soft_tokens for i in batch), 256)
    err = rel(ours, theirs)
    print(f"\nNumPy vision tower + projection vs HF: rel err {err:.3e}")
    assert err <= TOL
    feats = ours_model.features(batch[0])  # the weightless RMSNorm leaves unit-rms rows: the tail is O(1)
    assert np.allclose(np.sqrt((feats.astype(np.float64) ** 2).mean(-1)), 1.0, atol=1e-3)


def prompt_with(tiny_ckpt, names: list[str], images):
    vision = tiny_ckpt.spec.vision
    ids = [2, 105, 40, 41]
    for k, _ in enumerate(names):
        ids += [vision.image_token_id, 70 + k, 90]
    ids += [106, 105, 200, 201]
    return expand_image_tokens(ids, [images[n] for n in names], vision)


def hf_logits(model, ids, spans, vision):
    types = np.zeros(len(ids), np.int64)
    for s in spans:
        types[s.offset : s.end] = 1
    pv, pos = hf_pixels([s.image for s in spans])
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            pixel_values=pv,
            image_position_ids=pos,
            mm_token_type_ids=torch.from_numpy(types)[None],
        )
    return out.logits[0].numpy()


def ours_logits(tiny_ckpt, ids, spans, chunks=None):
    ref, tower = TargetModel(tiny_ckpt), VisionModel(tiny_ckpt)
    cache = ref.new_cache()
    cuts = chunks or [len(ids)]
    rows, start = [], 0
    for end in cuts:
        mm = [(s.offset - start, tower.encode(s.image)) for s in spans if start <= s.offset < end]
        rows.append(ref.forward(ids[start:end], cache, images=mm).logits)
        start = end
    return np.concatenate(rows)


@pytest.mark.parametrize("names", [["wide"], ["wide", "tall"]])
def test_logits_with_images_match_hf(tiny_ckpt, hf_model, images, names) -> None:
    ids, spans = prompt_with(tiny_ckpt, names, images)
    assert all(s.image.soft_tokens > tiny_ckpt.spec.target.sliding_window for s in spans)
    theirs = hf_logits(hf_model, ids, spans, tiny_ckpt.spec.vision)
    ours = ours_logits(tiny_ckpt, ids, spans)
    err = rel(ours, theirs)
    print(f"\nreference with {len(names)} image(s) vs HF Gemma4ForConditionalGeneration: rel err {err:.3e}")
    assert err <= TOL
    # chunked prefill: chunks that end at span boundaries give the same logits
    cuts = [spans[0].offset, spans[0].end] + ([spans[1].end] if len(spans) > 1 else []) + [len(ids)]
    assert rel(ours_logits(tiny_ckpt, ids, spans, cuts), theirs) <= TOL


def wrong_overlay_on_full_layers(self, layer, x, cache, start, blocks=None):
    if blocks is None:
        return right_attention(self, layer, x, cache, start, blocks)
    spec = self.spec
    window = spec.layer_window(layer)
    if window is not None:
        return right_attention(self, layer, x, cache, start, blocks)
    # the old HF behaviour: full layers see the whole image block too
    object.__setattr__(spec, "layer_window", lambda l: 10**9)
    try:
        return right_attention(self, layer, x, cache, start, blocks)
    finally:
        object.__delattr__(spec, "layer_window")


right_attention = TargetModel._attention


@pytest.mark.parametrize("wrong", ["causal everywhere", "overlay on full layers"])
def test_a_wrong_image_mask_fails_the_comparison(tiny_ckpt, hf_model, images, wrong, monkeypatch) -> None:
    ids, spans = prompt_with(tiny_ckpt, ["wide"], images)
    theirs = hf_logits(hf_model, ids, spans, tiny_ckpt.spec.vision)
    if wrong == "causal everywhere":
        monkeypatch.setattr(
            model_module,
            "window_visible",
            lambda q, k, causal, window, qb=None, kb=None: window_visible(q, k, causal, window),
        )
    else:
        monkeypatch.setattr(TargetModel, "_attention", wrong_overlay_on_full_layers)
    err = rel(ours_logits(tiny_ckpt, ids, spans), theirs)
    print(f"\nreference with the mask {wrong!r} vs HF: rel err {err:.3e}")
    assert err > 100 * TOL
