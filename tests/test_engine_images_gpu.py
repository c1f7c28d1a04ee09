"""GPU tests of images on the cuda engine (tiny model, kernels built for the local GPU): the device tower's rows
against the float32 NumPy tower, greedy tokens with one and two images against the reference's engine-precision
mode fed the engine's own image rows (as tests/test_engine_images_emulated.py does on the emulator), and DFlash
after images equal to plain decoding. Skip without a GPU / cuda-python / nvcc."""

from __future__ import annotations

import numpy as np
import pytest

from test_engine_images_emulated import GEN, EngineRows, image_bytes, prompt

pytestmark = pytest.mark.gpu
PIL = pytest.importorskip("PIL.Image")


@pytest.fixture(scope="module")
def pair(built):
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.backend import ReferenceBackend

    model, kernels = built
    ck = Checkpoint.open(model)
    cuda = open_backend(model, ctx=1024, kernels_dir=kernels, max_num_seqs=2)
    ref = ReferenceBackend(ck, max_context=1024, prefix_cache=False, numerics="w4a16", kernels=kernels)
    ref.encoder_cache.model = EngineRows(cuda.engine)
    yield cuda, ref, ck
    cuda.close()


def test_device_tower_near_the_float32_tower(pair):
    from thorgen.runtime.media.images import load_image
    from thorgen.runtime.reference.vision import VisionModel

    cuda, _, ck = pair
    img = load_image(image_bytes(1), ck.spec.vision, 70)
    got = cuda.engine.vision.encode(img).astype(np.float64)
    want = VisionModel(ck).encode(img).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 3e-2


@pytest.mark.parametrize("seeds", [(1,), (1, 2)])
def test_greedy_with_images_equals_w4a16_reference(pair, seeds):
    from thorgen.runtime.backend import SamplingParams

    cuda, ref, ck = pair
    ids, spans = prompt(ck.spec, *seeds)
    got = cuda.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    want = ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    assert got == want


def test_speculative_after_images_equals_plain(pair):
    from thorgen.runtime.backend import SamplingParams

    cuda, _, ck = pair
    if not cuda.engine.speculative:
        pytest.skip("; ".join(cuda.engine.spec_missing))
    ids, spans = prompt(ck.spec, 1, 2)
    plain = cuda.generate(ids, 24, SamplingParams(), images=spans).token_ids
    assert cuda.generate(ids, 24, SamplingParams(), speculative=True, images=spans).token_ids == plain


# ---- the full-size tower (27 layers, hidden 1152, 16 heads of 72) in front of the tiny text model -------------------
@pytest.fixture(scope="module")
def full_tower_pair(device, tmp_path_factory):
    """(cuda backend, w4a16 reference sharing its image rows, checkpoint) of the tiny text model with the real
    model's vision tower: synthesised, repacked and built for this GPU as `thorgen prepare` does."""
    import dataclasses

    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.builder import build
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.model_spec.presets import get_preset
    from thorgen.model_spec.synth import write_synthetic_checkpoint
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.reference.backend import ReferenceBackend

    tiny, full = get_preset("tiny"), get_preset("gemma-4-26b-a4b")
    ids = {n: getattr(tiny.vision, n) for n in ("image_token_id", "boi_token_id", "eoi_token_id", "video_token_id")}
    spec = dataclasses.replace(tiny, name="tiny-full-tower", vision=dataclasses.replace(full.vision, **ids))
    root = tmp_path_factory.mktemp("full_tower")
    model = write_synthetic_checkpoint(spec, root / "model", seed=0, progress=False)
    repack(model, arch=device.info.arch)
    ck = Checkpoint.open(model)
    kernels = root / "kernels"
    build(ck.spec, get_arch(device.info.arch), kernels)
    cuda = open_backend(model, ctx=1024, kernels_dir=kernels, max_num_seqs=2)
    ref = ReferenceBackend(ck, max_context=1024, prefix_cache=False, numerics="w4a16", kernels=kernels)
    ref.encoder_cache.model = EngineRows(cuda.engine)
    yield cuda, ref, ck
    cuda.close()


@pytest.mark.parametrize("budget", [70])
def test_full_size_device_tower_near_the_float32_tower(full_tower_pair, budget):
    from thorgen.runtime.media.images import load_image
    from thorgen.runtime.reference.vision import VisionModel

    cuda, _, ck = full_tower_pair
    img = load_image(image_bytes(3, (360, 640)), ck.spec.vision, budget)  # a 16:9 photo's shape
    got = cuda.engine.vision.encode(img).astype(np.float64)
    want = VisionModel(ck).encode(img).astype(np.float64)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2  # (tests/test_vision_program.py's TOL_ENCODE
    # is against float64 on an image of 54 patches; the float32 NumPy tower adds its own rounding)


def test_full_size_tower_greedy_equals_w4a16_reference(full_tower_pair):
    from thorgen.runtime.backend import SamplingParams

    cuda, ref, ck = full_tower_pair
    ids, spans = prompt(ck.spec, 1, 2)
    assert (
        cuda.generate(ids, GEN, SamplingParams(), images=spans).token_ids
        == ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    )


@pytest.mark.parametrize("budget,count", [(280, 4), (280, 3), (560, 2)])
def test_full_size_images_encoded_together_equal_each_alone(full_tower_pair, budget, count):
    """Several images of one patch grid in one encode (the full-size tower's GEMMs over their rows back to back,
    the attention and the pool per image): each image's rows bit for bit those of its encode alone."""
    from thorgen.runtime.media.images import load_image

    cuda, _, ck = full_tower_pair
    vision = cuda.engine.vision
    imgs = [load_image(image_bytes(20 + i, (360, 640)), ck.spec.vision, budget) for i in range(count)]
    assert vision.images_per_encode(imgs[0]) >= count
    alone = [vision.encode(img) for img in imgs]
    vision.start(imgs)
    together = dict(vision.wait())
    for img, rows in zip(imgs, alone):
        np.testing.assert_array_equal(together[img.hash], rows)
    assert not np.array_equal(alone[0], alone[1])
