"""Runtime stage: `CudaRunner`, the engine core's ModelRunner over the CUDA Engine (runtime/cuda/backend.py opens
both): KV lanes and pages per sequence, batched and one-sequence steps launched ahead, DFlash steps, logits
processing and the prefix cache."""

from __future__ import annotations

from typing import Any, NamedTuple

from ...model_spec.conventions import KV_PAGE
from ..backend import BackendError, check_image_spans, span_floor
from .buffers import MAX_LOGIT_BIAS
from .dflash import SpecLaunch
from .engine import Engine
from .kv_pages import Lane, PagePool
from .logits_params import RequestLogits
from .spec_decode import SpecDecoder
from ...model_spec.conventions import VERIFY_ROWS
from .steps import BatchLaunch


class _Launched(NamedTuple):
    """A batched step launched on the device: request id -> (its row, the position it runs)."""

    launch: BatchLaunch
    rows: dict[str, tuple[int, int]]

    def covers(self, seqs: list) -> bool:
        """Whether it runs each of `seqs` at its next position (then it is their step)."""
        return all(self.rows.get(s.request_id, (0, -1))[1] == s.num_tokens - 1 for s in seqs)


class _OneAhead(NamedTuple):
    """A one-sequence step launched before the step before it was read: its request, the position it runs (a
    DFlash step's: where the device's acceptance put its block), its launch (BatchLaunch: plain; SpecLaunch)."""

    request_id: str | None  # (None: its sequence ended)
    position: int
    launch: Any


