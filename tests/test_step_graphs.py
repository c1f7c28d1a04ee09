"""Step graphs captured when a runner is made (runtime/cuda/step_graphs.py), on the emulated engine
(tests/engine_emulator.py): a mixed workload (batched plain and verify steps, a lone DFlash sequence, sampled rows,
logprobs) replays only graphs that were captured up front, and `--no-capture-graphs` captures none ahead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.options import EngineOptions  # noqa: E402


def run_all(core: EngineCore) -> None:
    for _ in range(2000):
        if not core.unfinished:
            return
        core.step()
    raise AssertionError("the requests did not finish")


def prompt(i: int) -> list[int]:
    return [2] + list(range(300 + 7 * i, 330 + 7 * i))


@pytest.fixture()
def backend_of(tiny_checkpoint, tmp_path):
    opened = []

    def make(**options):
        b = EE.open_emulated(
            tiny_checkpoint, tmp_path / str(len(opened)), ctx=1024, max_num_seqs=4, options=EngineOptions(**options)
        )
        opened.append(b)
        return b

    yield make
    for b in opened:
        b.close()


def test_a_mixed_workload_replays_only_graphs_captured_up_front(backend_of):
    backend = backend_of()
    backend.emulate_acceptance(3)
    graphs = backend.engine.launches.graphs
    runner = backend.runner(4)
    captured = set(graphs)
    # (the shapes a server meets one at a time: every plain bucket up to 4 sequences, every verify bucket up to
    # MAX_BATCH rows, every drafter head size)
    assert {"batch1_greedy", "batch4_sample_ext", "batch32_greedy_taps", "draft_batch4", "draft_head32"} <= captured
    assert "batch8_greedy" not in captured  # (more rows than 4 sequences hold)

    verifies = []
    step = runner.batched.step
    runner.batched.step = lambda seqs, *a: verifies.append(len(seqs)) or step(seqs, *a)
    core = EngineCore(runner)
    sampled = SamplingParams(temperature=0.8, seed=5)
    core.add("lone", prompt(0), 40, SamplingParams(), speculative=True)
    run_all(core)
    assert core.speculation["speculative_steps"] > 0 and not verifies  # (alone: the one-sequence DFlash graphs)
    core.add("a", prompt(1), 30, SamplingParams(), speculative=True)
    core.add("b", prompt(2), 25, sampled, speculative=True)
    core.add("c", prompt(3), 20, SamplingParams(logprobs=2), speculative=True)
    core.add("d", prompt(4), 35, SamplingParams(temperature=0.7, seed=1, logprobs=1))
    run_all(core)
    assert max(verifies) >= 3  # (batched verify steps of several sequences ran)
    assert set(graphs) == captured, sorted(set(graphs) - captured)


def test_without_capture_graphs_a_runner_captures_nothing_ahead(backend_of):
    backend = backend_of(capture_graphs=False)
    backend.runner(4)
    assert not backend.engine.launches.graphs
