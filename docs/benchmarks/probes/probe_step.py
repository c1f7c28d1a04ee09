"""Probe: where a batch-1 decode step's time goes on the GPU. Per variant (fork / PDL on or off, the
decode graph captured again): the host loop as `thorgen bench` runs it (stage, replay, read the token, per step),
back-to-back replays of the graph (GPU time), and stage + replay with no read (what launching ahead would leave);
then the DFlash draft and verify graphs. Not part of the engine: a measurement for docs/benchmarks/NOTES.md, run on
the GPU box after `thorgen synth-checkpoint --preset gemma-4-26b-a4b --out /tmp/full` and `thorgen repack-weights`,
with THORGEN_KERNELS naming a full-size build (PROBE_VARIANTS, PROBE_JSON: which variants, where the JSON goes)."""

import json
import os
import time
from pathlib import Path
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt
from probe_common import decode, spec_step_times, use_variant

out = {}
b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
P = len(prompt)


def host_loop(n=200):
    eng.prefill(prompt, True)
    for i in range(8):
        decode(eng, P + i)
    t = time.perf_counter()
    for i in range(8, 8 + n):
        decode(eng, P + i)
    return (time.perf_counter() - t) / n * 1e3


def replays(n=200):
    g = eng.steps.row_graph(True)
    eng.steps.stage_row(P + 8, None)
    g.replay(eng.stream)
    e0, e1 = eng.device.event(), eng.device.event()
    eng.stream.synchronize()
    t = time.perf_counter()
    e0.record(eng.stream)
    for _ in range(n):
        g.replay(eng.stream)
    e1.record(eng.stream)
    eng.stream.synchronize()
    return e1.elapsed_ms(e0) / n, (time.perf_counter() - t) / n * 1e3


def staged_replays(n=200):
    """Stage + replay per step, no sync (what launching ahead would leave)."""
    g = eng.steps.row_graph(True)
    e0, e1 = eng.device.event(), eng.device.event()
    eng.stream.synchronize()
    e0.record(eng.stream)
    for i in range(n):
        eng.steps.stage_row(P + 8 + i, None)
        g.replay(eng.stream)
        if i % 100 == 99:
            eng.stream.synchronize()
    e1.record(eng.stream)
    eng.stream.synchronize()
    return e1.elapsed_ms(e0) / n


ALL = [
    ("default", True, True),
    ("nofork", False, True),
    ("nopdl", True, False),
    ("neither", False, False),
    ("default2", True, True),
]
want = os.environ.get("PROBE_VARIANTS", "default,nofork,nopdl,neither,default2").split(",")
for name, fork, pdl in [v for v in ALL if v[0] in want]:
    use_variant(eng, fork, pdl)
    r = {"host_loop_ms": host_loop(), "replay_ms": replays(), "staged_replay_ms": staged_replays()}
    out[name] = r
    print(name, json.dumps(r), flush=True)
    use_variant(eng, True, True)

if eng.speculative:
    out.update(spec_step_times(eng, prompt))
    print("spec", json.dumps({k: out[k] for k in ("spec_step_host_ms", "draft_replay_ms", "verify_replay_ms")}))
json.dump(
    out,
    open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe_step.json")), "w"),
    indent=1,
)
