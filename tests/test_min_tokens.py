"""min_tokens on both backends (the cuda one on the CPU emulator): the sequence's stop ids are masked off until that
many tokens are out. The stop id is the token that greedy decoding of the prompt picks at position K, so that
without min_tokens the answer stops there, and with min_tokens > K it cannot, and runs on past K."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from thorgen.runtime.backend import SamplingParams  # noqa: E402

PROMPT = [2, 105, 11, 12, 13, 107]
K = 2


@pytest.fixture(scope="module", params=["reference", "cuda"])
def backend(request, tiny_ckpt, tiny_checkpoint, tmp_path_factory):
    if request.param == "reference":
        from thorgen.runtime.reference.backend import ReferenceBackend

        yield ReferenceBackend(tiny_ckpt, max_context=256, prefix_cache=False)
        return
    pytest.importorskip("thorgen.codegen.plan")
    import engine_emulator as EE
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("min_tokens"), ctx=256, max_num_seqs=2)
    yield b
    b.close()
    dev.set_driver(None)


def test_stop_ids_are_masked_until_min_tokens(backend):
    plain = backend.generate(PROMPT, 12, SamplingParams()).token_ids
    stop = plain[K]
    first = plain.index(stop)  # the stop id's first place in the plain answer (K or earlier)
    stopped = backend.generate(PROMPT, 12, SamplingParams(), stop_ids=frozenset({stop}))
    assert stopped.finish_reason == "stop" and stopped.token_ids == plain[: first + 1]
    held = backend.generate(PROMPT, 12, SamplingParams(min_tokens=first + 3), stop_ids=frozenset({stop}))
    assert stop not in held.token_ids[: first + 3], (held.token_ids, stop)
    assert len(held.token_ids) >= first + 3
    # sampled, too: none of the stop ids before min_tokens, whatever the seed
    for seed in range(3):
        sp = SamplingParams(temperature=1.5, seed=seed, min_tokens=6)
        out = backend.generate(PROMPT, 8, sp, stop_ids=frozenset(plain[:4])).token_ids
        assert len(out) >= 6 and not set(out[:6]) & set(plain[:4]), (seed, out)