class CudaRunner:
    """ModelRunner over the Engine: one KV lane per running sequence, chunked prefill interleaved with decode
    steps batched over every running sequence (DecodeSteps.launch_batch, each launched one step ahead: _decode_batch),
    or a graphed one-sequence step when one runs. A plain one-sequence step decodes the token the previous step left
    in out_ids[0] when it follows a step of the same sequence; otherwise the input token is staged (4 bytes). So
    each one-sequence step is launched before the step before it is read (decode; SpecDecoder.step: a DFlash step at
    the block the device's acceptance picks), and the GPU does not wait for the host between steps.

    Prefix cache: the paged (full-attention) layers' pages are shared by content (runtime/cuda/kv_pages.py: full pages
    registered under the hash of their tokens, LRU-evicted); the per-lane rings of the sliding layers keep the K/V
    of the last sequence that finished in the lane. So a request starting with a cached prefix (a chat's next
    turn, a shared system prompt) prefills only the rest, as far as its pages are cached and a lane's rings still
    hold what the new positions need (KVPlan.prefix_intact), in whole pages. Admission picks the free lane with
    the longest usable prefix, else the one freed longest ago.

    Speculative steps (runtime/cuda/spec_decode.py) run while a speculative sequence decodes alone (batched steps
    are plain: above one sequence they are faster, docs/BENCHMARKS.md). A speculative request reuses a cached
    prefix as far as the drafter context of the lane it comes from covers it (its output is the same either way)."""

    def __init__(self, engine: Engine, max_num_seqs: int | None = None, launch_ahead: bool | None = None) -> None:
        self.engine, self.steps = engine, engine.steps
        # Chunked prefill (the engine continues a prompt from any position): a whole-prompt runner would wait
        # for a step whose token budget holds its prompt, which a full batch of decodes never leaves.
        self.prefill_chunk = self.engine.max_rows
        lanes = self.engine.lanes
        self.max_num_seqs = min(lanes, max_num_seqs or lanes)
        self.max_context = engine.ctx
        plan = self.engine.kv.plan
        # the paged layers' pool (the scheduler's block budget: it charges every page a sequence may hold)
        self.pool = PagePool(plan.pages) if plan.pages else None
        self.kv_tokens = plan.pages * KV_PAGE if self.pool else self.max_num_seqs * self.max_context
        self.verify_block = VERIFY_ROWS if self.engine.speculative else 1
        # a step is launched before the one before it is read (_decode_batch, decode): one more position, or for a
        # DFlash step one more verify block (its start, pos + 1 .. pos + 16, is known on the device only)
        self.lookahead = self.verify_block
        self._lanes = [Lane() for _ in range(self.max_num_seqs)]
        self._lane_of: dict[str, int] = {}
        self._on_device: tuple[str, int] | None = None  # (request, position) whose input token is in out_ids[0]
        self._params_for: str | None = None  # the request whose SampleParams fill params[] (one-sequence steps)
        self._ahead: _Launched | None = None  # the batched step launched before the last one's tokens were read
        self._one: _OneAhead | None = None  # the same for a one-sequence step (plain or DFlash)
        # (off: every step is launched when scheduled, for A/B measurements; default: the engine's options)
        self.launch_ahead = engine.options.launch_ahead if launch_ahead is None else launch_ahead
        self.ahead_steps = 0  # steps that were launched ahead (by the step before) and used
        self._joining: list[tuple[Any, int]] = []  # (sequence, first token) of this step's sampling prefills
        self._released = 0
        self.logits = RequestLogits(engine, engine.spec.target.vocab_size)
        self.copied_prefix_tokens = 0  # prefix-cache hits served by copying another lane's K/V
        self.spec = SpecDecoder(engine, self._grow, self.max_context)

    @property
    def caught_up_tokens(self) -> int:
        """Positions whose drafter context a catch-up prefill restored."""
        return self.spec.caught_up_tokens

    def check(self, seq) -> None:
        if seq.speculative and not self.engine.speculative:
            raise BackendError("cuda backend: speculative (DFlash) decoding is unavailable: "
                               + "; ".join(self.engine.spec_missing) + "; use --no-speculative")
        if seq.sampling.extended or seq.sampling.prompt_logprobs is not None:
            if self.engine.ext_missing:
                raise BackendError(f"{seq.sampling.describe_extended()} needs kernels this build lacks ("
                                   + "; ".join(self.engine.ext_missing) + "); rebuild with `thorgen build`")
            if len(seq.sampling.logit_bias) > MAX_LOGIT_BIAS:
                raise BackendError(f"logit_bias has {len(seq.sampling.logit_bias)} entries; at most "
                                   f"{MAX_LOGIT_BIAS}")
        if seq.images:
            if self.engine.vision is None:
                raise BackendError("cuda backend: images need the vision tower on the device: "
                                   + "; ".join(self.engine.vision_missing))
            if seq.sampling.prompt_logprobs is not None:
                raise BackendError("cuda backend: prompt logprobs of a prompt with images are not supported")
            for span in seq.images:
                self.engine.vision.check(span.image)
            if max(s.end - s.offset for s in seq.images) > self.prefill_chunk:
                raise BackendError(f"cuda backend: an image of more than {self.prefill_chunk} soft tokens does "
                                   "not fit one prefill chunk")
            # the placeholders and the images must agree (a prompt without images keeps its ids as text, as before)
            check_image_spans(seq.prompt, seq.images, self.engine.spec.vision.image_token_id)
        seq.prepare(self.engine.spec.target.vocab_size)

    @staticmethod
    def _keys(seq, upto: int | None = None) -> list[int]:
        """The ids that key the prefix cache (image placeholders by image: Sequence.prompt_keys), first `upto`."""
        keys = seq.prompt_keys + seq.output if seq.images else seq.tokens
        return keys if upto is None else keys[:upto]

    def admit(self, seq, limit: int) -> int:
        want = self._keys(seq, seq.prefill_target)
        intact = self.engine.kv.plan.prefix_intact
        # the paged layers serve whole cached pages, wherever they are
        shared = self.pool.matched(want, limit) if self.pool else None
        cap = limit if shared is None else len(shared) * KV_PAGE

        def usable(lane: Lane) -> int:
            """How many of `want`'s leading tokens the lane's rings can serve (a running lane: its sequence's)
            along with the cached pages."""
            have = lane.cached if lane.owner is None else self._keys(lane.seq, lane.seq.num_cached)
            n = 0
            while n < min(len(have), len(want), cap) and have[n] == want[n]:
                n += 1
            if seq.speculative:  # (the drafter context must cover the reused positions too)
                n = min(n, lane.draft_upto)
            while True:  # whole pages, and never a part of an image (its span runs whole)
                m = span_floor(n - n % KV_PAGE if shared is not None else n, seq.images)
                if m == n:
                    break
                n = m
            return n if n and intact(n, lane.last_written) else 0
        best, best_n, source, source_n = None, -1, None, 0
        for i, lane in enumerate(self._lanes):
            n = usable(lane)
            if lane.owner is not None:  # running: a source to copy from, never the sequence's own lane
                if n > source_n:
                    source, source_n = i, n
                continue
            if n > source_n:
                source, source_n = i, n
            if n > best_n or (n == best_n and lane.freed_at < self._lanes[best].freed_at):
                best, best_n = i, n
        if best is None:
            raise BackendError("cuda backend: no free KV lane (the scheduler admitted more sequences than "
                               f"--max-num-seqs {self.max_num_seqs})")
        lane, written = self._lanes[best], -1  # (-1: nothing written over its cached K/V since)
        drafted = min(lane.draft_upto, best_n)
        if source_n > best_n:
            # Another lane (running, or free but not chosen) holds a longer prefix, e.g. a shared system prompt or
            # a sibling choice of an n > 1 request: copy its K/V here instead of prefilling it again (a speculative
            # request's drafter context too). The rings come as they are, with whatever the source wrote past the
            # prefix since.
            src = self._lanes[source]
            self.engine.kv.copy_prefix(source, best, source_n, self.engine.stream, drafter=seq.speculative)
            best_n, written = source_n, src.last_written
            drafted = min(src.draft_upto, source_n) if seq.speculative else 0
            self.copied_prefix_tokens += source_n
        lane.owner, lane.seq, lane.cached, lane.last_written = seq.request_id, seq, [], written
        lane.draft_upto = drafted
        if shared is not None and best_n > 0:
            lane.pages.share(self.pool, shared[:best_n // KV_PAGE])
            self.engine.map_pages(best, 0, lane.pages.pages)
        self._lane_of[seq.request_id] = best
        return best_n

    def _grow(self, i: int, end: int) -> None:
        """Pages for positions 0..end-1 of lane i's sequence (the scheduler charged them), mapped before use."""
        if self.pool is not None:
            first, new = self._lanes[i].pages.grow(self.pool, end)
            self.engine.map_pages(i, first, new)

    def _params(self, seq) -> None:
        """params[] holds `seq`'s sampling parameters before a one-sequence step samples."""
        if not seq.sampling.greedy and self._params_for != seq.request_id:
            self.engine.set_sampling(seq.sampling)
            self._params_for = seq.request_id

    def prefill(self, seq, start: int, end: int, sample: bool, launched=None) -> int | None:
        if self._one is not None:  # (a sequence that decoded alone has company now: its next step runs batched)
            self._settle(self._one)
            self._one = None
        i = self._lane_of[seq.request_id]
        lane = self._lanes[i]
        self._params(seq)
        # A scored prompt (prompt logprobs) runs its rows through Engine.score, all but a last row that samples;
        # that skips the DFlash taps, so the sequence then decodes with plain steps.
        taps = seq.speculative and seq.prompt_logprobs is None
        self._grow(i, end)
        if seq.scores_prompt:
            scored = seq.scored_upto(start, end) - 1  # rows start..scored-1 predict prompt tokens
            if scored > start:
                seq.prompt_logprobs += self.engine.score(seq.tokens, start, scored, seq.sampling.prompt_logprobs, i)
                lane.last_written = max(lane.last_written, scored - 1)
                lane.drafted(start, scored, taps=False)
                start = scored
            if start == end:
                self._on_device = None
                return None
        ext = sample and self.logits.stage([seq])
        images = [(s.offset, self.engine.encoder_cache.rows(s.image)) for s in seq.images
                  if s.offset < end and s.end > start]
        tok = self.engine.prefill(seq.tokens[:end], seq.sampling.greedy, taps=taps, launched=launched,
                                  begin=start, lane=i, ext=ext, images=images)  # (start < end: the core skips a
        # cached chunk)
        if ext:
            self._raise_failed(self.logits.picked([seq], [tok]))
        lane.drafted(start, end, taps)
        lane.last_written = max(lane.last_written, end - 1)
        if self.pool is not None:  # the prompt's full pages are final: other requests may share them now
            lane.pages.register(self.pool, self._keys(seq), end)
        self._on_device = (seq.request_id, end) if sample else None
        if sample:
            self._joining.append((seq, tok))
        return tok if sample else None

    def decode(self, seqs: list, launched=None) -> list:
        # this step's new sequences (their prefill sampled a first token the core has not committed yet)
        joining = [(s, t) for s, t in self._joining if s.num_tokens == s.num_cached]
        self._joining = []
        one = self._take_one(seqs)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not ahead.covers(seqs):
            self.steps.settle(ahead.launch)  # (its rows run again below: same inputs, same K/V, same tokens)
            ahead = None
        if len(seqs) > 1 or ahead is not None:
            return self._decode_batch(seqs, ahead, joining, launched)
        (seq,) = seqs
        i = self._lane_of[seq.request_id]
        pos, greedy = seq.num_tokens - 1, seq.sampling.greedy
        self._params(seq)
        lane, ext = self._lanes[i], False
        # (not ready: the drafter context is behind, or a verify block would run past the cache: plain steps)
        if isinstance(one, SpecLaunch) or (one is None and self.spec.ready(seq, lane, i, pos)):
            new, nxt = self.spec.step(seq, lane, i, pos, one, self.launch_ahead, launched)
            self._on_device = None  # out_ids[0] holds a verify row
            self._one = None if nxt is None else _OneAhead(seq.request_id, *nxt)
            return [(new, True)]
        if one is None:
            staged = None if self._on_device == (seq.request_id, pos) else seq.output[-1]
            self._grow(i, pos + 1)
            ext = self.logits.stage([seq])
            one = self.steps.launch_one(pos, greedy, token=staged, lane=i, ext=ext)
        lane.last_written = max(lane.last_written, pos)
        lane.drafted(pos, pos + 1, taps=False)  # a plain step leaves the drafter context behind
        nxt = None  # the next step, launched now: it decodes the token this one leaves in out_ids[0]
        if self.launch_ahead and not (ext or seq.speculative) and seq.room(self.max_context) >= 2:
            self._grow(i, pos + 2)
            nxt = _OneAhead(seq.request_id, pos + 1, self.steps.launch_one(pos + 1, greedy, lane=i))
            lane.last_written = max(lane.last_written, pos + 1)
        if launched is not None:
            launched()
        (new,) = self.steps.wait(one)
        if ext:
            self._raise_failed(self.logits.picked([seq], [new]))
        self._one, self._on_device = nxt, (seq.request_id, pos + 1) if nxt is None else None
        return [([new], False)]

    @staticmethod
    def _raise_failed(failed: dict) -> None:
        """A one-sequence step's row failure, raised (the core finishes that sequence alone)."""
        for error in failed.values():
            raise error

    def _take_one(self, seqs: list) -> Any:
        """The launch of the one-sequence step launched ahead when it is this step's (one sequence, at the position
        it ran); else None, after waiting for any such step (nobody reads its tokens)."""
        one, self._one = self._one, None
        if one is None:
            return None
        if len(seqs) == 1 and (one.request_id, one.position) == (seqs[0].request_id, seqs[0].num_tokens - 1):
            self.ahead_steps += 1
            return one.launch
        self._settle(one)
        return None

    def _settle(self, one: _OneAhead) -> None:
        self.steps.settle(one.launch)
        self._on_device = None  # (it wrote its token into out_ids[0])

    def _decode_batch(self, seqs: list, cur: _Launched | None, joining: list, launched=None
                      ) -> list[tuple[list[int], bool]]:
        """A batched step. `cur`: this step, launched ahead by the step before; else it is launched now. Then, before
        waiting for this step's tokens, the next step is launched for every sequence that goes on (its input
        token carried on the device from this step's) and for this step's new sequences: the host's work between
        steps (post-processing, streaming, scheduling, staging) runs while the GPU computes. A sequence that then
        finishes wasted its row of the next step, which wrote K/V only at its own next position."""
        ext = False
        if cur is not None:
            self.ahead_steps += 1
        else:
            rows = [(self._lane_of[s.request_id], s.num_tokens - 1, s.output[-1], s) for s in seqs]
            ext = self.logits.stage(seqs)
            cur = self._launch(rows, {}, ext)
        nxt = None if ext else self._launch_next(seqs, cur, joining)
        if launched is not None:
            launched()
        tokens = self.steps.wait(cur.launch)
        self._ahead = nxt
        new = [tokens[cur.rows[s.request_id][0]] for s in seqs]
        failed = self.logits.picked(seqs, new) if ext else {}
        return [failed.get(s.request_id) or ([t], False) for s, t in zip(seqs, new)]

    def _launch_next(self, seqs: list, cur: _Launched, joining: list) -> _Launched | None:
        """Launch the step after `cur`, when at least two rows go on and none needs host work between the steps
        (logits processing: its counts and grammar mask need this step's token)."""
        if not self.launch_ahead or any(s.sampling.extended for s in [*seqs, *(s for s, _ in joining)]):
            return None
        # (room 1: this step is its last; 2 or more: it may go on, unless it stops)
        going = sorted((s for s in seqs if s.room(self.max_context) >= 2), key=lambda s: cur.rows[s.request_id][0])
        new = [(s, t) for s, t in joining if s.room(self.max_context) >= 2]
        if len(going) + len(new) < 2:
            return None
        rows = [(self._lane_of[s.request_id], s.num_tokens, 0, s) for s in going]
        rows += [(self._lane_of[s.request_id], s.num_tokens, t, s) for s, t in new]
        return self._launch(rows, {r: cur.rows[s.request_id][0] for r, s in enumerate(going)}, False)

    def _launch(self, rows: list, carried: dict[int, int], ext: bool) -> _Launched:
        """Launch a batched step of rows (lane, position, token, sequence): pages grown first, then the launch."""
        for i, pos, _, _ in rows:
            self._grow(i, pos + 1)
            self._lanes[i].last_written = max(self._lanes[i].last_written, pos)
            self._lanes[i].drafted(pos, pos + 1, taps=False)  # a plain step leaves the drafter context behind
        launch = self.steps.launch_batch([(i, pos, tok, None if s.sampling.greedy else s.sampling)
                                           for i, pos, tok, s in rows], carried, ext=ext)
        self._on_device = None  # out_ids[0] holds row 0's token
        if any(not s.sampling.greedy for _, _, _, s in rows):
            self._params_for = None  # the step wrote every row's parameters
        return _Launched(launch, {s.request_id: (r, pos) for r, (_, pos, _, s) in enumerate(rows)})

    def release(self, seq, finished: bool) -> None:
        self.logits.forget(seq.request_id)
        self._joining = [(s, t) for s, t in self._joining if s is not seq]
        if self._one is not None and self._one.request_id == seq.request_id:
            # it ended with its next step in flight: nobody reads that step (waited for at the next call, it wrote
            # only positions past the committed ones: of its own pages, or another holder's after them in the stream)
            self._one = self._one._replace(request_id=None)
        i = self._lane_of.pop(seq.request_id, None)
        if self._on_device is not None and self._on_device[0] == seq.request_id:
            self._on_device = None
        if i is not None:
            lane = self._lanes[i]
            # the positions whose K/V a committed token wrote (a step's tokens after a stop id wrote some too)
            lane.owner, lane.seq = None, None
            lane.cached = self._keys(seq, seq.num_cached) if finished else []
            if self.pool is not None:  # its final full pages stay cached (LRU) for whoever starts the same way
                if finished:
                    lane.pages.register(self.pool, lane.cached, len(lane.cached))
                lane.pages.release(self.pool)
            self._released += 1
            lane.freed_at = self._released
        self.engine.device.used()  # (the device keeps the peak for bench's report)
