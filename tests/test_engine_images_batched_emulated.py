"""CPU tests of several images in one encode on the CUDA engine (the emulated GPU, tests/engine_emulator.py): the
images of one patch grid, of one request or of requests queued together, go through the tower in one pass (the
vision.encode program for B images) and each gets the rows of its encode alone, bit for bit, and the same tokens as
the w4a16 reference fed lone encodes; images of another grid go in an encode of their own; a bad image fails only its
own request."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
pytest.importorskip("PIL.Image")

from test_engine_images_emulated import GEN, image_bytes, pair, prompt  # noqa: E402,F401 (pair: the fixture)
from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.media.images import load_image  # noqa: E402


def _starts(monkeypatch, vision) -> list[list[str]]:
    """Record the images of each encode the tower starts."""
    starts: list[list[str]] = []
    real = vision.start

    def start(images, pieces=False):
        starts.append([i.hash for i in images])
        real(images, pieces)

    monkeypatch.setattr(vision, "start", start)
    return starts


@pytest.mark.parametrize("count", [2, 3])
def test_images_encoded_together_equal_their_lone_encodes(pair, count):  # noqa: F811
    cuda, _, ck = pair
    vision = cuda.engine.vision
    imgs = [load_image(image_bytes(40 + i), ck.spec.vision, 70) for i in range(count)]
    assert vision.images_per_encode(imgs[0]) >= count
    alone = [vision.encode(img) for img in imgs]
    vision.start(imgs)
    together = dict(vision.wait())
    assert list(together) == [i.hash for i in imgs]
    assert (imgs[0].soft_tokens, count) in vision.graphs
    for img, rows in zip(imgs, alone):
        np.testing.assert_array_equal(together[img.hash], rows)
    assert not np.array_equal(alone[0], alone[1])


def test_a_request_with_three_images_encodes_them_once_together(pair, monkeypatch):  # noqa: F811
    from thorgen.runtime.cuda.runner import CudaRunner
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    engine = cuda.engine
    engine.encoder_cache.clear()
    starts = _starts(monkeypatch, engine.vision)
    ids, spans = prompt(ck.spec, 51, 52, 53)
    core = EngineCore(CudaRunner(engine, max_num_seqs=2))
    core.add("three", ids, GEN, SamplingParams(), images=tuple(spans))
    out: list[int] = []
    while core.unfinished:
        out += [t for o in core.step() for t in o.token_ids]
    assert starts == [[s.image.hash for s in spans]]
    assert out == ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids


def test_queued_requests_images_encode_together_and_a_bad_one_fails_alone(pair, monkeypatch):  # noqa: F811
    """Two requests' images of one grid go in one encode (the second request's taken along with the first's);
    a third request's image of another grid goes in an encode of its own; a request whose image the tower cannot
    take is refused alone."""
    from thorgen.runtime.cuda.runner import CudaRunner
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    engine = cuda.engine
    engine.encoder_cache.clear()
    starts = _starts(monkeypatch, engine.vision)
    reqs = {"a": prompt(ck.spec, 61), "b": prompt(ck.spec, 62), "wide": prompt(ck.spec, 63, size=(96, 130))}
    grid = {name: (s[0].image.soft_tokens, int(s[0].image.positions[-1, 0])) for name, (_, s) in reqs.items()}
    assert grid["a"] == grid["b"] != grid["wide"]
    ids, spans = prompt(ck.spec, 64)
    bad = dataclasses.replace(spans[0].image, positions=spans[0].image.positions + 10_000, hash="bad")
    core = EngineCore(CudaRunner(engine, max_num_seqs=4))
    core.add("a", reqs["a"][0], GEN, SamplingParams(), images=tuple(reqs["a"][1]))
    with pytest.raises(BackendError, match="position table"):
        core.add("bad", ids, GEN, SamplingParams(), images=(dataclasses.replace(spans[0], image=bad),))
    for name in ("b", "wide"):
        core.add(name, reqs[name][0], GEN, SamplingParams(), images=tuple(reqs[name][1]))
    out: dict[str, list[int]] = {name: [] for name in reqs}
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
    hashes = {name: s[0].image.hash for name, (_, s) in reqs.items()}
    assert starts == [[hashes["a"], hashes["b"]], [hashes["wide"]]]
    for name, (rids, rspans) in reqs.items():
        assert out[name] == ref.generate(rids, GEN, SamplingParams(), images=rspans).token_ids, name


def test_the_manifest_holds_an_encode_program_for_each_image_count(pair):  # noqa: F811
    """vision.encode images=B for B = 1..MAX_ENCODE_IMAGES, each for images of up to 1120 / B soft tokens (the
    activations of one 1120-token image); an encode takes as many images of a size as fit."""
    from thorgen.model_spec.vision_layout import MAX_ENCODE_IMAGES, MAX_SOFT_TOKENS, vision_encode_key

    cuda, _, ck = pair
    vision = cuda.engine.vision
    for b in range(1, MAX_ENCODE_IMAGES + 1):
        (rng,) = vision.fwd.programs[vision_encode_key(b)]
        assert (rng["lo"], rng["hi"]) == (1, MAX_SOFT_TOKENS // b)
    img = load_image(image_bytes(1), ck.spec.vision, 70)
    for tokens, most in ((70, 4), (280, 4), (281, 3), (560, 2), (561, 1), (1120, 1)):
        assert vision.images_per_encode(dataclasses.replace(img, soft_tokens=tokens)) == most
