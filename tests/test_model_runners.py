"""The ModelRunner contract (runtime/engine/core.py), checked the same way on every runner: the reference
runner, the cuda runner on the CPU emulator and the scripted test runner. `check` refuses bad requests, a KV
manager over its `kv_geometry` admits a sequence (a cached prefix shorter than the prompt) whose instructions it
executes, `prefill` samples only when asked, `decode` commits 1..room tokens per sequence, and each calls
`launched` exactly once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.engine.kv_manager import KVManager  # noqa: E402
from thorgen.runtime.engine.sequence import Sequence  # noqa: E402


@pytest.fixture(scope="module", params=["reference", "cuda-emulated", "scripted"])
def runner(request, tiny_checkpoint, tiny_ckpt, tmp_path_factory):
    if request.param == "reference":
        from thorgen.runtime.reference.backend import ReferenceBackend

        yield ReferenceBackend(tiny_ckpt, max_context=256, prefix_cache=False).runner(max_num_seqs=2)
    elif request.param == "scripted":
        from scripted_backend import ScriptedBackend

        yield ScriptedBackend(lambda p: [200, 201, 202] * 20, max_context=256, chunk=2).runner(2)
    else:
        pytest.importorskip("thorgen.codegen.plan")
        import engine_emulator as EE
        from thorgen.runtime.cuda import device as dev
        from thorgen.runtime.cuda.backend import open_backend
        from thorgen.runtime.convert.repack import repack

        root = tmp_path_factory.mktemp("runner")
        weights = repack(tiny_checkpoint, root / "weights")
        EE.install(kernels := EE.write_fake_manifest(tiny_ckpt.spec, root / "kernels"))
        backend = open_backend(tiny_checkpoint, ctx=256, weights_dir=weights, kernels_dir=kernels)
        yield backend.runner()
        backend.close()
        dev.set_driver(None)


def _calls():
    log: list[int] = []
    return log, (lambda: log.append(1))


def test_runner_contract(runner):
    g = runner.kv_geometry
    assert runner.max_num_seqs >= 1 and g.lanes >= 1 and runner.max_context >= 2 and runner.verify_block >= 1
    assert not g.pages or g.pages * g.page >= runner.max_context  # one sequence of the whole context fits
    seq = Sequence("r", [2] + list(range(300, 310)), SamplingParams(), max_tokens=6, stop_ids=frozenset({1}))
    runner.check(seq)
    kv = KVManager(g, runner.draft_context)
    cached = kv.admit(seq, len(seq.prompt) - 1, len(seq.prompt) + runner.verify_block + runner.lookahead)
    assert cached is not None and 0 <= cached < len(seq.prompt) and seq.lane is not None
    runner.apply(kv.take_ops())
    log, launched = _calls()
    first = runner.prefill(seq, cached, len(seq.prompt), True, launched)
    assert isinstance(first, int) and log == [1]
    seq.num_cached, seq.output = len(seq.prompt), [first]
    log, launched = _calls()
    ((tokens, drafted),) = runner.decode([seq], launched)
    assert 1 <= len(tokens) <= seq.room(runner.max_context) and isinstance(drafted, int) and log == [1]
    seq.num_cached, seq.output = seq.num_tokens - 1 + len(tokens), seq.output + tokens
    kv.release(seq, finished=True)
    runner.release(seq, finished=True)


def test_runner_refuses_out_of_vocabulary_ids(runner):
    if type(runner).__name__ == "ScriptedRunner":
        pytest.skip("the scripted runner replays a script: it has no model to refuse ids for")
    with pytest.raises(BackendError, match="vocabulary"):
        runner.check(Sequence("bad", [2, 10**7], SamplingParams(), max_tokens=2))
