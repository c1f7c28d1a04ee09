"""Probe: where a speculative step's time goes between graphs. Runs greedy DFlash
generations (emulated acceptance PROBE_ACCEPT, default 6) with the one-sequence steps launched ahead or not
(EngineOptions.launch_ahead), keeps every step's timing events (draft start, verify start, verify end), and reports
per step the
draft and verify GPU ms, the GPU idle gap from one step's verify end to the next step's draft start, and the wall
ms per step the client sees. Not part of the engine; run on the GPU box like probe_spec.py."""

import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.bench.timing import open_for_bench, synthetic_prompt

b, facts = open_for_bench("cuda", Path("/tmp/full"), None, "bf16")
eng = b.engine
eng.emulate_acceptance = int(os.environ.get("PROBE_ACCEPT", "6"))
prompt = synthetic_prompt(b.spec, 512)
made = []
real_launch = eng.dflash.launch


def kept_launch(*a, **k):  # each step's timing events survive the wait's destroy, to be read after the run
    launch = real_launch(*a, **k)
    for ev in launch.timing:
        ev.destroy = lambda: None
    made.extend(launch.timing)
    return launch


eng.dflash.launch = kept_launch
out = {}
for ahead in os.environ.get("PROBE_AHEAD", "0,1,0,1").split(","):
    eng.options = dataclasses.replace(eng.options, launch_ahead=ahead == "1")  # (read by each new runner)
    made.clear()
    eng.spec_timing = []
    walls, t = [], None
    for _ in b.generate_stream(prompt, int(os.environ.get("PROBE_GEN", "512")), SamplingParams(), speculative=True):
        now = time.perf_counter()
        if t is not None:
            walls.append(1e3 * (now - t))
        t = now
    eng.stream.synchronize()
    steps = [made[i : i + 3] for i in range(0, len(made) - 2, 3)]
    draft = [s[1].elapsed_ms(s[0]) for s in steps]
    verify = [s[2].elapsed_ms(s[1]) for s in steps]
    gap = [n[0].elapsed_ms(p[2]) for p, n in zip(steps, steps[1:])]
    r = {
        "steps": len(steps),
        "draft_ms_median": statistics.median(draft),
        "verify_ms_median": statistics.median(verify),
        "verify_ms_mean": statistics.fmean(verify),
        "gap_ms_median": statistics.median(gap),
        "gap_ms_mean": statistics.fmean(gap),
        "gap_ms_max": max(gap),
        "wall_ms_median": statistics.median(walls),
        "wall_ms_mean": statistics.fmean(walls),
        "gpu_span_ms_per_step": steps[-1][2].elapsed_ms(steps[0][0]) / len(steps),
    }
    out.setdefault(f"ahead{ahead}", []).append(r)
    print(f"ahead={ahead}", json.dumps({k: round(v, 4) for k, v in r.items()}), flush=True)
    for ev in made:
        type(ev).destroy(ev)
json.dump(
    out,
    open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("PROBE_JSON", "probe_gap.json")), "w"),
    indent=1,
)
