"""Runtime stage: per-kernel GPU time of one forward of the engine (`thorgen bench`'s breakdown tables)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .engine import Engine
from .graphs import CudaGraph


def _bind_alone(eng: Engine, *op_lists: list) -> list[list[tuple[str, Any]]]:
    """Each op list bound for one stream with no PDL overlap, so that events (and per-kernel graphs) see each
    kernel alone."""
    return [eng.launches.bind(ops, alone=True) for ops in op_lists]


def distinct_tokens(n: int, vocab: int, first: int = 0) -> np.ndarray:
    """n different ordinary token ids spread over the vocabulary (entries first.. of one sequence), for timed steps
    of n rows: rows of one repeated token route to the same 8 experts, so a batched or verify MoE would read a
    fraction of the experts that distinct tokens (a real batch) make it read, and time too fast."""
    return (1000 + 7919 * np.arange(first, first + n)) % vocab


def _stage(eng: Engine, **values: np.ndarray) -> None:
    """Upload int32 inputs (ids, positions, lanes) for a profiled forward."""
    for name, v in values.items():
        v = np.asarray(v, np.int32)
        eng.act[name].view(0, v.nbytes).upload(v, stream=eng.stream)


def profile_step(eng: Engine, position: int = 0, rows: int = 1, replays: int = 10) -> list[dict]:
    """GPU time (us) per launch of one forward. A decode step (rows 1): the launches of each kernel are captured
    into a graph of their own and replayed (back to back, as in the step graph; each layer's own weights), so a
    kernel's time excludes host launch gaps. A prefill chunk of `rows` tokens (ids 0..rows-1 at positions
    position..): eager launches timed one by one with events."""
    (launches,) = _bind_alone(
        eng, eng.fwd.ops(1, decode=True, last=True) if rows == 1 else eng.fwd.ops(rows, decode=False, last=True)
    )
    if rows == 1:
        eng.steps.stage_row(position, 0)
        eng.steps.row_graph(True).replay(eng.stream)  # every buffer holds the values of a real step
        return _graph_profile(eng, launches, replays)
    _stage(eng, ids=np.arange(rows), positions=np.arange(position, position + rows))
    return _eager_profile(eng, launches)


def profile_batched(eng: Engine, rows: int, position: int) -> list[dict]:
    """GPU time (us) per launch of one batched decode forward of `rows` sequences (lanes 0..rows-1, each at
    `position`): eager launches on one stream, timed with events."""
    (launches,) = _bind_alone(eng, eng.fwd.ops(rows, decode=False, last=True, batched=True))
    _stage(
        eng,
        ids=distinct_tokens(rows, eng.spec.target.vocab_size),
        positions=np.full(rows, position),
        lanes=np.arange(rows),
    )
    return _eager_profile(eng, launches)


def profile_speculative(eng: Engine, position: int) -> tuple[list[dict], list[dict]]:
    """GPU time (us) per launch of one DFlash step of lane 0 at `position`: (the draft forward, the verify forward
    with its drafter-context update), eager launches on one stream, timed with events."""
    from ...model_spec.conventions import VERIFY_ROWS
    from .dflash import DraftForward

    dfw = DraftForward(eng.fwd)
    draft, verify = _bind_alone(eng, dfw.block_ops(), dfw.verify_ops())
    _stage(
        eng,
        ids=distinct_tokens(VERIFY_ROWS, eng.spec.target.vocab_size),
        positions=np.arange(position, position + VERIFY_ROWS),
        lanes=np.zeros(VERIFY_ROWS),
    )
    return _eager_profile(eng, draft), _eager_profile(eng, verify)


def profile_encode(eng: Engine, image: Any) -> list[dict]:
    """GPU time (us) per launch of the vision tower on one image: eager launches on one stream, timed with
    events (after one untimed encode, so that every kernel is loaded)."""
    if eng.vision is None:
        raise ValueError("this engine has no vision tower on the device")
    eng.vision.encode(image)
    eng.vision.stage([image], eng.vision.stream)  # (on the tower's own stream: done before the profiled launches)
    eng.vision.stream.synchronize()
    (launches,) = _bind_alone(eng, eng.vision.ops(image.soft_tokens))
    return _eager_profile(eng, launches)


def _eager_profile(eng: Engine, launches: list[tuple[str, Any]]) -> list[dict]:
    events = [eng.device.event() for _ in range(len(launches) + 1)]
    events[0].record(eng.stream)
    for (_, launch), ev in zip(launches, events[1:]):
        launch(eng.stream)
        ev.record(eng.stream)
    eng.stream.synchronize()
    out = [
        {
            "op": label,
            "kernel": launch.kernel.name if getattr(launch, "kernel", None) else "memcpy2d",
            "us": 1e3 * events[i + 1].elapsed_ms(events[i]),
        }
        for i, (label, launch) in enumerate(launches)
    ]
    for e in events:
        e.destroy()
    return out


def replay_us(eng: Engine, launches: list[tuple[str, Any]], replays: int, what: str) -> float:
    """GPU time (us) of one replay of `launches` captured as a graph: a warm-up replay, then `replays` back to back
    between two events (also the device probes' graph timing, docs/benchmarks/probes/probe_common.py)."""
    g = CudaGraph.capture(eng.stream, lambda: [l(eng.stream) for _, l in launches], what)
    try:
        g.replay(eng.stream)
        a, b = eng.device.event(), eng.device.event()
        a.record(eng.stream)
        for _ in range(replays):
            g.replay(eng.stream)
        b.record(eng.stream)
        eng.stream.synchronize()
        us = 1e3 * b.elapsed_ms(a) / replays
        a.destroy()
        b.destroy()
    finally:
        g.destroy()
    return us


def _graph_profile(eng: Engine, launches: list[tuple[str, Any]], replays: int) -> list[dict]:
    groups: dict[str, list[tuple[str, Any]]] = {}
    for label, launch in launches:
        groups.setdefault(getattr(getattr(launch, "kernel", None), "name", "memcpy2d"), []).append((label, launch))
    out = []
    for name, group in groups.items():
        per = replay_us(eng, group, replays, f"profile {name}") / len(group)
        out += [{"op": label, "kernel": name, "us": per} for label, _ in group]
    return out


def per_kernel(rows: list[dict]) -> list[dict]:
    """Launch rows ({kernel, us}) summed per kernel: [{kernel, us, count}], largest first."""
    agg: dict[str, dict] = {}
    for r in rows:
        a = agg.setdefault(r["kernel"], {"kernel": r["kernel"], "us": 0.0, "count": 0})
        a["us"] += r["us"]
        a["count"] += 1
    return sorted(agg.values(), key=lambda a: -a["us"])
