"""CPU tests of images on the CUDA engine: the real engine (repacked tower, vision.encode program, image prefill
programs, engine core and CudaRunner) on the emulated GPU (tests/engine_emulator.py) against the reference backend's
engine-precision mode (numerics="w4a16").

The tower is checked on its own: the engine's encode equals the vision.encode program run launch by launch on the
same kernel stand-ins (tests/test_vision_program.py's run_encode) bit for bit, and the float32 NumPy tower
(runtime/reference/vision.py) within the program's tolerance. The text side is then checked token for token with
the same image rows on both sides (the reference's encoder replaced by the engine's, since the fp16 tower and the
float32 one differ by ~1e-2): rows replaced after the embed, the sliding layers' image blocks (kv_hi), the prefix
cache's image keys and DFlash after an image. An image's chunk run a few layers a call beside a decoding sequence
(runtime/cuda/pieces.py) cuts only between layers, keeps what crosses its cuts, and gives the whole chunk's logits.
"""

from __future__ import annotations

import io

import numpy as np
import pytest

import engine_emulator as EE

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan
PIL = pytest.importorskip("PIL.Image")

from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.media.images import load_image  # noqa: E402
from thorgen.runtime.media.prompts import expand_image_tokens  # noqa: E402

GEN = 8


def image_bytes(seed: int, size=(60, 90)) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    PIL.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def prompt(spec, *seeds, text=(30, 31, 32), size=(60, 90)):
    """(ids, image spans): text, then each image's placeholder followed by a token, then more text."""
    vision = spec.vision
    imgs = [load_image(image_bytes(s, size), vision, 70) for s in seeds]
    ids = [2, 105, *text]
    for _ in imgs:
        ids += [vision.image_token_id, 45]
    return expand_image_tokens(ids + [106, 105, 40, 41], imgs, vision)


class EngineRows:
    """The reference encoder cache's model replaced by the engine's tower (same rows on both sides)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def encode(self, image):
        return self.engine.vision.encode(image)


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, tmp_path_factory):
    """(emulated cuda backend, w4a16 reference backend sharing its image rows, checkpoint)."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.cuda.backend import open_backend
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.reference.backend import ReferenceBackend

    ck = Checkpoint.open(tiny_checkpoint)
    root = tmp_path_factory.mktemp("images")
    weights = repack(tiny_checkpoint, root / "weights")
    kernels = EE.write_fake_manifest(ck.spec, root / "kernels")
    drv = EE.install(kernels)
    cuda = open_backend(tiny_checkpoint, ctx=1024, weights_dir=weights, kernels_dir=kernels, max_num_seqs=2)
    ref = ReferenceBackend(ck, max_context=1024, prefix_cache=False, numerics="w4a16", kernels=kernels)
    ref.encoder_cache.model = EngineRows(cuda.engine)
    yield cuda, ref, ck
    dev.set_driver(drv)
    cuda.close()
    dev.set_driver(None)


def test_encode_is_the_program_and_near_the_float32_tower(pair):
    from test_vision_program import run_encode

    from thorgen.model_spec.tensors import vision_tensors
    from thorgen.runtime.convert.plan import bf16_or_f32
    from thorgen.runtime.reference.vision import VisionModel

    cuda, _, ck = pair
    spec = ck.spec
    img = load_image(image_bytes(1), spec.vision, 70)
    got = cuda.engine.encoder_cache.rows(img)
    assert got.shape == (img.soft_tokens, spec.target.hidden_size) and np.isfinite(got).all()
    tensors = {t.name: np.asarray(ck.tensor(t.name)) for t in vision_tensors(spec.vision, spec.target.hidden_size)}
    for name in ("model.vision_tower.std_bias", "model.vision_tower.std_scale"):  # (run_encode's are float32)
        tensors[name] = bf16_or_f32(tensors[name])
    lowered = run_encode(spec, tensors, img.patches, np.asarray(img.positions, np.int32))
    np.testing.assert_array_equal(got, lowered.astype(np.float32))
    want = VisionModel(ck).encode(img).astype(np.float64)
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert err < 3e-2, err  # the fp16 GEMMs and bf16 q/k/v (tests/test_vision_program.py)
    # the encoder cache: the same image again is not run again
    n = cuda.engine.encoder_cache.encoded
    assert cuda.engine.encoder_cache.rows(load_image(image_bytes(1), spec.vision, 70)) is got
    assert cuda.engine.encoder_cache.encoded == n


