"""Runtime stage: DFlash speculative decoding on the CUDA engine: the drafter's programs (DraftForward; its buffers
are planned in runtime/cuda/buffers.py), its steps on the device (DFlashSteps: the draft and verify graphs, launch,
wait) and the stepping of a speculative sequence for CudaRunner (DFlashDecoder: launch-ahead, the drafter context of
each lane, catch-up).

Per step (MODEL_FACTS §3.3), with `last` the newest token at position `start` (not yet in any cache):
  1. draft graph: block embedding of [last, mask x15] (x embed scale) at positions start..start+15, the drafter
     layers (Qwen3, hybrid mask: sliding layers causal within the block, the full layer bidirectional) over the
     persistent drafter KV cache (context K/V of every committed position) plus the block's own K/V, final norm,
     the shared NVFP4 lm_head + argmax of slots 1..15 straight into ids[1..15] (ids[0] = last, staged by the host);
  2. verify graph: the target forward over ids[0..15] at start..start+15 (the M=16 kernels) with every row's
     token into out_ids[0..15] (argmax, or the seeded sampler at absolute position start+1+i) and the DFlash taps
     of all 16 rows, then the context update of the same 16 positions: fc(taps) -> hidden_norm -> per drafter layer
     k/v projections -> k_norm + RoPE -> drafter cache.
  3. the host reads the 15 drafts and the 16 target tokens (the only device->host traffic), acc = longest prefix
     with d_i == target_i-1, commits target_0..target_acc. The verify graph ends with the same rule on the device
     (draft.accept: the count into spec_acc, the next block's positions and ids[0]), so the runner can enqueue the
     next step before it reads this one (CudaRunner.decode), and the GPU never waits for the host between steps.
Rollback needs no work: the target rows and the drafter context rows beyond the committed length hold K/V of
rejected tokens at positions start+acc+1..start+15, and the next step (block at start+acc+1..start+acc+16)
writes every one of them again (its block K/V, then its verify K/V and context rows) before any query reads them;
rings have window + 512 >= window + 16 slots, so a block never overwrites a key its own queries still need.
Both graphs have fixed shapes (16 rows): only positions (host -> device) and ids[0] change between steps. They
process no logits: a sequence whose grammar masks its tokens (or that has penalties, bias or logprobs) drafts in
batched verify steps instead (runtime/cuda/spec_batch.py, a batch of one when it decodes alone).
Plain steps leave the drafter context behind; before a sequence drafts again (a probe of the draft policy, or
after steps with company) `DFlashDecoder.catch_up` brings it over the positions they decoded. Where the sequence
decoded them alone its plain one-row steps kept their taps in the tap ring (runtime/cuda/tap_ring.py), and the
catch-up only projects them (the drafter's context program); otherwise it runs a tap prefill of those positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from ...model_spec.conventions import (
    VERIFY_ROWS,
    accepted_count,
)  # DFlashSpec.block_size must match VERIFY_ROWS
from ...model_spec.step_program import (
    DRAFT_BATCH,
    DRAFT_BLOCK,
    DRAFT_CONTEXT,
    DRAFT_HEAD,
    drafter_problem,
    program_key,
    verify_key,
)
from ..backend import BackendError
from .device import check, driver
from .graphs import CudaGraph
from .programs import Forward, Op
from .staging import ENGINE_SLOTS, Slot
from ..engine.kv_manager import KVGeometry
from .steps import StepParts
from .tap_ring import TapRingSteps


class DraftForward:
    """The drafter's step programs (codegen/lower_draft.py lowers them), bound like the target's."""

    def __init__(self, fwd: Forward) -> None:
        self.fwd, self.spec = fwd, fwd.spec
        problem = drafter_problem(self.spec)
        if problem:
            raise BackendError(problem)

    def block_ops(self) -> list[Op]:
        """The 16-slot block at positions[0..16) -> drafts of slots 1..15 into ids[1..15] (ids[0] = last token)."""
        return self.fwd.program(DRAFT_BLOCK, VERIFY_ROWS)

    def ctx_ops(self, rows: int) -> list[Op]:
        """Context K/V of `rows` positions (positions[0..rows)) from the taps rows 0..rows-1 into the drafter cache."""
        return self.fwd.program(DRAFT_CONTEXT, rows)

    def batch_ops(self, blocks: int) -> list[Op]:
        """A batched draft step of `blocks` blocks (block b: positions[16 b ..], lanes[16 b], ids[16 b] its last
        token) -> the final norm's rows in da (LowerDraft.batch_ops)."""
        return self.fwd.program(DRAFT_BATCH, blocks * VERIFY_ROWS)

    def head_ops(self, rows: int) -> list[Op]:
        """The drafts of dhead's first `rows` rows into carry[0..rows) (LowerDraft.head_ops)."""
        return self.fwd.program(DRAFT_HEAD, rows)

    def verify_ops(self, greedy: bool = True) -> list[Op]:
        """The verify step: target forward (taps), drafter context update beside its head, acceptance (LowerDraft)."""
        return self.fwd.program(verify_key(greedy), VERIFY_ROWS)

    def probe(self) -> list[str]:
        """What the speculative path lacks (empty: it can run)."""
        return self.fwd.missing(
            "speculative",
            verify_key(True),
            verify_key(False),
            program_key(last=True, taps=True),
            DRAFT_BLOCK,
            DRAFT_CONTEXT,
        )


