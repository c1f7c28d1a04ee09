"""Runtime stage: `DFlashSteps`, the engine's speculative (DFlash) steps: the draft and verify graphs, launch, wait.

One step for `last` at position `start` (runtime/cuda/speculative.py describes the programs): the block is staged
(positions, sampled positions, the last token, KV lanes, the acceptance rule), the draft graph proposes 15 tokens,
an optional test hook overwrites them, the verify graph runs the target over the block and the device's acceptance
picks the next block; the drafts, the verified tokens and the accepted count are copied back into a staging slot.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ...model_spec.conventions import VERIFY_ROWS
from ..backend import BackendError
from .device import check, driver
from .graphs import CudaGraph
from .speculative import DraftForward
from .staging import ENGINE_SLOTS, Slot


class SpecLaunch(NamedTuple):
    """A DFlash step in flight: the staging slot its read-back lands in, the event after it, and its timing events
    (draft start, verify start, verify end) when the engine times steps."""

    slot: Slot
    done: Any
    timing: list | None


class DFlashSteps:
    """The DFlash steps of an engine with a drafter. The engine's hooks (draft_hook, emulate_acceptance,
    spec_timing) are read at each launch."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._landed = [engine.device.event(timing=False) for _ in range(ENGINE_SLOTS["spec_step"][1])]

    def graph(self, which: str, greedy: bool = True) -> CudaGraph:
        """The draft graph, or the verify graph (+ the drafter's context update and the acceptance) of a mode."""
        fwd, lists = self.engine.fwd, self.engine.launches
        if which == "draft":
            return lists.captured("draft", lambda: DraftForward(fwd).block_ops(), "DFlash")
        return lists.captured(f"verify_{'greedy' if greedy else 'sample'}",
                              lambda: DraftForward(fwd).verify_ops(greedy), "DFlash")

    def launch(self, start: int | None, last: int | None = None, greedy: bool = True, lane: int = 0,
               most: int = VERIFY_ROWS, emulate: int | None = None, hook_start: int | None = None) -> SpecLaunch:
        """Enqueue one DFlash step without waiting for it. `start` None: the step after the latest one enqueued,
        of the same sequence and rule, at the block that step's acceptance (draft.accept, on the device) chose
        (`hook_start`: that block's start where the host knows it, for draft_hook). Otherwise the block at `start`
        for `last` in KV lane `lane`, under the rule (at most `most` tokens a step, or exactly emulate + 1): what
        the device's acceptance then uses."""
        eng = self.engine
        cu, h, act = driver(), eng.stream.handle, eng.act
        # (forced drafts and read-back: a launched-ahead step's copies may still be queued)
        slot = eng.staging.next("spec_step")
        if start is not None:  # (the block is rewritten only when no step is in flight: the runner waits first)
            block = eng.staging.next("spec_block")
            rec = block.record
            rec["positions"] = np.arange(start, start + VERIFY_ROWS)
            rec["sampled"] = np.arange(start + 1, start + 1 + VERIFY_ROWS)
            rec["last"], rec["lanes"] = last, lane
            rec["rule"] = (most, -1 if emulate is None else emulate)
            pos = act["positions"].ptr
            check(cu.cuMemcpyHtoDAsync(pos, block.at("positions"), 4 * VERIFY_ROWS, h), "block positions")
            check(cu.cuMemcpyHtoDAsync(act["lanes"].ptr, block.at("lanes"), 4 * VERIFY_ROWS, h), "block KV lanes")
            check(cu.cuMemcpyHtoDAsync(pos + 4 * eng.max_rows, block.at("sampled"), 4 * VERIFY_ROWS, h),
                  "sampled positions")
            check(cu.cuMemcpyHtoDAsync(act["ids"].ptr, block.at("last"), 4, h), "last token")
            check(cu.cuMemcpyHtoDAsync(act["spec_rule"].ptr, block.at("rule"), 8, h), "acceptance rule")
        events = None if eng.spec_timing is None else [eng.device.event() for _ in range(3)]
        if events:
            events[0].record(eng.stream)
        self.graph("draft").replay(eng.stream)
        if events:
            events[1].record(eng.stream)
        if eng.draft_hook is not None:
            at = start if start is not None else hook_start
            if at is None:
                raise BackendError("draft_hook: a DFlash step launched ahead without a host-known block start")
            forced = np.asarray(eng.draft_hook(at, last), np.int32)
            if forced.shape != (VERIFY_ROWS - 1,):
                raise BackendError(f"draft_hook returned {forced.shape[0]} drafts, the block needs {VERIFY_ROWS - 1}")
            slot.record["forced"] = forced
            check(cu.cuMemcpyHtoDAsync(act["ids"].ptr + 4, slot.at("forced"), 4 * (VERIFY_ROWS - 1), h),
                  "forced drafts")
        self.graph("verify", greedy).replay(eng.stream)
        if events:
            events[2].record(eng.stream)
        check(cu.cuMemcpyDtoHAsync(slot.at("ids"), act["ids"].ptr, 4 * VERIFY_ROWS, h), "drafts")
        check(cu.cuMemcpyDtoHAsync(slot.at("out_ids"), act["out_ids"].ptr, 4 * VERIFY_ROWS, h), "verified tokens")
        check(cu.cuMemcpyDtoHAsync(slot.at("accepted"), act["spec_acc"].ptr, 4, h), "accepted count")
        done = self._landed[slot.turn]
        done.record(eng.stream)
        return SpecLaunch(slot, done, events)

    def wait(self, launch: SpecLaunch) -> tuple[list[int], list[int], int]:
        """A launch's (15 drafts, the target's 16 tokens for positions start+1..start+16, the device's committed
        count): waits for that step only, not for one enqueued after it."""
        launch.done.synchronize()
        if launch.timing:
            e = launch.timing
            self.engine.spec_timing.append((e[1].elapsed_ms(e[0]), e[2].elapsed_ms(e[1])))
            for ev in e:
                ev.destroy()
        rec = launch.slot.record
        return [int(t) for t in rec["ids"][1:]], [int(t) for t in rec["out_ids"]], int(rec["accepted"])

    def destroy(self) -> None:
        for ev in self._landed:
            ev.destroy()
        self._landed = []


__all__ = ["DFlashSteps", "SpecLaunch"]