def test_an_encode_in_pieces_between_steps_gives_the_whole_encode(pair):
    """Beside running sequences the tower's graphs go one piece per poll() on the engine's stream: the same rows."""
    cuda, _, ck = pair
    vision = cuda.engine.vision
    img = load_image(image_bytes(4, size=(96, 130)), ck.spec.vision, 140)
    whole = vision.encode(img)
    key, keep = (img.soft_tokens, 1), vision.piece_flop
    for g in vision.graphs.pop(key):
        g.destroy()
    vision.piece_flop = 1.0  # a piece per launch with any work: every layer cut up
    try:
        vision.start([img], pieces=True)
        polls = 1
        while not (done := vision.poll()):
            polls += 1
            assert polls < 1000
    finally:
        vision.piece_flop = keep
    assert len(vision.graphs[key]) > ck.spec.vision.num_hidden_layers  # (several pieces a layer)
    assert polls >= len(vision.graphs[key])  # one piece enqueued per poll
    ((got_hash, rows),) = done
    assert got_hash == img.hash and np.array_equal(rows, whole)


@pytest.mark.parametrize("seeds", [(1,), (1, 2)])
def test_greedy_with_images_equals_w4a16_reference(pair, seeds):
    cuda, ref, ck = pair
    ids, spans = prompt(ck.spec, *seeds)
    assert all(s.image.soft_tokens > 1 for s in spans)
    got = cuda.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    want = ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids
    assert len(want) == GEN and got == want


def test_image_rows_and_block_mask_change_the_output(pair):
    """The check has teeth: the engine's first-token logits equal the reference's (relative L2 <= 1e-5, as
    tests/test_reference_w4a16.py), while without the image rows (placeholder embeddings) or with a causal-only
    mask on the sliding layers the reference moves by far more."""
    from thorgen.runtime.reference import w4a16 as W
    from thorgen.runtime.reference.ops import softcap

    cuda, ref, ck = pair
    ids, spans = prompt(ck.spec, 1)
    rows = [(s.offset, cuda.engine.encoder_cache.rows(s.image)) for s in spans]
    cuda.generate(ids, 1, SamplingParams(), images=spans)
    got = softcap(cuda.engine.logits(), ck.spec.target.final_logit_softcapping).astype(np.float64)
    m = ref.target

    def first_logits(images, bounds=None):
        saved = W.key_bounds
        W.key_bounds = bounds or saved
        try:
            return m.forward(ids, m.new_cache(), last_only=True, images=images).logits[-1].astype(np.float64)
        finally:
            W.key_bounds = saved

    def rel(a, b):
        return np.linalg.norm(a - b) / np.linalg.norm(b)

    want = first_logits(rows)
    assert rel(got, want) <= 1e-5, rel(got, want)
    causal = first_logits(rows, lambda start, blocks: start + np.arange(blocks.size))
    assert rel(causal, want) > 1e-3, rel(causal, want)
    assert rel(first_logits(()), want) > 1e-3


def test_prefix_cache_keys_images_by_content(pair):
    """The same image again hits past its span; then a different image of the same size (same placeholders, other
    content) shares nothing from its span on; every output equals the reference's, which caches nothing."""
    from thorgen.runtime.engine.core import EngineCore
    from thorgen.runtime.cuda.runner import CudaRunner

    cuda, ref, ck = pair
    a_ids, a_spans = prompt(ck.spec, 3, text=tuple(range(30, 60)))
    b_ids, b_spans = prompt(ck.spec, 4, text=tuple(range(30, 60)))
    assert a_ids == b_ids and a_spans[0].image.hash != b_spans[0].image.hash
    runner = CudaRunner(cuda.engine, max_num_seqs=1)
    core = EngineCore(runner)

    def run(ids, spans):
        core.add(str(len(core_runs)), ids, GEN, SamplingParams(), images=tuple(spans))
        toks, cached = [], None
        while core.unfinished:
            for o in core.step():
                toks += o.token_ids
                if o.finished:
                    cached = o.result.cached_prompt_tokens
        core_runs.append(toks)
        return toks, cached

    core_runs: list = []
    a, _ = run(a_ids, a_spans)
    a2, a2_hit = run(a_ids, a_spans)
    b, b_hit = run(b_ids, b_spans)
    offset, end = a_spans[0].offset, a_spans[0].end
    assert a2_hit >= end, (a2_hit, end)
    assert b_hit <= offset, (b_hit, offset)
    assert a2 == a
    for toks, (ids, spans) in ((a, (a_ids, a_spans)), (b, (b_ids, b_spans))):
        assert toks == ref.generate(ids, GEN, SamplingParams(), images=spans).token_ids


