"""Probe: the engine core's step times with 8 decoding sequences while prompts arrive that run in layer pieces
beside them (EngineOptions.prefill_pieces), with the host time of each step's pieces (cutting a chunk shape,
binding and launching its pieces). Not part of the engine: a measurement for docs/benchmarks/NOTES.md, run on a GPU
machine with the full-size synthetic checkpoint at /tmp/full and its kernels at /tmp/knew; argv[1] "pieces" (the
runner launches each step ahead, as served) or "pieces-no-ahead"; writes $OUT/piece-probe-<mode>.json."""

import json
import os
import sys
import time

import numpy as np

from thorgen.runtime.backend import SamplingParams
from thorgen.runtime.cuda.backend import open_backend
from thorgen.runtime.cuda.runner import CudaRunner
from thorgen.runtime.engine.core import EngineCore
from thorgen.runtime.options import EngineOptions

mode = sys.argv[1] if len(sys.argv) > 1 else "pieces"
b = open_backend(
    "/tmp/full", ctx=4096, kernels_dir="/tmp/knew", max_num_seqs=16, options=EngineOptions(prefill_pieces=True)
)
eng = b.engine
host = {"begin": 0.0, "bind": 0.0, "run": 0.0, "nbind": 0}


def timed(obj, name: str, key: str, count: str | None = None) -> None:
    inner = getattr(obj, name)

    def call(*args, **kwargs):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        host[key] += time.perf_counter() - t
        if count:
            host[count] += 1
        return out

    setattr(obj, name, call)


timed(eng.pieces, "begin", "begin")
timed(eng.launches, "bind", "bind", "nbind")
timed(eng.launches, "run", "run")
core = EngineCore(CudaRunner(eng, 16, launch_ahead=mode == "pieces"))
greedy = SamplingParams()
rng = np.random.default_rng(0)


def prompt(n: int) -> list[int]:
    return [2] + [int(x) for x in rng.integers(100, min(200000, eng.spec.target.vocab_size), n - 1)]


def step() -> dict:
    before, marks, t0 = dict(host), [], time.perf_counter()
    core.step(launched=lambda: marks.append(time.perf_counter()))
    t1 = time.perf_counter()
    row = {"wall_ms": round((t1 - t0) * 1e3, 3), "to_launched_ms": round(((marks[0] if marks else t1) - t0) * 1e3, 3)}
    row |= {k: round((host[k] - before[k]) * 1e3, 3) for k in ("begin", "bind", "run")}
    row["nbind"] = host["nbind"] - before["nbind"]
    return row | {"pieced_lane": eng.pieces.lane, "running": len(core.scheduler.running)}


for i in range(8):
    core.add(f"d{i}", prompt(512), 2000, greedy)
for _ in range(40):
    step()
gpu = os.popen("nvidia-smi --query-gpu=name --format=csv,noheader").read().strip()
out: dict = {"mode": mode, "gpu": gpu, "decode8": [step()["wall_ms"] for _ in range(30)]}
for name, n in [("text512_a", 512), ("text512_b", 512), ("rows1630_a", 1630), ("rows1630_b", 1630)]:
    core.add(name, prompt(n), 2, greedy)
    rows = []
    while any(s.request_id == name for s in [*core.scheduler.running, *core.scheduler.waiting]) and len(rows) < 80:
        rows.append(step())
    out[name] = rows + [step() for _ in range(3)]
    print(name, [r["wall_ms"] for r in out[name]], flush=True)
print("decode8 median", float(np.median(out["decode8"])))
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"piece-probe-{mode}.json"), "w") as f:
    json.dump(out, f, indent=1)
