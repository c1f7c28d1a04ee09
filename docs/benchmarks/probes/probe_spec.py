"""Probe: the speculative step's draft and verify graphs replayed (50 times each), with the side stream
and PDL on or off (PROBE_VARIANTS: default, nofork, nopdl, neither), and the host loop of a DFlash step. Not part of the
engine: a measurement for docs/benchmarks/NOTES.md, run on the GPU box after `thorgen synth-checkpoint --preset
gemma-4-26b-a4b --out /tmp/full` and `thorgen repack-weights`, with THORGEN_KERNELS naming a full-size build."""

import json
import os
from pathlib import Path
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt
from probe_common import spec_step_times, use_variant

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
out = {}
ALL = {"default": (True, True), "nofork": (False, True), "nopdl": (True, False), "neither": (False, False)}
f0, p0 = eng.options.fork, eng.launches.pdl_safe
for name in os.environ.get("PROBE_VARIANTS", "default,nofork,nopdl,default").split(","):
    fork, pdl = ALL[name]
    use_variant(eng, fork and f0, pdl and p0)
    r = spec_step_times(eng, prompt)
    out.setdefault(name, []).append(r)
    print("spec", name, json.dumps(r), flush=True)
json.dump(
    out,
    open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe_spec.json")), "w"),
    indent=1,
)
