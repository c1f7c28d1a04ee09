"""Thin images (1-3 px strips) at every soft-token budget: HF's sizes where the tower's position table covers them,
a side shortened to the table where it does not, positions the reference tower and the cuda program both accept,
a 200 through the openai client, and a cached demo checkpoint from an older release synthesized again."""

from __future__ import annotations

import dataclasses
import io
import json

import numpy as np
import pytest
from PIL import Image

from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.vision_layout import vision_dims
from thorgen.runtime.cuda.vision import check_image
from thorgen.runtime.media.images import SOFT_TOKEN_BUDGETS, ImageError, load_image

SPEC = get_preset("tiny")
VISION = SPEC.vision
STRIPS = [(1, 500), (500, 1), (3, 1000), (1000, 3), (8000, 1), (1, 8000)]  # (height, width)


def strip_png(height: int, width: int) -> bytes:
    rng = np.random.default_rng(height * 31 + width)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_the_demo_tower_positions_the_longest_strip_of_every_budget() -> None:
    assert VISION.position_embedding_size >= max(SOFT_TOKEN_BUDGETS) * VISION.pooling_kernel_size


@pytest.mark.parametrize("budget", SOFT_TOKEN_BUDGETS)
@pytest.mark.parametrize("size", STRIPS)
def test_strips_match_hf_and_both_towers_take_them(size, budget, tiny_ckpt) -> None:
    from thorgen.runtime.reference.vision import VisionModel

    img = load_image(strip_png(*size), VISION, budget)
    assert 1 <= img.soft_tokens <= budget and int(np.asarray(img.positions).max()) < VISION.position_embedding_size
    check_image(vision_dims(SPEC), img)  # the cuda backend's vision program
    rows = VisionModel(tiny_ckpt).embed_patches(img.pixel_values(), np.asarray(img.positions))  # the reference's
    assert rows.shape == (img.patches.shape[0], VISION.hidden_size) and np.isfinite(rows).all()
    transformers = pytest.importorskip("transformers")
    pil = Image.open(io.BytesIO(strip_png(*size)))
    hf = transformers.Gemma4ImageProcessorPil(max_soft_tokens=budget)(images=[pil], return_tensors="np")
    n = img.patches.shape[0]
    assert np.array_equal(np.asarray(hf["image_position_ids"])[0][:n], img.positions)
    assert np.array_equal(np.asarray(hf["pixel_values"])[0][:n], img.pixel_values())


@pytest.mark.parametrize("budget", [560, 1120])
@pytest.mark.parametrize("size", STRIPS)
def test_a_side_longer_than_the_table_is_shortened_to_it(size, budget) -> None:
    short = dataclasses.replace(SPEC, vision=dataclasses.replace(VISION, position_embedding_size=1024))
    img = load_image(strip_png(*size), short.vision, budget)
    pos = np.asarray(img.positions)
    assert pos.max() < 1024 and 1 <= img.soft_tokens <= budget
    grid = pos.max(axis=0) + 1  # (patches across, patches down): whole 3x3 cells, the long side at the table's
    assert (grid % 3 == 0).all() and grid.max() == 1023 // 3 * 3
    check_image(vision_dims(short), img)


def test_a_table_shorter_than_one_cell_is_refused() -> None:
    tiny_table = dataclasses.replace(VISION, position_embedding_size=2)
    with pytest.raises(ImageError, match="position table"):
        load_image(strip_png(1, 500), tiny_table, 70)


def test_a_strip_at_560_tokens_is_answered(tiny_checkpoint) -> None:
    import base64

    openai = pytest.importorskip("openai")
    from tiny_server import openai_client, tiny_server

    url = "data:image/png;base64," + base64.b64encode(strip_png(1, 300)).decode()
    with tiny_server(tiny_checkpoint, ctx=1024) as (base, _):
        r = openai_client(base).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
            max_tokens=1,
            extra_body={"mm_processor_kwargs": {"max_soft_tokens": 560}},
        )
    assert isinstance(r, openai.types.chat.ChatCompletion) and r.usage.prompt_tokens > 409  # 409 soft tokens


def test_an_outdated_demo_checkpoint_is_synthesized_again(tmp_path, monkeypatch) -> None:
    from thorgen.model_spec.synth import synthetic_config
    from thorgen.serve.demo import demo_dir, ensure_demo_checkpoint

    monkeypatch.setenv("THORGEN_CACHE_DIR", str(tmp_path))
    old = json.loads(json.dumps(synthetic_config("tiny")))
    old["vision_config"]["position_embedding_size"] = 1024  # what an earlier release wrote
    demo_dir().mkdir(parents=True)
    (demo_dir() / "config.json").write_text(json.dumps(old))
    folder = ensure_demo_checkpoint()
    assert json.loads((folder / "config.json").read_text()) == synthetic_config("tiny")
    assert (folder / "tokenizer.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["demo-tiny"]
