"""Device probe: one decode step and one speculative step under ncu (cuProfilerStart/Stop around them; NCU_WHAT
picks)."""

import os
from pathlib import Path
from cuda.bindings import driver as cu
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt
from probe_common import decode, spec_step

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
P = len(prompt)
what = os.environ.get("NCU_WHAT", "decode,spec").split(",")
eng.prefill(prompt, True)
for i in range(4):
    decode(eng, P + i)
if "decode" in what:
    cu.cuProfilerStart()
    decode(eng, P + 4)
    cu.cuProfilerStop()
if "spec" in what and eng.speculative:
    eng.prefill(prompt, True, taps=True)
    for i in range(3):
        spec_step(eng, P + 16 * i, 1000)
    cu.cuProfilerStart()
    spec_step(eng, P + 48, 1000)
    cu.cuProfilerStop()
print("ncu probe done")
