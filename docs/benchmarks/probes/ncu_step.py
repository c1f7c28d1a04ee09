"""Device probe: one decode step and one speculative step under ncu (cuProfilerStart/Stop around them; NCU_WHAT picks)."""
import os
from pathlib import Path
from cuda.bindings import driver as cu
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
prompt = synthetic_prompt(b.spec, 512)
P = len(prompt)
what = os.environ.get("NCU_WHAT", "decode,spec").split(",")
eng.prefill(prompt, True)
for i in range(4):
    eng.decode(P + i, True)
if "decode" in what:
    cu.cuProfilerStart()
    eng.decode(P + 4, True)
    cu.cuProfilerStop()
if "spec" in what and eng.speculative:
    eng.prefill(prompt, True, taps=True)
    for i in range(3):
        eng.spec_step(P + 16 * i, 1000, True)
    cu.cuProfilerStart()
    eng.spec_step(P + 48, 1000, True)
    cu.cuProfilerStop()
print("ncu probe done")
