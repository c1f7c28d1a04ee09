"""Batched plain steps of speculative sequences on the cuda backend, on the emulated GPU (tests/engine_emulator.py):
they keep the DFlash taps (each sequence's drafter context) only where a batched verify step could still hold a
draft for each of them, i.e. up to half of MAX_BATCH sequences."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.model_spec.conventions import MAX_BATCH  # noqa: E402
from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.options import DraftOptions, EngineOptions  # noqa: E402
from test_engine_batched_speculative_emulated import _serve  # noqa: E402

GREEDY = SamplingParams()
LANES = MAX_BATCH // 2 + 1


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    options = EngineOptions(capture_graphs=False)
    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("taps"), ctx=64, max_num_seqs=LANES, options=options)
    yield b
    b.close()
    dev.set_driver(None)


def test_plain_batched_steps_keep_the_taps_only_where_a_draft_could_fit(backend):
    """Half of MAX_BATCH speculative sequences, then one more (admitted into that crowd: it decodes plain): the
    cost model gives none of the 17 a draft (no verify step of them could hold one draft each), so their plain
    batched steps run without the DFlash taps; once finished sequences shrink the batch to half, the plain steps
    keep the taps again and the sequences that draft first catch their drafter context up. Every token is plain
    decoding's."""
    n = LANES
    requests = {f"r{i}": ([2] + list(range(300, 306 + i)), 3 + 2 * i, GREEDY) for i in range(n)}
    last = {f"r{n - 1}": requests.pop(f"r{n - 1}")}
    free = _serve(backend, requests, speculative=False, lanes=n, later=last).tokens
    launches: list[tuple[int, bool]] = []  # the plain batched steps' (rows, taps)
    runners: list = []

    def spy(core) -> None:
        runners.append(core.runner)
        runner, steps = core.runner, core.runner.steps
        launch_batch, plain_step = steps.launch_batch, runner._launch

        def recording(rows, carried=None, ext=False, taps=False):
            if plain[0]:
                launches.append((len(rows), taps))
            return launch_batch(rows, carried, ext, taps)

        def plain_launch(*args):
            plain[0] = True
            try:
                return plain_step(*args)
            finally:
                plain[0] = False

        plain = [False]
        steps.launch_batch, runner._launch = recording, plain_launch

    quiet = DraftOptions(prior=0.0, probe_every=1)  # (no drafts until a probe: the first steps are plain)
    run = _serve(
        backend, requests, speculative=True, drafts=quiet, lanes=n, between=lambda i, core: i or spy(core), later=last
    )
    assert run.tokens == free
    assert any(rows == n for rows, _ in launches)
    assert not any(taps for rows, taps in launches if 2 * rows > MAX_BATCH)
    assert any(taps for rows, taps in launches if 2 <= rows and 2 * rows <= MAX_BATCH)
    assert runners[0].caught_up_tokens > 0 and run.speculation["speculative_steps"] > 0
