"""Runtime stage: `CudaRunner`, the engine core's ModelRunner over the CUDA Engine (runtime/cuda/backend.py opens
both). It executes what the scheduler decided and nothing else: the KV manager's instructions (page-table rows,
lane claims and copies), prefill chunks, decode steps batched over every running sequence or graphed for one,
DFlash steps (runtime/cuda/dflash.py) where the draft policy gives a sequence that decodes alone drafts, and
batched verify steps (runtime/cuda/spec_batch.py) where it gives drafts to sequences that decode together or to a
lone one whose logits are processed (a grammar's mask: the DFlash graphs process none; speculative_cost gives the
policy each one's cost). Each decode step but a batched verify is launched before the
step before it is read (`Pipeline`), so the host's work between steps runs while the GPU computes: a batched step
launches the next one for every sequence that goes on (its input token carried on the device), a one-sequence step
the next one that embeds the token it leaves in out_ids[0]. The plain one-sequence steps of a speculative sequence
keep their DFlash taps (runtime/cuda/tap_ring.py), so its catch-up before it drafts again runs no target forward."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple

from ...model_spec.conventions import VERIFY_ROWS
from ..engine.interface import PENDING, Pending
from ..engine.kv_manager import ClaimLane, CopyPrefix, KVOp, MapPages
from ..engine.sequence import Sequence
from .dflash import DFlashDecoder
from .engine import Engine
from .logits_params import RequestLogits
from .pieces import PIECE_ROW_LAYERS
from .spec_batch import BatchedVerify, batched_verify_cost
from .spec_grammar import masked

# What a DFlash step costs in plain one-sequence steps (the draft policy's model): on an H100 a sequence whose
# drafts all missed decoded at 0.48x the plain rate
SPEC_STEP_COST = 2.1

# Beside decoding sequences, a chunk of more than a piece's rows x layers of a sequence with images runs in pieces
# (chunks_in_pieces): its image span cannot be cut by position (it attends within itself), and a 1120-budget image's
# chunk runs ~60 ms whole on an H100. With EngineOptions.prefill_pieces every sequence's long chunks do (a 512-token
# prompt, 15,360 row-layers at full size, in 3): that bounds the decoders' token gaps, and costs throughput and first
# tokens under a burst of prompts, whose decodes then start a few steps apart (H100, b8e026d: 32 streams 2,732
# against 2,995 tok/s).

Row = tuple[int, int, int, Sequence]  # a batched step's row: (KV lane, position, input token, sequence)


class Ahead(NamedTuple):
    """A step launched before the step before it was read: its launch (steps.BatchLaunch, or dflash.SpecLaunch),
    its kind ("batch"; "one": a graphed one-sequence step; "spec": a DFlash step), and request id -> (its row, the
    position it runs; a DFlash step's: where the device's acceptance put its block)."""

    launch: Any
    kind: str
    rows: dict[str, tuple[int, int]]

    def covers(self, seqs: list[Sequence]) -> bool:
        """Whether it runs each of `seqs` at its next position (then it is their step)."""
        return all(self.rows.get(s.request_id, (0, -1))[1] == s.num_tokens - 1 for s in seqs)


@dataclass
class Pipeline:
    """All the runner carries from one step to the next."""

    ahead: Ahead | None = None  # the step launched before the last one's tokens were read
    on_device: tuple[str, int] | None = None  # (request, position) whose input token out_ids[0] holds
    joining: list[tuple[Sequence, int]] = field(default_factory=list)  # this step's prefills' first tokens
    params_for: str | None = None  # the request whose sampling parameters fill params[] (one-sequence steps)
    pieced: tuple[str, int] | None = None  # (request, KV lane) of the chunk engine.pieces holds part-way


class CudaRunner:
    """ModelRunner over the Engine, on up to `max_num_seqs` of its KV lanes and `kv_tokens` positions of its pages
    (default: all). `launch_ahead` off: every step is launched when scheduled (A/B measurements); `prefill_pieces`
    on: text chunks beside decodes run in pieces too (default for both: the engine's options). `batched_verify`
    off: sequences that decode together never draft (A/B measurements)."""

    def __init__(
        self,
        engine: Engine,
        max_num_seqs: int | None = None,
        launch_ahead: bool | None = None,
        kv_tokens: int | None = None,
        batched_verify: bool = True,
        prefill_pieces: bool | None = None,
    ) -> None:
        self.engine, self.steps = engine, engine.steps
        # Chunked prefill (the engine continues a prompt from any position): a whole-prompt runner would wait
        # for a step whose token budget holds its prompt, which a full batch of decodes never leaves.
        self.prefill_chunk = engine.max_rows
        self.prefill_pieces = engine.options.prefill_pieces if prefill_pieces is None else prefill_pieces
        self.max_num_seqs = min(engine.lanes, max_num_seqs or engine.lanes)
        self.max_context = engine.ctx
        self.kv_geometry = engine.kv.plan.geometry(self.max_num_seqs, kv_tokens)
        self.verify_block = VERIFY_ROWS if engine.speculative else 1
        self.launch_ahead = engine.options.launch_ahead if launch_ahead is None else launch_ahead
        # a step is launched before the one before it is read: one more position, or for a DFlash step one more
        # verify block (its start, pos + 1 .. pos + 16, is known on the device only)
        self.lookahead = 1 if self.launch_ahead else 0
        self.ahead_steps = 0  # steps that were launched ahead (by the step before) and used
        self.pipe = Pipeline()
        self.logits = RequestLogits(engine.set_logits, engine.read_logits, engine.spec.target.vocab_size)
        self.spec = DFlashDecoder(engine.dflash, engine.prefill, self.kv_geometry, self.max_context, self.max_num_seqs)
        self.batched: BatchedVerify | None = None  # batched verify steps (None: a build without their programs)
        if engine.dflash is not None:
            batched = BatchedVerify(engine.steps, engine.dflash, self.spec, self.logits, engine.fwd)
            self.batched = None if batched.missing else batched
        # (sequences that decode together draft in batched verify steps; a lone one whose logits are processed
        # drafts in one of its own, whatever this says: the one-sequence DFlash graph processes none)
        self.verify_together = batched_verify and self.max_num_seqs > 1

    @property
    def caught_up_tokens(self) -> int:
        return self.spec.caught_up_tokens

    @property
    def device_memory_used(self) -> int | None:
        return self.engine.device.last_used

    @property
    def image_rows_bytes(self) -> int:
        cache = self.engine.encoder_cache
        return 0 if cache is None else cache.bytes

    def check(self, seq: Sequence) -> None:
        self.engine.check_request(seq)

    def chunks_in_pieces(self, seq: Sequence) -> bool:
        return self.prefill_pieces or bool(seq.images)

    def media_ready(self, seq: Sequence, wait: bool, queued: Iterable[Sequence] = ()) -> bool:
        cache = self.engine.encoder_cache
        along = [s.image for q in queued for s in q.images]
        return cache is None or not seq.images or cache.ready([s.image for s in seq.images], wait, along)

    def draft_context(self, lane: int) -> int:
        return self.spec.lanes[lane].draft_upto

    def apply(self, ops: tuple[KVOp, ...]) -> None:
        for op in ops:
            if isinstance(op, MapPages):
                self.engine.map_pages(op.lane, op.first, list(op.pages))
            elif isinstance(op, ClaimLane):
                self.spec.claim(op.lane, op.keep)
            elif isinstance(op, CopyPrefix):  # (stream-ordered after any step in flight)
                self.engine.kv.copy_prefix(op.src, op.dst, op.tokens, self.engine.stream, drafter=op.drafter)
                self.spec.copied(op.src, op.dst, op.tokens, op.drafter)

    def _params(self, seq: Sequence) -> None:
        """params[] holds `seq`'s sampling parameters before a one-sequence step samples."""
        if not seq.sampling.greedy and self.pipe.params_for != seq.request_id:
            self.engine.set_sampling(seq.sampling)
            self.pipe.params_for = seq.request_id

    def prefill(
        self,
        seq: Sequence,
        start: int,
        end: int,
        sample: bool,
        launched: Callable[[], None] | None = None,
        beside: bool = False,
    ) -> int | None | Pending:
        ahead = self.pipe.ahead
        if ahead is not None and ahead.kind != "batch":  # (it decoded alone and has company now: it runs batched)
            self._settle(ahead)
        lane = _lane(seq)
        self._params(seq)
        # A scored prompt (prompt logprobs) runs its rows through Engine.score, all but a last row that samples;
        # that skips the DFlash taps, so the sequence then decodes with plain steps.
        taps = seq.speculative and seq.prompt_logprobs is None
        if seq.scores_prompt:
            scored = self.engine.score_prompt(seq, start, end)
            self.spec.lanes[lane].drafted(start, scored, taps=False)
            start = scored
            if start == end:
                self.pipe.on_device = None
                return None
        ext = sample and self.logits.stage([seq])
        images = self.engine.image_rows(seq, start, end)
        # beside decoding sequences a long chunk runs a few layers a call, the decode steps between (pieces.py)
        row_layers = (end - start) * self.engine.spec.target.num_hidden_layers
        pieced = beside and row_layers > PIECE_ROW_LAYERS and self.chunks_in_pieces(seq)
        pieced = pieced or self.engine.pieces.sampled(lane)  # (its last piece ran: only its token is left to read)
        if not pieced:  # (a chunk of its own held part-way, from steps with company, is run whole now)
            self.engine.pieces.drop(lane)
        run = self.engine.prefill_piece if pieced else self.engine.prefill
        tok = run(seq.tokens[:end], seq.sampling.greedy, taps, launched, start, lane, ext, images)
        if self.engine.pieces.lane == lane:
            self.pipe.pieced = (seq.request_id, lane)
        elif self.pipe.pieced is not None and self.pipe.pieced[0] == seq.request_id:
            self.pipe.pieced = None  # (its chunk is done, or was run whole)
        if tok is None:
            return PENDING
        if ext:
            _raise_failed(self.logits.picked([seq], [tok]))
        self.spec.lanes[lane].drafted(start, end, taps)
        # (a chunk in pieces: its token was read a call after its last piece, other steps' tokens in out_ids since)
        self.pipe.on_device = (seq.request_id, end) if sample and not pieced else None
        if sample:
            self.pipe.joining.append((seq, tok))
        return tok if sample else None

    def decode(self, seqs: list[Sequence], launched: Callable[[], None] | None = None) -> list:
        # this step's new sequences (their prefill sampled a first token the core has not committed yet)
        joining = [(s, t) for s, t in self.pipe.joining if s.num_tokens == s.num_cached]
        self.pipe.joining = []
        ahead, self.pipe.ahead = self.pipe.ahead, None
        if ahead is not None:
            if ahead.covers(seqs):
                self.ahead_steps += 1
            else:  # (its rows run again below: same inputs, same K/V, same tokens)
                self._settle(ahead)
                ahead = None
        together = len(seqs) > 1 or (ahead is not None and ahead.kind == "batch")
        alone_masked = not together and seqs[0].drafts > 0 and masked(seqs[0])
        if ahead is None and self.batched is not None and (self.verify_together if together else alone_masked):
            drafts = self.batched.plan(seqs)
            if drafts:
                return self._verify_batch(seqs, drafts, launched)
        if together:
            return self._decode_batch(seqs, ahead, joining, launched)
        return [self._decode_one(seqs[0], ahead, launched)]

    def speculative_cost(self, drafts: int, batch: int) -> float:
        # (one sequence: the draft and verify graphs run the whole block whatever the count; several: a batched
        # verify step, spec_batch's model, where this build has its programs)
        if batch == 1:
            return SPEC_STEP_COST
        if self.batched is None or not self.verify_together:
            return math.inf
        moe = self.engine.spec.target
        return batched_verify_cost(drafts, batch, moe.num_experts, moe.top_k_experts)

    def _verify_batch(self, seqs: list[Sequence], drafts: dict[str, int], launched: Callable[[], None] | None) -> list:
        """A batched verify step (spec_batch.BatchedVerify), launched now and read before the next step is launched:
        in this first version nothing is launched ahead of it."""
        assert self.batched is not None
        # (before the step: one that fails part-way, then runs again, finds neither left as it was)
        self.pipe.on_device = None  # out_ids[0] holds row 0's token
        if any(not s.sampling.greedy for s in seqs):
            self.pipe.params_for = None  # the step writes every row's parameters
        return self.batched.step(seqs, drafts, launched)

    def _decode_one(
        self, seq: Sequence, ahead: Ahead | None, launched: Callable[[], None] | None
    ) -> tuple[list[int], int]:
        """A graphed one-sequence step (DFlash when the draft policy gives it drafts and its drafter context is
        current); the next one launched before this one is read."""
        lane, pos, greedy = _lane(seq), seq.num_tokens - 1, seq.sampling.greedy
        self._params(seq)
        if (ahead is not None and ahead.kind == "spec") or (
            ahead is None and seq.drafts > 0 and self.spec.ready(seq, lane, pos)
        ):
            new, drafted, nxt = self.spec.step(
                seq, lane, pos, None if ahead is None else ahead.launch, self.launch_ahead, launched
            )
            self.pipe.on_device = None  # out_ids[0] holds a verify row
            self.pipe.ahead = None if nxt is None else Ahead(nxt[1], "spec", {seq.request_id: (0, nxt[0])})
            return new, drafted
        # (a plain step leaves the drafter context behind; a speculative sequence's keeps its taps in the tap ring,
        # which its catch-up before the next DFlash step projects: DFlashDecoder.tap_row, catch_up)
        ext, one = False, None if ahead is None else ahead.launch
        if one is None:
            staged = None if self.pipe.on_device == (seq.request_id, pos) else seq.output[-1]
            ext = self.logits.stage([seq])
            tap_row = self.spec.tap_row(seq, lane, pos, greedy, ext)
            one = self.steps.launch_one(pos, greedy, token=staged, lane=lane, ext=ext, tap_row=tap_row)
        drafts = self.spec.lanes[lane]
        drafts.drafted(pos, pos + 1, taps=False)
        nxt = None  # the next step, launched now: it decodes the token this one leaves in out_ids[0]
        # (not when the draft policy may make the next step a DFlash one, which starts from the token on the host)
        if self.launch_ahead and not (ext or seq.drafts_next) and seq.room(self.max_context) >= 2:
            tap_row = self.spec.tap_row(seq, lane, pos + 1, greedy)
            nxt = Ahead(
                self.steps.launch_one(pos + 1, greedy, lane=lane, tap_row=tap_row),
                "one",
                {seq.request_id: (0, pos + 1)},
            )
            drafts.drafted(pos + 1, pos + 2, taps=False)
        if launched is not None:
            launched()
        (new,) = self.steps.wait(one)
        if ext:
            _raise_failed(self.logits.picked([seq], [new]))
        self.pipe.ahead, self.pipe.on_device = nxt, (seq.request_id, pos + 1) if nxt is None else None
        return [new], 0

    def _decode_batch(
        self, seqs: list[Sequence], cur: Ahead | None, joining: list, launched: Callable[[], None] | None
    ) -> list:
        """A batched step (`cur`: launched ahead by the step before, else launched now); before waiting for its
        tokens, the next step is launched for every sequence that goes on and for this step's new sequences. A
        sequence that then finishes wasted its row of the next step, which wrote K/V only at its own next
        position."""
        ext = False
        if cur is None:
            ext = self.logits.stage(seqs)
            cur = self._launch([(_lane(s), s.num_tokens - 1, s.output[-1], s) for s in seqs], {}, ext)
        nxt = None if ext else self._launch_next(seqs, cur, joining)
        if launched is not None:
            launched()
        tokens = self.steps.wait(cur.launch)
        self.pipe.ahead = nxt
        new = [tokens[cur.rows[s.request_id][0]] for s in seqs]
        failed = self.logits.picked(seqs, new) if ext else {}
        return [failed.get(s.request_id) or ([t], 0) for s, t in zip(seqs, new)]

    def _launch_next(self, seqs: list[Sequence], cur: Ahead, joining: list) -> Ahead | None:
        """Launch the step after `cur`, when at least two rows go on, none needs host work between the steps
        (logits processing: its counts and grammar mask need this step's token) and none may draft in it."""
        if not self.launch_ahead or any(s.sampling.extended for s in [*seqs, *(s for s, _ in joining)]):
            return None
        if any(s.drafts_next for s in seqs):  # (the draft policy may make the next step a batched verify)
            return None
        # (room 1: this step is its last; 2 or more: it may go on, unless it stops)
        going = sorted((s for s in seqs if s.room(self.max_context) >= 2), key=lambda s: cur.rows[s.request_id][0])
        new = [(s, t) for s, t in joining if s.room(self.max_context) >= 2]
        if len(going) + len(new) < 2:
            return None
        rows: list[Row] = [(_lane(s), s.num_tokens, 0, s) for s in going]
        rows += [(_lane(s), s.num_tokens, t, s) for s, t in new]
        return self._launch(rows, {r: cur.rows[s.request_id][0] for r, s in enumerate(going)}, False)

    def _launch(self, rows: list[Row], carried: dict[int, int], ext: bool) -> Ahead:
        """Launch a batched step of `rows` (their pages are mapped: the scheduler granted every position a step
        launched ahead writes). With a speculative sequence among them (and batched verify steps on) it runs
        with the DFlash taps, as a verify step of no drafts: every row's drafter context follows its position, so
        the sequence's next verify step needs no catch-up (a tap prefill of every position it decoded plain: ~0.26
        ms a position against a ~4 ms step at 4 streams, H200). The drafter's context program over the rows reads
        ~0.15 GB of drafter weights a step, ~1-2 % of such a step (an estimate from the bytes, not yet measured).
        Not where the cost model gives no draft at this batch (speculative_cost: more than half of MAX_BATCH
        sequences, whose verify step could not hold one draft each): there the taps would be pure cost (H100, 32
        streams: 0.90x of plain with them, 0.96-0.98x without); a sequence that drafts again once the batch
        shrinks catches up first."""
        taps = (
            self.batched is not None
            and self.verify_together
            and math.isfinite(self.speculative_cost(1, len(rows)))
            and any(s.speculative for _, _, _, s in rows)
        )
        lanes = self.spec.lanes
        for lane, pos, _, _ in rows:  # (without the taps a plain step leaves the drafter context behind)
            lanes[lane].drafted(pos, pos + 1, taps)
        launch = self.steps.launch_batch(
            [(lane, pos, tok, None if s.sampling.greedy else s.sampling) for lane, pos, tok, s in rows],
            carried,
            ext=ext,
            taps=taps,
        )
        self.pipe.on_device = None  # out_ids[0] holds row 0's token
        if any(not s.sampling.greedy for _, _, _, s in rows):
            self.pipe.params_for = None  # the step wrote every row's parameters
        return Ahead(launch, "batch", {s.request_id: (r, pos) for r, (_, pos, _, s) in enumerate(rows)})

    def _settle(self, ahead: Ahead) -> None:
        """Wait for a step launched ahead that nobody reads (a one-sequence one wrote its token into out_ids[0])."""
        self.steps.settle(ahead.launch)
        self.pipe.ahead = None
        if ahead.kind != "batch":
            self.pipe.on_device = None

    def release(self, seq: Sequence, finished: bool) -> None:
        self.logits.forget(seq.request_id)
        pipe = self.pipe
        pipe.joining = [(s, t) for s, t in pipe.joining if s is not seq]
        if pipe.ahead is not None and pipe.ahead.kind != "batch" and seq.request_id in pipe.ahead.rows:
            # it ended with its next step in flight: nobody reads that step (waited for at the next call, it wrote
            # only positions past the committed ones: of its own pages, or another holder's after them in the stream)
            pipe.ahead = pipe.ahead._replace(rows={})
        if pipe.on_device is not None and pipe.on_device[0] == seq.request_id:
            pipe.on_device = None
        if pipe.pieced is not None and pipe.pieced[0] == seq.request_id:  # (preempted or ended part-way)
            self.engine.pieces.drop(pipe.pieced[1])
            pipe.pieced = None
        self.engine.device.used()  # (the device keeps the peak for bench's report)


def _lane(seq: Sequence) -> int:
    assert seq.lane is not None, f"{seq.request_id} runs without a KV lane"
    return seq.lane


def _raise_failed(failed: dict) -> None:
    """A one-sequence step's row failure, raised (the core finishes that sequence alone)."""
    for error in failed.values():
        raise error
