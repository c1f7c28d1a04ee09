"""Model-spec stage (shared bottom): the step-program format both stages use. codegen/programs.py writes programs
of these launches into the manifest, runtime/cuda/programs.py binds them (docs/step_programs.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .conventions import MAX_BATCH, VERIFY_ROWS
from .types import ModelSpec


@dataclass
class Op:
    """One launch of a step: codegen's form holds a planned kernel and symbols, the runtime's a manifest entry and
    device pointers."""

    label: str
    entry: Any
    args: dict[str, Any]
    rows: int
    branch: int = 0  # 1: may run on the engine's side stream, concurrently with the branch-0 ops that follow it
    join: bool = False  # waits for the side stream's ops before it (reads what they wrote)
    rowwise: bool = False  # attention: one query per block (a batched decode step)
    pdl: bool = True  # may launch as a programmatic dependent of the launch before it on its stream (runtime/engine)


# One program per kind of forward, keyed by its flags, each for ranges of row counts. Flags that change nothing are
# folded, so that codegen and the runtime name a kind alike.
# `images` (a prefill chunk holding image spans: the sliding layers' attention takes per-query key bounds) is named
# only when set, so the text-only kinds keep their keys.
def program_key(
    decode: bool = False,
    last: bool = True,
    greedy: bool = True,
    taps: bool = False,
    all_logits: bool = False,
    batched: bool = False,
    ext: bool = False,
    score: bool = False,
    images: bool = False,
) -> str:
    if not last or score:  # no token is picked: how it would be is moot
        greedy, ext = True, False
    flags = dict(
        decode=decode, last=last, greedy=greedy, taps=taps, all_logits=all_logits, batched=batched, ext=ext, score=score
    )
    key = " ".join(f"{k}={int(bool(v))}" for k, v in flags.items())
    return key + " images=1" if images else key


# the drafter's programs (runtime/cuda/dflash.py): the draft block, the context update of a prefill's positions
DRAFT_BLOCK, DRAFT_CONTEXT = "draft.block", "draft.context"
# a batched verify's drafter (runtime/cuda/spec_batch.py): the blocks of several sequences through the drafter's
# layers at once (rows: 16 a block), then the head of the draft rows the verify takes, gathered (rows: drafts)
DRAFT_BATCH, DRAFT_HEAD = "draft.batch", "draft.head"


def draft_batch_blocks(max_rows: int) -> int:
    """The most sequences' blocks one batched draft step holds: every drafting sequence of a batched verify (each
    takes at least two of its MAX_BATCH rows), within a step's rows."""
    return max(1, min(MAX_BATCH // 2, max_rows // VERIFY_ROWS))


def verify_key(greedy: bool = True) -> str:
    """The DFlash verify step's program: the target's 16-row forward, the drafter's context update beside its head,
    and the acceptance on the device (codegen/lower_draft.py LowerDraft.verify_ops)."""
    return f"draft.verify greedy={int(bool(greedy))}"


def drafter_problem(spec: ModelSpec) -> str | None:
    """Why the DFlash steps cannot be built or run for `spec` (None: they can)."""
    if spec.drafter is None:
        return f"model {spec.name} has no DFlash drafter"
    if spec.drafter.block_size != VERIFY_ROWS:
        return f"drafter block_size {spec.drafter.block_size}: the verify step is built for {VERIFY_ROWS}"
    return None
