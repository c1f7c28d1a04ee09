"""Prefill chunks of new sizes reuse the launch list of their program's row range (LaunchLists.eager_rows): on the
emulated engine (tests/engine_emulator.py) a drafter catch-up of an odd size, after chunks of other sizes, binds
no new list, its launches carry exactly the grids and arguments a fresh bind gives, and the K/V and drafter
context it writes, and the token it samples, equal those of catch-ups that each bind their list afresh."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

PROMPT = [2] + list(range(300, 420))


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("catch_up_lists"), ctx=1024)
    assert b.engine.speculative, b.engine.spec_missing
    yield b
    b.close()
    dev.set_driver(None)


def _caches(engine) -> list[np.ndarray]:
    """Every K and V cache of the target and the drafter, as bytes."""
    kv = engine.kv
    return [buf.download() for l in kv.plan.layers for buf in (kv.k(l.layer, l.model), kv.v(l.layer, l.model))]


def _catch_ups(engine, cuts: list[int]) -> tuple[list[int], list[int]]:
    """A tap prefill of PROMPT[:cuts[0]], then one catch-up (a tap prefill from the previous cut) to each later
    cut, over caches emptied first: (the tokens they sample, the launch lists bound by each catch-up)."""
    kv = engine.kv
    for l in kv.plan.layers:
        for buf in (kv.k(l.layer, l.model), kv.v(l.layer, l.model)):
            buf.upload(np.zeros(buf.nbytes, np.uint8))
    tokens, binds = [engine.prefill(PROMPT[: cuts[0]], taps=True)], []
    for begin, end in zip(cuts, cuts[1:]):
        before = engine.launches.binds
        tokens.append(engine.prefill(PROMPT[:end], taps=True, begin=begin))
        binds.append(engine.launches.binds - before)
    return tokens, binds


def _values(launches) -> list[tuple]:
    """(label, grid, block, argument values) of each launch of a bound list."""
    out = []
    for label, fn in launches:
        launch = getattr(fn, "launch", fn)
        out.append((label, launch.grid, launch.block, [c.value for c in launch.args._store]))
    return out


def test_catch_ups_of_new_sizes_bind_nothing_and_write_what_fresh_lists_write(backend, monkeypatch):
    engine = backend.engine
    # 50 rows, then catch-ups of 37 and 23 positions (one row range of the tiny plan), then 5 and 9 (another)
    cuts = [50, 87, 110, 115, 124]
    keys = ["decode=0 last=1 greedy=1 taps=1 all_logits=0 batched=0 ext=0 score=0", "draft.context"]
    assert engine.fwd.span(keys, 50) == engine.fwd.span(keys, 37) == engine.fwd.span(keys, 23)
    assert engine.fwd.span(keys, 5) == engine.fwd.span(keys, 9) != engine.fwd.span(keys, 23)
    tokens, binds = _catch_ups(engine, cuts)
    kept = _caches(engine)
    assert binds == [0, 0, 1, 0]  # (the 5-row catch-up opens the second range's list)

    # the list set for 37 rows after serving 50, 23, 5 and 9: what binding the 37-row program gives
    patched = _values(engine._chunk_launches([], 0, 37, True, True, True, False))
    assert patched == _values(engine.launches.bind(engine._text_ops(37, True, True, True, False)))
    assert patched != _values(engine.launches.bind(engine._text_ops(23, True, True, True, False)))

    # every chunk through a list bound for its own size, as before lists were kept per row range
    monkeypatch.setattr(
        engine.launches, "eager_rows", lambda key, rows, span, ops_at: engine.launches.bind(ops_at(rows))
    )
    fresh_tokens, _ = _catch_ups(engine, cuts)
    assert tokens == fresh_tokens
    fresh = _caches(engine)
    assert len(kept) == len(fresh) and all(np.array_equal(a, b) for a, b in zip(kept, fresh))


def test_a_program_not_affine_in_the_row_count_keeps_a_list_per_row_count(backend):
    """Where a launch's argument does not follow the row count affinely, no RowPatch can set the list: each row
    count gets (and keeps) a list bound for it, as a fresh bind gives it."""
    engine, lists = backend.engine, backend.engine.launches

    def ops_at(rows: int) -> list:
        ops = engine._text_ops(rows, True, True, True, False)
        first = ops[0]
        name = next(n for n in first.entry.args if type(first.args[n]) is int)  # (an integer argument, squared)
        ops[0] = replace(first, args={**first.args, name: rows * rows})
        return ops

    before = lists.binds
    at_20 = _values(lists.eager_rows(("squared",), 20, (18, 2048), ops_at))
    at_30 = _values(lists.eager_rows(("squared",), 30, (18, 2048), ops_at))
    again_20 = _values(lists.eager_rows(("squared",), 20, (18, 2048), ops_at))
    assert lists.binds - before == 2
    assert at_20 == again_20 == _values(lists.bind(ops_at(20))) and at_30 == _values(lists.bind(ops_at(30)))
