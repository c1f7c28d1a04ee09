"""Probe: a decode step's graph with one kernel family left out at a time, with and without the side
stream. The drop in replay time is what the family costs inside the step; beside its time alone (profile_step, each
kernel's launches replayed as their own graph) it shows where the step's time over the kernel sum lives. Not part of
the engine: a measurement for docs/benchmarks/NOTES.md (run as probe_step.py is; the outputs are meaningless, only
the times count)."""

import dataclasses
import json
import os
from pathlib import Path
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt
from thorgen.runtime.cuda.profile import per_kernel, profile_step
from thorgen.model_spec.step_program import Op
from probe_common import decode, graph_replay_us, use_variant

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
P = len(prompt)
eng.prefill(prompt, True)
decode(eng, P)
eng.stream.synchronize()
iso = {k["kernel"]: k["us"] for k in per_kernel(profile_step(eng, P + 1))}
ops_all = eng.fwd.ops(1, decode=True, last=True, greedy=True)
names = [op.entry.name for op in ops_all if isinstance(op, Op)]


def timed(ops, n=200):
    return graph_replay_us(eng, ops, n, before=lambda: eng.steps.stage_row(P + 1, None))


def without(fam):
    out, carry_join = [], False
    for op in ops_all:
        if isinstance(op, Op) and op.entry.name == fam:
            carry_join = carry_join or op.join
            continue
        if isinstance(op, Op) and carry_join:
            op = dataclasses.replace(op, join=True)
            carry_join = False
        out.append(op)
    return out


res = {}
for fork in (True, False):
    use_variant(eng, fork, True)
    base = timed(ops_all)
    rows = {}
    for fam in sorted(set(names), key=lambda f: -iso.get(f, 0)):
        d = base - timed(without(fam))
        rows[fam] = {"count": names.count(fam), "iso_us": round(iso.get(fam, 0), 1), "drop_us": round(d, 1)}
        print(
            f"fork={int(fork)} {fam[:58]:58s} x{names.count(fam):2d} iso {iso.get(fam, 0):7.1f} drop {d:7.1f}",
            flush=True,
        )
    res[f"fork{int(fork)}"] = {"base_us": base, "families": rows}
    print(f"fork={int(fork)} base {base:.1f} us, iso sum {sum(iso.values()):.1f}", flush=True)
use_variant(eng, True, True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_drop.json"), "w"), indent=1)
