"""Probe helpers shared by the device probes beside this file (probe_step, probe_drop, probe_spec,
probe_dup_verify), which import it from their own folder. Not part of the engine."""

import dataclasses
import time

from thorgen.runtime.cuda.profile import replay_us


def use_variant(eng, fork, pdl):
    """Bind the engine's later launches with the side stream and PDL on or off (graphs captured again)."""
    eng.launches.drop_graphs()
    eng.launches.options = dataclasses.replace(eng.options, fork=fork, pdl=pdl)


def decode(eng, position, greedy=True):
    """One one-row step, launched and then waited for: its token."""
    return eng.steps.wait(eng.steps.launch_one(position, greedy))[0]


def spec_step(eng, start, last, greedy=True):
    """One DFlash step, launched and then waited for: (drafts, target tokens, accepted count)."""
    return eng.dflash.wait(eng.dflash.launch(start, last, greedy))


def graph_replay_us(eng, ops, n, before=None):
    """Mean GPU time (us) of n back-to-back replays of `ops` captured as one graph, bound as the engine's step graphs
    are (side stream, PDL); `before()` (e.g. staging a step's inputs) runs first (stream-ordered before the replays)."""
    launches = eng.launches.bind(ops, captured=True)
    if before is not None:
        before()
    return replay_us(eng, launches, n, "probe")


def spec_step_times(eng, prompt, n=50):
    """A speculative generation's host loop (ms a spec_step after 3 warm-up steps) and its draft and verify graphs
    replayed n times each (GPU ms a replay). The verify graph ends with the acceptance kernel, which moves the staged
    block on by the step's count (mostly 1 here): the replays run at up to n positions later."""
    P = len(prompt)
    eng.prefill(prompt, True, taps=True)
    for i in range(3):
        spec_step(eng, P + 16 * i, 1000, True)
    t = time.perf_counter()
    for i in range(n):
        spec_step(eng, P + 48 + 16 * i, 1000, True)
    host = (time.perf_counter() - t) / n * 1e3
    d, v = eng.dflash.graph("draft"), eng.dflash.graph("verify", True)
    e0, e1, e2 = eng.device.event(), eng.device.event(), eng.device.event()
    eng.stream.synchronize()
    e0.record(eng.stream)
    for _ in range(n):
        d.replay(eng.stream)
    e1.record(eng.stream)
    for _ in range(n):
        v.replay(eng.stream)
    e2.record(eng.stream)
    eng.stream.synchronize()
    return {
        "spec_step_host_ms": host,
        "draft_replay_ms": e1.elapsed_ms(e0) / n,
        "verify_replay_ms": e2.elapsed_ms(e1) / n,
    }