def test_speculative_after_an_image_equals_plain(pair):
    cuda, _, ck = pair
    if not cuda.engine.speculative:
        pytest.skip("no DFlash drafter in this build: " + "; ".join(cuda.engine.spec_missing))
    ids, spans = prompt(ck.spec, 1, 2)
    plain = cuda.generate(ids, 24, SamplingParams(), images=spans).token_ids
    spec = cuda.generate(ids, 24, SamplingParams(), speculative=True, images=spans)
    assert spec.token_ids == plain
    assert spec.accepted_lengths  # it did take DFlash steps


def test_bad_image_requests_are_refused(pair):
    cuda, _, ck = pair
    ids, spans = prompt(ck.spec, 1)
    with pytest.raises(BackendError, match="placeholder"):
        at = spans[0].offset
        cuda.generate(ids[:at] + ids[at + 1 :], 2, SamplingParams(), images=spans)  # one placeholder fewer
    with pytest.raises(BackendError, match="prompt logprobs"):
        cuda.generate(ids, 2, SamplingParams(prompt_logprobs=1), images=spans)


# ---- a prefill chunk in pieces (runtime/cuda/pieces.py) ----------------------------------------------------------


def _image_chunk_ops(engine, spec):
    ids, spans = prompt(spec, 1)
    return engine._image_ops(len(ids), True, True, False, False, []), len(ids)


def test_pieces_cover_the_chunk_between_layers(pair):
    from thorgen.runtime.cuda.pieces import RESTAGED, layer_of, live_in, piece_ranges

    cuda, _, ck = pair
    engine = cuda.engine
    ops, rows = _image_chunk_ops(engine, ck.spec)
    layers = ck.spec.target.num_hidden_layers
    ranges = piece_ranges(ops, rows, budget=rows)  # a layer a piece
    assert len(ranges) == layers
    assert ranges[0][0] == 0 and ranges[-1][1] == len(ops)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for n, (_, b) in enumerate(ranges[:-1]):
        assert layer_of(ops[b].label) == n + 1 and layer_of(ops[b - 1].label) == n  # whole layers
        side = [op for op in ops[:b] if op.branch == 1]
        assert not side or any(op.join for op in ops[ops.index(side[-1]) : b])  # (no open side-stream group)
        kept = [r for r in live_in(ops[b:], engine.pieces.regions) if r not in RESTAGED]
        assert "a" in kept  # the residual stream crosses every cut
        if n == 0:
            assert "kv_hi" in kept  # the image's key bounds, which the sliding layers after the cut read
    assert piece_ranges(ops, rows, budget=rows * layers) == [(0, len(ops))]


def test_pieces_between_decode_steps_give_the_whole_chunks_logits(pair, monkeypatch):
    """An image chunk (lane 0) run a layer a call with a decode step of another sequence (lane 1) after each piece
    ends with the logits of the same chunk run whole, bit for bit: what the decode steps overwrite in the shared
    activations (the residual stream's rows, positions, lanes, the key bounds) is kept and restored."""
    import numpy as np

    import engine_emulator as EE
    from thorgen.runtime.cuda import pieces

    cuda, _, ck = pair
    engine = cuda.engine
    table, kv = engine.buffers.pages, engine.buffers.kv.plan
    for lane in (0, 1):  # each lane one linear cache of its own (earlier tests' cores mapped them their way)
        table.map(lane, 0, [(lane * kv.seq_pages + i) % kv.pages for i in range(table.pitch)])
    ids, spans = prompt(ck.spec, 6)
    images = [(s.offset, engine.vision.encode(s.image)) for s in spans]
    engine.prefill(ids, lane=0, images=images)
    whole = engine.logits()
    text = [2, 105, *range(300, 320)]
    token, pos = engine.prefill(text, lane=1), len(text)
    monkeypatch.setattr(pieces, "PIECE_ROW_LAYERS", len(ids))  # a layer a piece
    pieced, last = 0, None
    while (first := engine.prefill_piece(ids, lane=0, images=images)) is None:
        pieced += 1
        if engine.pieces.sampled(0):  # (its last piece ran: read the logits before the decode step writes its own)
            last = engine.logits()
        token, pos = EE.decode_step(engine, pos, token=token, lane=1), pos + 1
    # a piece a layer, the first token read by the call after the last (the decode step ran between)
    assert pieced == ck.spec.target.num_hidden_layers and engine.pieces.chunk is None
    assert first == int(np.argmax(whole))
    assert last is not None and np.array_equal(last, whole)