class SpecLaunch(NamedTuple):
    """A DFlash step in flight: the staging slot its read-back lands in, the event after it, and its timing events
    (draft start, verify start, verify end) when the engine times steps."""

    slot: Slot
    done: Any
    timing: list | None


class DFlashSteps:
    """The DFlash steps of an engine with a drafter, over the engine's step parts. Test and bench hooks, read at
    each launch: `draft_hook` (callable(start, last_token) -> 15 drafts that replace the drafter's, written into
    ids[1..15] between the draft and the verify graphs, so tests can force long acceptances and rollbacks),
    `emulate_acceptance` (K: every step commits K drafts + 1, `thorgen bench --emulate-acceptance`), `timing` (a
    list: each step appends its (draft ms, verify ms))."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.ring = TapRingSteps(parts)  # (the taps a lone sequence's plain steps keep, for its catch-up)
        self._landed = [parts.device.event(timing=False) for _ in range(ENGINE_SLOTS["spec_step"][1])]
        self.draft_hook: Callable[[int, int], Any] | None = None
        self.emulate_acceptance: int | None = None
        self.timing: list | None = None

    def graph(self, which: str, greedy: bool = True) -> CudaGraph:
        """The draft graph, or the verify graph (+ the drafter's context update and the acceptance) of a mode."""
        fwd, lists = self.parts.fwd, self.parts.launches
        if which == "draft":
            return lists.captured("draft", lambda: DraftForward(fwd).block_ops(), "DFlash")
        return lists.captured(
            f"verify_{'greedy' if greedy else 'sample'}", lambda: DraftForward(fwd).verify_ops(greedy), "DFlash"
        )

    def launch(
        self,
        start: int | None,
        last: int | None = None,
        greedy: bool = True,
        lane: int = 0,
        most: int = VERIFY_ROWS,
        emulate: int | None = None,
        hook_start: int | None = None,
    ) -> SpecLaunch:
        """Enqueue one DFlash step without waiting for it. `start` None: the step after the latest one enqueued,
        of the same sequence and rule, at the block that step's acceptance (draft.accept, on the device) chose
        (`hook_start`: that block's start where the host knows it, for draft_hook). Otherwise the block at `start`
        for `last` in KV lane `lane`, under the rule (at most `most` tokens a step, or exactly emulate + 1): what
        the device's acceptance then uses."""
        eng = self.parts
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
            check(
                cu.cuMemcpyHtoDAsync(pos + 4 * eng.max_rows, block.at("sampled"), 4 * VERIFY_ROWS, h),
                "sampled positions",
            )
            check(cu.cuMemcpyHtoDAsync(act["ids"].ptr, block.at("last"), 4, h), "last token")
            check(cu.cuMemcpyHtoDAsync(act["spec_rule"].ptr, block.at("rule"), 8, h), "acceptance rule")
        events = None if self.timing is None else [eng.device.event() for _ in range(3)]
        if events:
            events[0].record(eng.stream)
        self.graph("draft").replay(eng.stream)
        if events:
            events[1].record(eng.stream)
        if self.draft_hook is not None:
            at = start if start is not None else hook_start
            if at is None:
                raise BackendError("draft_hook: a DFlash step launched ahead without a host-known block start")
            forced = np.asarray(self.draft_hook(at, last), np.int32)
            if forced.shape != (VERIFY_ROWS - 1,):
                raise BackendError(f"draft_hook returned {forced.shape[0]} drafts, the block needs {VERIFY_ROWS - 1}")
            slot.record["forced"] = forced
            check(
                cu.cuMemcpyHtoDAsync(act["ids"].ptr + 4, slot.at("forced"), 4 * (VERIFY_ROWS - 1), h), "forced drafts"
            )
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
            if self.timing is not None:
                self.timing.append((e[1].elapsed_ms(e[0]), e[2].elapsed_ms(e[1])))
            for ev in e:
                ev.destroy()
        rec = launch.slot.record
        return [int(t) for t in rec["ids"][1:]], [int(t) for t in rec["out_ids"]], int(rec["accepted"])

    def destroy(self) -> None:
        for ev in self._landed:
            ev.destroy()
        self._landed = []


# a speculative sequence left behind by plain steps catches up when it may still decode a 16th of the positions
CATCH_UP_RATIO = 16


def grammar_free_run(seq, tokens: list[int]) -> list[int]:
    """The leading `tokens` its grammar leaves free, fed to it: a verify row after the token that opens the grammar
    (a tool call's trigger) was sampled without the mask it needs, so the step ends after that token."""
    kept: list[int] = []
    for token in tokens:
        if not seq.matcher.free:
            break
        seq.matcher.accept(token)
        kept.append(token)
    return kept


@dataclass(slots=True)  # (slots: `drafted` runs for every row of every batched step)
class DraftLane:
    """What a KV lane's drafter context holds: positions 0..draft_upto-1 (of the tokens its K/V holds), and the
    highest position written in the lane since (its rings keep a position until one `slots` later is written)."""

    draft_upto: int = 0
    last_written: int = -1
    most: int = VERIFY_ROWS  # the acceptance rule's most tokens a step, of the lane's latest DFlash launch

    def drafted(self, start: int, end: int, taps: bool) -> None:
        """Positions start..end-1 were written: with the DFlash taps the drafter context follows them (when it
        held every earlier position); without, it holds positions before `start` only."""
        # (min and max spelled out, and slots: with their calls 32 rows took ~13 us of a step's host time, ~3 us so)
        upto = self.draft_upto
        self.draft_upto = end if taps and upto >= start else (upto if upto < start else start)
        if end > self.last_written:
            self.last_written = end - 1


class DFlashDecoder:
    """DFlash steps for CudaRunner. Each lane holds its own sequence's drafter context (runtime/cuda/kv_cache.py)
    and `lanes[i].draft_upto` says how far it is current; a plain or batched step leaves it behind, and before the
    sequence drafts again `catch_up` brings it over the positions it missed, from the taps its plain steps kept
    (`tap_row`: the tap ring) or with one tap prefill, when its cost is small beside the tokens still to come."""

    def __init__(
        self, steps: DFlashSteps | None, prefill: Callable[..., int], geometry: KVGeometry, max_context: int, lanes: int
    ) -> None:
        """`steps`: the engine's DFlash steps (None without a drafter: no sequence is then speculative);
        `prefill`: Engine.prefill (the catch-up's tap prefill); `geometry`: the KV cache's (its rings)."""
        self.steps, self.prefill, self.geometry, self.max_context = steps, prefill, geometry, max_context
        self.lanes = [DraftLane() for _ in range(lanes)]
        self.caught_up_tokens = 0  # positions whose drafter context a catch-up prefill restored

    def claim(self, lane: int, keep: int) -> None:
        """Lane `lane` holds a new sequence whose first `keep` positions are what the lane held."""
        d = self.lanes[lane]
        d.draft_upto, d.last_written = min(d.draft_upto, keep), -1
        self._drop_taps(lane)

    def copied(self, src: int, dst: int, tokens: int, drafter: bool) -> None:
        """Lane `dst` got lane `src`'s K/V of positions [0, tokens) (its drafter context too with `drafter`)."""
        s, d = self.lanes[src], self.lanes[dst]
        d.draft_upto, d.last_written = (min(s.draft_upto, tokens) if drafter else 0), s.last_written
        self._drop_taps(dst)

    def _drop_taps(self, lane: int) -> None:
        """What the tap ring holds of `lane` is stale: the lane holds another sequence, or positions a copy wrote."""
        if self.steps is not None:
            self.steps.ring.book.drop(lane)

    def tap_row(self, seq, lane: int, pos: int, greedy: bool, ext: bool = False) -> int | None:
        """The tap ring row where the plain one-row step of `seq` (in `lane`, decoding alone) at `pos` keeps its
        DFlash taps, recorded as the ring's newest (DecodeSteps.launch_one copies them there); None where it keeps
        none: no drafter, a request that proposes no drafts, or a build without the one-row programs with taps."""
        ring = None if self.steps is None else self.steps.ring
        if ring is None or not seq.speculative or seq.sampling.draft_tokens == 0 or not ring.keeps(greedy, ext):
            return None
        return ring.book.record(lane, pos)

    def ready(self, seq, lane: int, pos: int, rows: bool = False) -> bool:
        """Whether `seq` (in `lane`) takes a DFlash step at `pos`: it is speculative, a verify block fits the
        context, the drafter context covers positions 0..pos-1 (at once or after `catch_up`), and its next token
        takes no logits processing (the one-sequence verify graph applies none: a grammar only while it leaves the
        tokens free, Sequence.unmasked) unless `rows`: a batched verify, which processes each row's logits."""
        return (
            seq.speculative
            and pos + VERIFY_ROWS <= self.max_context
            and (rows or not seq.sampling.extended or seq.unmasked())
            and self.catch_up(seq, lane, pos)
        )

    def catch_up(self, seq, lane: int, pos: int) -> bool:
        """Whether the lane's drafter context covers positions 0..pos-1, so that a speculative step can run: at
        once, or after a catch-up over the positions that plain and batched steps left it behind by. That runs
        when its cost is small beside the tokens the sequence may still decode (a prefill position costs about a
        16th of what a speculative step saves a token: H200, 0.04 vs ~1 ms) and the lane's rings still hold the
        keys before them (else the sequence goes on with plain steps). (The rule prices a tap prefill; the
        projection below costs less and runs under the same rule.)
        Where the tap ring holds every one of those positions of this lane (the sequence decoded them alone with
        plain one-row steps, which kept their taps: `tap_row`), the catch-up only projects them into the drafter
        context (TapRingSteps.project: the drafter's context program, no target forward). The tap prefill it ran
        before cost ~11 % of the plain steps' time between probes (~0.26 ms a position against a 2.1 ms step).
        Otherwise (steps with company, a gap, a ring another lane took since) it runs one tap prefill of them:
        that writes the target's K/V of those positions again (the values a prompt's prefill gives) and never
        touches a page shared with another sequence: the positions were decoded, so their pages are the
        sequence's own until it finishes. (out_ids[0] then holds the prefill's token, which the sequence already
        has.) Either way its row count differs from one catch-up to the next, so it runs the launch list its
        program's row range keeps, set for that count in place (LaunchLists.eager_rows), not one bound afresh
        (~400 launches of host work at full size for the prefill)."""
        d = self.lanes[lane]
        missing = pos - d.draft_upto
        if missing <= 0:
            return True
        if (
            missing > CATCH_UP_RATIO * seq.room(self.max_context)
            or d.draft_upto == 0
            or not self.geometry.prefix_intact(d.draft_upto, d.last_written)
        ):
            return False
        if any(s.offset < pos and s.end > d.draft_upto for s in seq.images):
            return False  # (a prompt's images run in its own tap prefill; decoded positions hold none)
        ring = None if self.steps is None else self.steps.ring
        if ring is not None and ring.book.holds(lane, d.draft_upto, pos):
            ring.project(lane, d.draft_upto, pos)
        else:
            self.prefill(seq.tokens[:pos], seq.sampling.greedy, taps=True, begin=d.draft_upto, lane=lane)
        d.drafted(d.draft_upto, pos, taps=True)
        self.caught_up_tokens += missing
        return True

    def step(
        self, seq, lane: int, pos: int, cur: SpecLaunch | None, launch_ahead: bool, launched=None
    ) -> tuple[list[int], int, tuple[int, SpecLaunch] | None]:
        """A DFlash step of `seq` at `pos` with `seq.drafts` drafts (`cur`: launched ahead by the step before, at
        that step's count, else launched now): its committed tokens, the drafts it could accept, and (position,
        launch) of the next step when `launch_ahead` launched it before this one's tokens were read, at the block
        the device's acceptance picks (draft.accept), unless the draft policy may make the next step a plain one,
        this step surely ends the request or that block may not fit the context (the scheduler granted the pages
        of both blocks). out_ids[0] then holds a verify row."""
        room, greedy = seq.room(self.max_context), seq.sampling.greedy
        dflash = self.steps
        assert dflash is not None, "a DFlash step without a drafter"
        k = dflash.emulate_acceptance
        d = self.lanes[lane]
        if cur is None:
            d.most = 1 + seq.drafts
            cur = dflash.launch(pos, seq.output[-1], greedy, lane=lane, most=d.most, emulate=k)
        most = d.most  # (a step launched ahead runs the rule of the launch before it: the device keeps it)
        d.last_written = max(d.last_written, pos + VERIFY_ROWS - 1)
        nxt = None
        # (a draft_hook needs the block's start on the host: known ahead only under emulated acceptance, the bench's)
        hook_start = None if k is None else pos + accepted_count([], [0] * VERIFY_ROWS, most, k)  # (needs no tokens)
        if (
            launch_ahead
            and seq.drafts_next > 0
            and not seq.sampling.extended  # (its grammar may take over at this step's tokens: the host decides)
            and (dflash.draft_hook is None or hook_start is not None)
            and room >= 2
            and pos + 2 * VERIFY_ROWS <= self.max_context
        ):
            nxt = dflash.launch(None, greedy=greedy, hook_start=hook_start)  # (its block: pos + 1 .. pos + 16)
            d.last_written = max(d.last_written, pos + 2 * VERIFY_ROWS - 1)
        if launched is not None:
            launched()
        drafts, target, accepted = dflash.wait(cur)
        # (k: bench --emulate-acceptance commits K drafts + 1 whatever the drafter said; the request may cap drafts)
        new = target[: accepted_count(drafts, target, most, k)]
        if seq.matcher is not None:
            new = grammar_free_run(seq, new[:room])
        # rows 0..len(new)-1 held committed tokens: their drafter context is current (the rest is rewritten)
        d.drafted(pos, pos + len(new), taps=True)
        # (the device's count equals len(new) unless a kernel is wrong: then the next step finds no match and waits)
        return new[:room], min(most, room) - 1, None if nxt is None else (pos + accepted, nxt)


__all__ = [
    "DFlashDecoder",
    "DFlashSteps",
    "DraftForward",
    "DraftLane",
    "SpecLaunch",
]
