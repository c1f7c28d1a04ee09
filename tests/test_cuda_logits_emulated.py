"""CPU tests of the cuda backend's processed head on the emulated engine (tests/engine_emulator.py): penalties,
logit_bias, grammar masks and logprobs run on the device (lm_process, lm_pick, lm_logprobs), batched or alone.
Each committed token is checked against runtime/reference/logits.py applied to the engine's own logits of that
step, so the wiring (what the runner uploads, which rows the kernels read) is what is tested; the kernels
themselves against their NumPy references in tests/test_logits_kernels.py and on the GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")

from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.engine.core import EngineCore  # noqa: E402
from thorgen.runtime.reference.logits import process, token_logprob  # noqa: E402
from thorgen.runtime.reference.ops import softcap  # noqa: E402

# Engine.score's rows run the batched forward (rowwise attention, the batched MoE/GEMM forms), the reference a
# prefill: the kernels' fp16 roundings differ, measured up to 5.1e-3 (absolute logprob) on the tiny model.
SCORE_TOL = 1e-2


@pytest.fixture(scope="module")
def backend(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("logits"), ctx=512, max_num_seqs=2)
    yield b
    b.close()
    dev.set_driver(None)


def _capped(backend) -> np.ndarray:
    return softcap(backend.engine.logits().astype(np.float64), backend.spec.target.final_logit_softcapping)


def test_penalties_bias_and_logprobs_follow_the_reference_each_step(backend):
    """One sequence, step by step: the token is the argmax of the reference processing of that step's logits,
    and the logprobs are the reference's of the unprocessed ones."""
    sp = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        logit_bias=((11, 5.0), (12, -100.0)),
        logprobs=3,
    )
    prompt = [2, 105, 11, 12, 13, 107]
    core = EngineCore(backend.runner(1))
    seq = core.add("p", prompt, 6, sp)
    output: list[int] = []
    while core.unfinished:
        outs = core.step()
        toks = [t for o in outs for t in o.token_ids]
        if not toks:
            continue
        (tok,) = toks
        capped = _capped(backend)
        want = int(np.argmax(process(capped, sp, prompt, output, None)))
        assert tok == want, f"position {len(prompt) + len(output)}"
        (lp,) = [o.logprobs for o in outs if o.token_ids][0]
        ref = token_logprob(capped, tok, 3)
        assert lp[0] == pytest.approx(ref[0], abs=1e-4)
        assert [i for i, _ in lp[1]] == [i for i, _ in ref[1]]
        output.append(tok)
    assert 12 not in output and seq.output == output


def test_processed_and_plain_rows_in_one_batch(backend):
    """A biased request beside a plain one: the bias forces its token, the plain one equals itself alone."""
    forced = SamplingParams(logit_bias=((77, 100.0),))
    plain = SamplingParams()

    def run(requests):
        core = EngineCore(backend.runner(2))
        for rid, (p, sp) in requests.items():
            core.add(rid, p, 5, sp)
        out = {rid: [] for rid in requests}
        while core.unfinished:
            for o in core.step():
                out[o.request_id] += o.token_ids
        return out

    together = run({"f": ([2, 300, 301], forced), "p": ([2, 400, 401, 402], plain)})
    assert together["f"] == [77] * 5
    assert together["p"] == run({"p": ([2, 400, 401, 402], plain)})["p"]


def test_json_schema_on_the_cuda_backend(backend, tiny_checkpoint):
    """A grammar's mask on the device: random weights still give schema-valid JSON."""
    pytest.importorskip("llguidance")
    from thorgen.runtime.text.grammar import Grammar, json_grammar, tokenizer
    from thorgen.runtime.text.tokenizer import Tokenizer

    schema = {
        "type": "object",
        "properties": {"n": {"type": "boolean"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    stops = (1, 106)
    ll = tokenizer(str(tiny_checkpoint / "tokenizer.json"), backend.spec.target.vocab_size, stops)
    sp = SamplingParams(grammar=Grammar(json_grammar(schema, ll), ll))
    core = EngineCore(backend.runner(1))
    core.add("j", [2, 105, 200, 107], 40, sp, stop_ids=frozenset(stops))
    out = []
    while core.unfinished:
        for o in core.step():
            out += o.token_ids
    text = Tokenizer.from_checkpoint(tiny_checkpoint).decode([t for t in out if t not in stops])
    assert isinstance(json.loads(text)["n"], bool), text  # (an integer could grow digits past max_tokens)


def test_prompt_logprobs_on_the_cuda_backend(backend, tiny_checkpoint, tmp_path):
    """Engine.score's batched passes (MAX_BATCH consecutive positions per pass, then a last row that samples)
    give every prompt token the w4a16 reference's logprob and top ids, across a prefill chunk boundary; the
    generated tokens equal the unscored request's."""
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.reference.backend import ReferenceBackend

    kernels = Path(backend.engine.manifest.path).parent
    ref = ReferenceBackend(
        Checkpoint.open(tiny_checkpoint), max_context=512, prefix_cache=False, numerics="w4a16", kernels=kernels
    )
    prompt = [2] + [110 + (7 * i) % 390 for i in range(70)]  # 71 tokens: passes of 32, 32 and 6 + the last row
    runner = backend.runner(1)
    runner.prefill_chunk = 40  # two prefill chunks: the second starts mid-pass
    core = EngineCore(runner, max_step_tokens=40)
    core.add("s", prompt, 4, SamplingParams(prompt_logprobs=2))
    first, got = None, []
    while core.unfinished:
        for o in core.step():
            got += o.token_ids
            first = first or (o if o.prompt_logprobs is not None else None)
    want = ref.generate(prompt, 4, SamplingParams(prompt_logprobs=2))
    assert got == backend.generate(prompt, 4, SamplingParams()).token_ids
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for i, ((lp, top), (rlp, rtop)) in enumerate(zip(entries[1:], want.prompt_logprobs[1:]), start=1):
        assert lp == pytest.approx(rlp, abs=SCORE_TOL), i
        for (t, v), (rt, rv) in zip(top, rtop):  # the same ids, but where the reference's own values tie
            assert t == rt or abs(v - rv) <= SCORE_TOL, (i, top, rtop)
