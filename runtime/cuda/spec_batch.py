"""Runtime stage: batched verify, DFlash speculative decoding of several sequences in one step (`BatchedVerify`, for
CudaRunner): each drafting sequence's drafter block, then one batched step whose rows are every sequence's input
token and its drafts, and each sequence's accepted run decided from its own rows.

Per step:
  1. one batched draft step (runtime/cuda/draft_batch.py) of every drafting sequence's block at pos..pos+15, each
     over its own lane's drafter context, in one launch of the drafter's program: the drafts 1..k of each land in
     `carry` on the device, from where the verify's rows take them (each block's drafts are those of its
     one-sequence draft graph, runtime/cuda/dflash.py).
  2. one batched step (DecodeSteps.launch_batch with `taps`): per sequence its input token at pos, then its k
     drafts at pos+1..pos+k (carried from `carry`), all in its own KV lane. The target runs once over every row
     (rowwise attention is causal within a sequence's rows: every row's K/V is written before any row attends),
     each row picks its token as a plain step would (argmax, or the seeded sampler at position + 1: the draws of
     plain decoding), and the drafter context of every row's position is projected from its taps. A sequence
     without drafts is one plain row of the same step (its drafter context follows it too).
  3. the host reads the tokens and the rows' inputs (the drafts) and commits, per sequence, the longest run where
     draft i equals the target's token i, plus the token after it (accepted_count, the one-sequence rule). Rows
     past the run hold K/V and drafter context of rejected tokens; the sequence's next step writes them again
     before any query reads them (as after a one-sequence step, runtime/cuda/dflash.py).
A sequence whose logits are processed (a grammar that masks its tokens, penalties, logit_bias, min_tokens before it
is met, logprobs) drafts too: its drafts are read back to the host after the draft step (one wait for all such), cut
at the first one its grammar refuses (runtime/cuda/spec_grammar.py), forced into its rows, and every one of its rows
processed as plain decoding processes that position (its own mask, the drafts before it counted as generated); its
matcher takes only the committed tokens. A lone such sequence runs here too, in a batch of one: the one-sequence
DFlash graph processes no logits. Emulated acceptance does not apply to it (its rows' masks follow its drafts).
Launch-ahead is off for these steps in this first version: the runner waits for each before the next is scheduled
(a step launched ahead would need every sequence's acceptance on the device to place its rows).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...model_spec.conventions import MAX_BATCH, VERIFY_ROWS, accepted_count
from ...model_spec.step_program import program_key
from ..backend import BackendError, SequenceFailed
from ..engine.sequence import Sequence
from .dflash import DFlashDecoder, DFlashSteps, grammar_free_run
from .draft_batch import BatchedDraft, DraftBlock
from .logits_params import RequestLogits, VerifyRow
from .programs import Forward
from .spec_grammar import masked, walk
from .steps import DecodeSteps

# The draft policy's cost model of a batched verify step, in one-row decode steps (2.14 ms), fitted to what the
# server did on an H100 (full-size synthetic checkpoint, `thorgen bench serve --prompt-len 512 --gen 256` at 1..32
# streams, 2026-12-07, tree 8347fce). A plain batched step, launched ahead of the one before, took 1.45, 1.82, 2.43
# and 3.78 one-row steps at 4, 8, 16 and 32 streams (inter-token p50 3.09, 3.89, 5.21, 8.09 ms): it grows with the
# distinct experts its rows read (`experts_read`, MOE_SHARE) and with the rows themselves (ROW_COST: attention, the
# LM head's rows and each sequence's host work), and these two fit those four within 7 %. A verify step of 32 rows
# took 4.74, 4.9 and 5.56 (10.2, 10.5 and 11.9 ms for 4, 8 and 16 drafting sequences, emulated acceptance), 1-1.8
# more than a plain step of as many rows: the one drafter launch and a step that is not launched ahead
# (VERIFY_STEP_COST), and each sequence's drafter block (DRAFT_BLOCK_COST). The model before (0.34 a one-row step's
# top-k of experts, fitted to the same kind of runs without the rows' own cost) priced the plain step at 16 streams
# at 4.2 and so let them verify one draft each: 0.89x of plain with every draft landing. This one keeps 4 and 8
# streams drafting (1.90x and 1.36x measured, 1.81x and 1.32x modelled) and 16 and 32 plain.
MOE_SHARE = 0.06
ROW_COST = 0.064
VERIFY_STEP_COST = 0.72
DRAFT_BLOCK_COST = 0.068


def batched_verify_keys() -> list[str]:
    """The step programs a batched verify runs (codegen/programs.py lowers them): batched, with the DFlash taps."""
    return [
        program_key(last=True, greedy=greedy, batched=True, taps=True, ext=ext)
        for greedy in (True, False)
        for ext in (False, True)
    ]


def experts_read(rows: int, experts: int, top_k: int) -> float:
    """The distinct experts `rows` rows read on average, each routed to `top_k` of `experts` independently."""
    return experts * (1 - (1 - top_k / experts) ** rows)


def step_cost(rows: int, experts: int, top_k: int) -> float:
    """A batched step of `rows` rows, in one-row steps: the experts past one row's top-k and the rows past one add
    their shares."""
    return 1 + MOE_SHARE * (experts_read(rows, experts, top_k) - top_k) / top_k + ROW_COST * (rows - 1)


@functools.cache  # (the runner asks it at every batched step it launches: whether the step keeps the taps)
def batched_verify_cost(drafts: int, batch: int, experts: int, top_k: int) -> float:
    """What a sequence's `drafts` drafts cost in a batched verify step of `batch` sequences, in its share of a plain
    batched step (DraftPlanner's unit: drafting pays when 1 + the drafts it accepts beat it): its share of the verify
    step's fixed cost, its drafter block, and its draft rows, against the plain step's time a sequence; infinite
    where its equal share of the step's MAX_BATCH rows cannot hold them."""
    if (drafts + 1) * batch > MAX_BATCH:
        return math.inf
    plain = step_cost(batch, experts, top_k)
    extra = VERIFY_STEP_COST / batch + DRAFT_BLOCK_COST + step_cost(batch + drafts, experts, top_k) - plain
    return 1 + extra * batch / plain


class BatchedVerify:
    """The batched verify steps of a CudaRunner: `plan` picks the sequences that draft in a step, `step` runs it."""

    def __init__(
        self, steps: DecodeSteps, dflash: DFlashSteps, decoder: DFlashDecoder, logits: RequestLogits, fwd: Forward
    ) -> None:
        self.steps, self.dflash, self.decoder, self.logits = steps, dflash, decoder, logits
        self.drafter = BatchedDraft(dflash.parts)
        self.missing = fwd.missing("speculative", *batched_verify_keys()) + self.drafter.missing()  # (empty: it runs)

    def plan(self, seqs: list[Sequence]) -> dict[str, int]:
        """Request id -> its drafts this step, for each of `seqs` that the draft policy gives drafts and that could
        take a DFlash step (DFlashDecoder.ready: its drafter context current, after a catch-up prefill where it
        needs one; logits processing is no bar here, every row may take its own). One row per sequence and every
        draft fit MAX_BATCH rows: a sequence gets at most an equal share of the rows left (the draft policy asks for
        no more, unless it is not adaptive)."""
        want = [s for s in seqs if s.drafts > 0 and self.decoder.ready(s, _lane(s), s.num_tokens - 1, rows=True)]
        want = want[: self.drafter.most]  # (the blocks a batched draft step holds)
        spare, out = MAX_BATCH - len(seqs), {}
        for i, seq in enumerate(want):
            k = min(seq.drafts, spare // (len(want) - i))
            if k > 0:
                out[seq.request_id] = k
                spare -= k
        return out

    def step(
        self, seqs: list[Sequence], drafts: dict[str, int], launched: Callable[[], None] | None
    ) -> list[tuple[list[int], int] | SequenceFailed]:
        """One batched verify step of `seqs`, `drafts` (plan's) for those that draft: per sequence its committed
        tokens and the drafts it proposed (0: a plain row), or its SequenceFailed."""
        rows: list[tuple[int, int, int, Any]] = []
        owners: list[Any] = []  # each row's logits processing: its Sequence, a VerifyRow, or None (none)
        step = _Step()
        first, forced_drafts = self._draft([s for s in seqs if drafts.get(s.request_id, 0)], drafts)
        for seq in seqs:
            lane, pos, last = _lane(seq), seq.num_tokens - 1, seq.output[-1]
            rid, sampling = seq.request_id, None if seq.sampling.greedy else seq.sampling
            k = drafts.get(rid, 0)
            step.first[rid] = r0 = len(rows)
            rows.append((lane, pos, last, sampling))
            if not k:
                owners.append(seq)
                continue
            step.proposed[rid] = k
            forced = forced_drafts.get(rid)
            if masked(seq):  # its grammar cuts the drafts; each row gets its own position's mask
                assert forced is not None
                run = walk(seq, [int(t) for t in forced], self.logits.vocab)
                forced, k = np.asarray(run.drafts, np.int32), len(run.drafts)
                step.masked.add(rid)
                owners += [VerifyRow(seq, tuple(run.drafts[:j]), m) for j, m in enumerate(run.masks)]
            else:
                owners += [None] * (1 + k)
            step.verified[rid] = k
            if forced is None:  # its drafts are in carry, where the drafter put them
                step.carried.update({r0 + 1 + j: first[rid] + j for j in range(k)})
            rows += [(lane, pos + j, 0 if forced is None else int(forced[j - 1]), sampling) for j in range(1, k + 1)]
        # (staged after the drafter, whose drafts the masks follow: a grammar that fails raises before the verify)
        ext = self.logits.stage(owners)
        launch = self.steps.launch_batch(rows, step.carried, ext=ext, taps=True)
        if launched is not None:
            launched()
        tokens = self.steps.wait(launch)
        inputs = self.steps.inputs(launch)
        out = {s.request_id: self._commit(s, step, tokens, inputs) for s in seqs}
        failed = {}
        if ext:  # the processed sequences' grammars, counts and logprobs take their committed tokens
            runs = [
                (s, step.first[s.request_id], out[s.request_id][0])
                for s in seqs
                if s.sampling.extended and (s.request_id not in step.verified or s.request_id in step.masked)
            ]
            failed = self.logits.verified(len(rows), runs)
        return [failed.get(s.request_id) or out[s.request_id] for s in seqs]

    def _draft(self, drafting: list[Sequence], drafts: dict[str, int]) -> tuple[dict[str, int], dict[str, np.ndarray]]:
        """The batched draft step of the `drafting` sequences' blocks (runtime/cuda/draft_batch.py): per request id
        the carry row of its first draft, and the drafts on the host of those whose grammar walks them (read back
        with one wait for all), or with DFlashSteps.draft_hook every one's hook drafts (the step still runs, so a
        step costs what it would)."""
        if not drafting:
            return {}, {}
        blocks = [DraftBlock(_lane(s), s.num_tokens - 1, s.output[-1], drafts[s.request_id]) for s in drafting]
        slot, first = self.drafter.launch(blocks)
        for b in blocks:  # (the blocks' drafter K/V)
            d = self.decoder.lanes[b.lane]
            d.last_written = max(d.last_written, b.pos + VERIFY_ROWS - 1)
        rids = [s.request_id for s in drafting]
        hook, forced = self.dflash.draft_hook, {}
        if hook is not None:
            for rid, b in zip(rids, blocks):
                got = np.asarray(hook(b.pos, b.last), np.int32)
                if got.shape != (VERIFY_ROWS - 1,):
                    raise BackendError(f"draft_hook returned {got.shape[0]} drafts, the block needs {VERIFY_ROWS - 1}")
                forced[rid] = got[: b.drafts]
        elif any(masked(s) for s in drafting):
            got = self.drafter.read(slot, sum(b.drafts for b in blocks))
            forced = {rid: got[at : at + b.drafts] for s, rid, b, at in zip(drafting, rids, blocks, first) if masked(s)}
        return dict(zip(rids, first)), forced

    def _commit(self, seq: Sequence, step: _Step, tokens: list[int], inputs: list[int]) -> tuple[list[int], int]:
        """`seq`'s tokens from its rows of the step (its input row, then its drafts' rows), and the drafts it
        proposed; its drafter context follows the committed positions."""
        rid, pos = seq.request_id, seq.num_tokens - 1
        r0, k, proposed = step.first[rid], step.verified.get(rid, 0), step.proposed.get(rid, 0)
        lane = self.decoder.lanes[_lane(seq)]
        room = seq.room(self.decoder.max_context)
        most = 1 + k
        target = tokens[r0 : r0 + most]
        # (emulated acceptance commits K drafts whatever they are: not where the rows' masks follow the drafts)
        emulate = None if rid in step.masked else self.dflash.emulate_acceptance
        new = target[: accepted_count(inputs[r0 + 1 : r0 + most], target, most, emulate)] if k else target[:1]
        if seq.matcher is not None and proposed and rid not in step.masked:
            new = grammar_free_run(seq, new[:room])  # (its grammar left these tokens free: Sequence.unmasked)
        # rows r0..r0+len(new)-1 held committed tokens: their drafter context is current (the rest is rewritten)
        lane.drafted(pos, pos + len(new), taps=True)
        return new[:room], min(proposed, room - 1)


@dataclass
class _Step:
    """A batched verify's bookkeeping, by request id: its first row, the drafts it proposed and those it verifies
    (after its grammar's cut), which sequences have their logits processed at every row (spec_grammar); and the
    rows whose input token is carried on the device."""

    first: dict[str, int] = field(default_factory=dict)
    proposed: dict[str, int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)
    masked: set[str] = field(default_factory=set)
    carried: dict[int, int] = field(default_factory=dict)


def _lane(seq: Sequence) -> int:
    assert seq.lane is not None, f"{seq.request_id} runs without a KV lane"
    return seq.lane


__all__ = [
    "DRAFT_BLOCK_COST",
    "MOE_SHARE",
    "ROW_COST",
    "VERIFY_STEP_COST",
    "BatchedVerify",
    "batched_verify_cost",
    "batched_verify_keys",
    "step_cost",
]
