"""The batched draft step (runtime/cuda/draft_batch.py) on the emulated GPU (tests/engine_emulator.py): the DFlash
blocks of several sequences, each in its own KV lane at its own positions, through the drafter in one launch give
every block's final rows and drafts bit for bit as its one-sequence draft graph does, read back from the device
(2, 3 (a padding block), 4 and 8 blocks; blocks across a KV page boundary and past the drafter's sliding window)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.model_spec.conventions import KV_PAGE, MAX_BATCH, VERIFY_ROWS  # noqa: E402
from thorgen.runtime.cuda.draft_batch import BatchedDraft, DraftBlock  # noqa: E402

LANES = 8
CTX = 256


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("draft_batch"), ctx=CTX, max_num_seqs=LANES)
    assert b.engine.speculative, b.engine.spec_missing
    rng = np.random.default_rng(5)
    kv = b.engine.kv
    for layer in kv.plan.drafter():  # a drafter context in every lane: random keys and values
        for buf in (kv.k(layer.layer, "drafter"), kv.v(layer.layer, "drafter")):
            buf.upload(EE.f32_to_bf16((0.5 * rng.standard_normal(buf.nbytes // 2)).astype(np.float32)))
    # a random lm_head (the tiny drafter's rows all pick the mask token through the tied one): drafts that differ
    eng, V = b.engine, b.spec.target.vocab_size
    _alone(eng.dflash.parts, eng.dflash, DraftBlock(0, 20, 7, 15))
    emu = dev.driver().emu
    for key in [k for k in emu._dense if len(k) == 5 and k[3] == V]:
        emu.overrides[key] = rng.standard_normal(emu._dense[key].shape)
    yield b
    b.close()
    dev.set_driver(None)


def _final_rows(parts, rows: int) -> np.ndarray:
    d = parts.fwd.spec.drafter
    return parts.act["da"].download(np.uint16, (rows, d.hidden_size))


def _alone(parts, dflash, block: DraftBlock) -> tuple[list[int], np.ndarray]:
    """The one-sequence draft graph of `block`: its 15 drafts and the final norm's 16 rows (f16 bits)."""
    act = parts.act
    act["positions"].upload(np.arange(block.pos, block.pos + VERIFY_ROWS, dtype=np.int32))
    act["lanes"].upload(np.full(VERIFY_ROWS, block.lane, np.int32))
    act["ids"].upload(np.array([block.last], np.int32))
    dflash.graph("draft").replay(parts.stream)
    parts.stream.synchronize()
    return act["ids"].download(np.int32, (VERIFY_ROWS,))[1:].tolist(), _final_rows(parts, VERIFY_ROWS)


def _blocks(n: int, seed: int) -> list[DraftBlock]:
    """n blocks in distinct lanes at different positions (one starting on a page, the others across a boundary),
    their drafts sharing a batched verify's rows."""
    rng = np.random.default_rng(seed)
    lanes = rng.permutation(LANES)[:n]
    pos = rng.integers(1, CTX - VERIFY_ROWS, n) | 1  # (odd: across a page boundary)
    pos[0], pos[1] = KV_PAGE * 3, CTX - VERIFY_ROWS - 5  # (one on a page's start; one far past the window)
    k = [max(1, (MAX_BATCH - n) // n)] * n
    k[-1] = min(VERIFY_ROWS - 1, k[-1] + (MAX_BATCH - n) % n)
    last = rng.integers(3, 500, n)
    return [DraftBlock(int(a), int(p), int(t), min(VERIFY_ROWS - 1, d)) for a, p, t, d in zip(lanes, pos, last, k)]


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_batched_draft_equals_each_block_alone(backend, n):
    eng = backend.engine
    parts, dflash = eng.dflash.parts, eng.dflash
    blocks = _blocks(n, n)
    assert any(b.pos // KV_PAGE != (b.pos + VERIFY_ROWS - 1) // KV_PAGE for b in blocks)
    assert any(b.pos > eng.spec.drafter.sliding_window for b in blocks)
    alone = [_alone(parts, dflash, b) for b in blocks]
    drafter = BatchedDraft(parts)
    slot, first = drafter.launch(blocks)
    got = drafter.read(slot, sum(b.drafts for b in blocks))
    rows = _final_rows(parts, n * VERIFY_ROWS)
    for i, (b, (drafts, final)) in enumerate(zip(blocks, alone)):
        assert np.array_equal(rows[VERIFY_ROWS * i : VERIFY_ROWS * (i + 1)], final), (n, i)
        assert got[first[i] : first[i] + b.drafts].tolist() == drafts[: b.drafts], (n, i)
    assert len({final.tobytes() for _, final in alone}) == n  # (each block's own rows)
    assert len({tuple(d) for d, _ in alone}) > 1  # (real drafts: the blocks draft differently)


def test_batched_draft_rejects_what_a_step_cannot_hold(backend):
    from thorgen.runtime.backend import BackendError

    drafter = BatchedDraft(backend.engine.dflash.parts)
    with pytest.raises(BackendError, match="drafts"):
        drafter.launch([DraftBlock(0, 20, 5, 15), DraftBlock(1, 40, 5, 15), DraftBlock(2, 60, 5, 3)])