def test_an_image_chunk_in_pieces_beside_a_decoding_sequence(pair, monkeypatch):
    from thorgen.runtime.cuda import pieces, runner as runner_mod
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    engine = cuda.engine
    text = [2, 105, *range(300, 340), 106, 105]
    image_ids, spans = prompt(ck.spec, 5)
    for module in (pieces, runner_mod):  # a chunk of an image's sequence beside a decode: pieces of one layer each
        monkeypatch.setattr(module, "PIECE_ROW_LAYERS", len(image_ids))
    calls = []
    whole = engine.prefill_piece

    def counted(*args, **kwargs):
        calls.append(whole(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(engine, "prefill_piece", counted)
    core = EngineCore(runner_mod.CudaRunner(engine, max_num_seqs=2))
    core.add("text", text, 24, SamplingParams())
    out: dict[str, list[int]] = {"text": [], "image": []}
    while not out["text"]:  # the text request decodes before the image request arrives
        for o in core.step():
            out[o.request_id] += o.token_ids
    core.add("image", image_ids, GEN, SamplingParams(), images=tuple(spans))
    text_during = None
    while core.unfinished:
        before = len(out["text"])
        for o in core.step():
            out[o.request_id] += o.token_ids
        if calls and calls[-1] is None:
            text_during = (text_during or 0) + len(out["text"]) - before
    layers = ck.spec.target.num_hidden_layers  # (a piece a layer, then a call that reads the first token)
    assert calls[:layers] == [None] * layers and isinstance(calls[layers], int)
    assert text_during and text_during >= layers  # the text sequence decoded between the pieces
    assert engine.pieces.chunk is None
    assert out["text"] == ref.generate(text, 24, SamplingParams()).token_ids
    assert out["image"] == ref.generate(image_ids, GEN, SamplingParams(), images=spans).token_ids


def test_a_last_pieces_token_is_read_when_its_decoders_are_gone(pair, monkeypatch):
    """The first token of a chunk run in pieces is read by the call after its last piece; when that call's step has
    no decoders left (here the one decoding sequence was cancelled), it reads the token rather than running the
    chunk again whole, and the image request's tokens are the reference's."""
    from thorgen.runtime.cuda import pieces, runner as runner_mod
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    engine = cuda.engine
    image_ids, spans = prompt(ck.spec, 7)
    for module in (pieces, runner_mod):  # a piece a layer
        monkeypatch.setattr(module, "PIECE_ROW_LAYERS", len(image_ids))
    whole_calls = []
    whole = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda *a, **k: whole_calls.append(len(a[0])) or whole(*a, **k))
    core = EngineCore(runner_mod.CudaRunner(engine, max_num_seqs=2))
    core.add("text", [2, 105, *range(300, 340), 106, 105], 200, SamplingParams())
    out: dict[str, list[int]] = {"text": [], "image": []}
    while not out["text"]:
        for o in core.step():
            out[o.request_id] += o.token_ids
    whole_calls.clear()
    core.add("image", image_ids, GEN, SamplingParams(), images=tuple(spans))
    while engine.pieces.chunk is None or engine.pieces.chunk.token is None:
        for o in core.step():
            out[o.request_id] += o.token_ids
    core.abort("text")
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
    assert len(image_ids) not in whole_calls and engine.pieces.chunk is None
    assert out["image"] == ref.generate(image_ids, GEN, SamplingParams(), images=spans).token_ids


@pytest.mark.parametrize("in_pieces", [True, False])
def test_a_text_prompt_beside_a_decoding_sequence(pair, monkeypatch, in_pieces):
    """Beside a decoding sequence (EngineOptions.prefill_pieces) a text prompt runs a layer a piece here, the decode
    stepping between its pieces; off, it runs whole in the step it arrives in. Either way every token is the
    reference's."""
    from thorgen.runtime.cuda import pieces, runner as runner_mod
    from thorgen.runtime.engine.core import EngineCore

    cuda, ref, ck = pair
    engine = cuda.engine
    first, late = [2, 105, *range(300, 340), 106, 105], [2, 105, *range(400, 430), 106, 105]
    for module in (pieces, runner_mod):  # the prompt's chunk: a layer a piece
        monkeypatch.setattr(module, "PIECE_ROW_LAYERS", len(late) - 1)
    ran = []
    piece = engine.prefill_piece
    monkeypatch.setattr(engine, "prefill_piece", lambda *a, **k: ran.append(len(a[0])) or piece(*a, **k))
    core = EngineCore(runner_mod.CudaRunner(engine, max_num_seqs=2, prefill_pieces=in_pieces))
    core.add("first", first, 40, SamplingParams())
    out: dict[str, list[int]] = {"first": [], "late": []}
    while not out["first"]:
        for o in core.step():
            out[o.request_id] += o.token_ids
    core.add("late", late, 6, SamplingParams())
    steps, decoded = 0, 0
    while not out["late"]:
        steps += 1
        for o in core.step():
            out[o.request_id] += o.token_ids
            decoded += o.request_id == "first"
    layers = ck.spec.target.num_hidden_layers
    if in_pieces:  # a piece a step, the decode between, then a step that reads the first token
        assert steps == layers + 1 and decoded == layers + 1 and ran == [len(late)] * (layers + 1)
    else:
        assert steps == 1 and not ran
    while core.unfinished:
        for o in core.step():
            out[o.request_id] += o.token_ids
    assert out["first"] == ref.generate(first, 40, SamplingParams()).token_ids
    assert out["late"] == ref.generate(late, 6, SamplingParams()).token_ids


def test_a_second_long_chunk_waits_for_the_one_in_pieces(pair, monkeypatch):
    """While one chunk is part-way, another long chunk waits (None, nothing run: run whole it would hold the decode
    steps back), then runs in pieces once the first is done and gives its whole run's logits; a chunk in flight
    that others asked past MAX_WAITS times is forgotten."""
    import numpy as np

    from thorgen.runtime.cuda import pieces

    cuda, _, ck = pair
    engine = cuda.engine
    table, kv = engine.buffers.pages, engine.buffers.kv.plan
    for lane in (0, 1):
        table.map(lane, 0, [(lane * kv.seq_pages + i) % kv.pages for i in range(table.pitch)])
    a_ids, a_spans = prompt(ck.spec, 7)
    b_ids, b_spans = prompt(ck.spec, 8)
    a_img = [(s.offset, engine.vision.encode(s.image)) for s in a_spans]
    b_img = [(s.offset, engine.vision.encode(s.image)) for s in b_spans]
    engine.prefill(b_ids, lane=1, images=b_img)
    b_whole = engine.logits()
    monkeypatch.setattr(pieces, "PIECE_ROW_LAYERS", len(a_ids))
    assert engine.prefill_piece(a_ids, lane=0, images=a_img) is None and engine.pieces.lane == 0
    done = engine.pieces.chunk.done
    assert engine.prefill_piece(b_ids, lane=1, images=b_img) is None  # waits
    assert engine.pieces.lane == 0 and engine.pieces.chunk.done == done
    while engine.prefill_piece(a_ids, lane=0, images=a_img) is None:
        pass
    while engine.prefill_piece(b_ids, lane=1, images=b_img) is None:
        assert engine.pieces.lane == 1
    assert np.array_equal(engine.logits(), b_whole)
    monkeypatch.setattr(pieces, "MAX_WAITS", 2)
    assert engine.prefill_piece(a_ids, lane=0, images=a_img) is None
    for _ in range(2):
        assert engine.prefill_piece(b_ids, lane=1, images=b_img) is None and engine.pieces.lane == 0
    assert engine.prefill_piece(b_ids, lane=1, images=b_img) is None and engine.pieces.lane == 1  # a forgotten
    engine.pieces.drop()
