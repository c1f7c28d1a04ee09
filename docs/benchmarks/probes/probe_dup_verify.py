"""Probe: the verify (16-row) graph with every launch of one kernel family run twice (back to back, same
arguments), for the families whose launches are idempotent (no in-place update). The replay time added is that
family's marginal cost inside the graph, with the step's data unchanged (leaving a family out, as probe_drop.py does
for decode, changes the verify's routing and so the MoE's cost: drops of -443 to +932 us). The second run finds its
weights in L2, so for weight-streaming kernels it is a lower bound. Also: the routing of the timed verify block, and
the graph on 16 distinct tokens. Not part of the engine: a measurement for docs/benchmarks/NOTES.md, run on the GPU
box after `thorgen synth-checkpoint --preset gemma-4-26b-a4b --out /tmp/full` and `thorgen repack-weights`, with
THORGEN_KERNELS naming a full-size build."""

import json
import os
from pathlib import Path
import numpy as np
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt
from thorgen.runtime.cuda.profile import distinct_tokens
from thorgen.model_spec.conventions import VERIFY_ROWS
from thorgen.runtime.cuda.dflash import DraftForward
from thorgen.model_spec.step_program import Op
from probe_common import graph_replay_us, spec_step

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
P = len(prompt)
eng.prefill(prompt, True, taps=True)
for i in range(4):
    spec_step(eng, P + 16 * i, 1000)
eng.stream.synchronize()
# what the timed verify steps route: the block's 16 tokens (last + 15 drafts) and layer 29's experts
ids = eng.act["ids"].download(np.int32, (16,))
tk = eng.act["topk_idx"].download(np.int32, (16, 8))
route = {
    "ids": ids.tolist(),
    "distinct_tokens": int(len(set(ids.tolist()))),
    "distinct_experts_last_layer": int(len(set(tk.ravel().tolist()))),
}
print("routing of the timed verify:", route, flush=True)
dfw = DraftForward(eng.fwd)
ops_all = eng.fwd.ops(VERIFY_ROWS, decode=False, last=True, greedy=True, taps=True, all_logits=True) + dfw.ctx_ops(
    VERIFY_ROWS
)
names = [op.entry.name for op in ops_all if isinstance(op, Op)]
N = int(os.environ.get("PROBE_N", "40"))
IN_PLACE = ("ffn_tail", "attn_tail", "embed", "dflash")


def timed(ops, n=N):
    return graph_replay_us(eng, ops, n)


def doubled(fam):
    out = []
    for op in ops_all:
        out.append(op)
        if isinstance(op, Op) and op.entry.name == fam:
            out.append(op)
    return out


res = {}
base = timed(ops_all)
rows = {}
for fam in sorted(set(names)):
    if any(fam.startswith(p) for p in IN_PLACE):
        continue
    d = timed(doubled(fam)) - base
    rows[fam] = {"count": names.count(fam), "dup_us": round(d, 1), "dup_us_a_launch": round(d / names.count(fam), 2)}
    print(f"{fam[:60]:60s} x{names.count(fam):2d} dup {d:7.1f} us ({d / names.count(fam):5.2f} a launch)", flush=True)
res["verify_base_us"] = base
res["routing"] = route
# the same graph on 16 distinct tokens (profile_speculative's ids): the routing real text gives, about
spec_ids = ids.copy()
eng.act["ids"].view(0, 64).upload(distinct_tokens(16, b.spec.target.vocab_size).astype(np.int32), stream=eng.stream)
res["verify_distinct_tokens_us"] = timed(ops_all)
tk2 = eng.act["topk_idx"].download(np.int32, (16, 8))
res["distinct_experts_last_layer_distinct_tokens"] = int(len(set(tk2.ravel().tolist())))
print(
    "verify on 16 distinct tokens:",
    res["verify_distinct_tokens_us"],
    "us, experts (last layer)",
    res["distinct_experts_last_layer_distinct_tokens"],
    flush=True,
)
eng.act["ids"].view(0, 64).upload(spec_ids, stream=eng.stream)
res["verify_base2_us"] = timed(ops_all)
res["families"] = rows
print(f"verify base {base:.1f} / {res['verify_base2_us']:.1f} us", flush=True)
json.dump(
    res,
    open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe_dup_verify.json")), "w"),
    indent=1,
)
