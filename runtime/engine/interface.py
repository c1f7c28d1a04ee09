"""Runtime stage (engine core): the two interfaces a backend implements: `ModelRunner`, what the engine core
drives, and `Backend`, what the engine client, `thorgen generate` and `thorgen bench` open (runtime/api.py)."""

from __future__ import annotations

from typing import Callable, Iterator, Protocol, Sequence as Seq

from ...model_spec.types import ModelSpec
from ..backend import BackendFeatures, GenerationResult, ImageSpan, SamplingParams, StepOutput
from ..options import DraftOptions
from .kv_manager import KVGeometry, KVOp
from .sequence import Sequence

DecodeResult = tuple[list[int], int]  # a decode row's tokens and the drafts its verify step checked (0: plain step)


class ModelRunner(Protocol):
    """What a backend gives the engine core: it executes schedules and decides nothing about the KV cache (the
    scheduler's KV manager does, over `kv_geometry`). Every call runs on the engine thread."""

    @property
    def max_context(self) -> int: ...

    @property
    def max_num_seqs(self) -> int:
        """Sequences whose K/V it can hold at once (its KV lanes)."""

    @property
    def kv_geometry(self) -> KVGeometry:
        """Its KV cache: lanes, pages, rings."""

    @property
    def verify_block(self) -> int:
        """K/V positions one speculative step writes (1 without a drafter)."""

    def speculative_cost(self, drafts: int, batch: int) -> float:
        """What a sequence's draft + verify step of `drafts` drafts costs beside the other sequences of a step of
        `batch`, in plain decode steps of it (math.inf: it cannot verify drafts in such a step). The draft
        policy's cost model: it speculates only where the expected accepted drafts pay for it. A fixed function of
        its arguments: the policy asks each pair once."""

    @property
    def lookahead(self) -> int:
        """Decode steps a sequence may have launched before the step before them is read (0, or 1 for a runner that
        launches the next step ahead): each writes the positions of one more step, which the scheduler grants."""

    @property
    def prefill_chunk(self) -> int | None:
        """Prompt tokens per prefill call; None: whole prompts."""

    def chunks_in_pieces(self, seq: Sequence) -> bool:
        """Whether it runs a long prefill chunk of `seq` beside decoding sequences a few layers a call (`prefill`'s
        `beside`): the scheduler then gives a step with such a chunk no other, so no step holds the decoders back by
        more than one piece."""

    @property
    def caught_up_tokens(self) -> int:
        """Positions whose drafter context a catch-up prefill restored (0: never behind)."""

    @property
    def device_memory_used(self) -> int | None:
        """Bytes of device memory in use when last sampled (at load and at each sequence's end; the driver's view,
        other processes included), for health reports; None for a runner without a device."""

    @property
    def image_rows_bytes(self) -> int:
        """Host bytes of the encoded images' rows the runner keeps for reuse (its ImageRowCache; 0 without one),
        for health reports."""

    def check(self, seq: Sequence) -> None:
        """Raise BackendError for a request it cannot run (bad ids, speculative without a drafter, ...)."""

    def media_ready(self, seq: Sequence, wait: bool, queued: Seq[Sequence] = ()) -> bool:
        """Whether every image of `seq` can enter a prefill now without the step waiting for its encode (`wait`:
        encode them all first, the step has nothing else to run). A runner that encodes beside the steps starts
        the next missing one here, and may take images of the `queued` sequences (waiting behind `seq`) along in
        the same encode; the scheduler admits a sequence only once this holds, so a new image never stalls the
        running sequences' steps."""

    def draft_context(self, lane: int) -> int:
        """Positions 0.. of KV lane `lane` whose drafter context is current (what a speculative sequence may reuse)."""

    def apply(self, ops: tuple[KVOp, ...]) -> None:
        """Execute the KV manager's instructions (page-table rows, lane-to-lane prefix copies), in order, before
        anything of the step they came with runs. A sequence's KV lane is `seq.lane`; a newly admitted one's
        first `seq.num_cached` positions hold its cached prefix."""

    def prefill(
        self,
        seq: Sequence,
        start: int,
        end: int,
        sample: bool,
        launched: Callable[[], None] | None = None,
        beside: bool = False,
    ) -> int | None | Pending:
        """Forward tokens[start:end]; with `sample`, return the first new token (sampled after tokens[end-1]).
        `launched()` is called once the device work is enqueued, before waiting for it. A runner that serves
        logprobs sets `seq.step_logprobs` to one TokenLogprob per token it returns (prefill and decode).
        `beside`: sequences decode in the same step; a runner may then run a long chunk a few layers a call and
        return PENDING until its last piece (the core schedules the chunk again)."""

    def decode(
        self, seqs: list[Sequence], launched: Callable[[], None] | None = None
    ) -> list[DecodeResult | Exception]:
        """One step per sequence for its last token, with `seq.drafts` drafts (0: a plain step; the scheduler's
        draft policy sets it, a runner may run fewer): (the tokens it commits, at most its room; the drafts its
        verify step checked, 0 for a plain step), or the SequenceFailed that ended that sequence's row (the other
        rows stand). Raising fails the whole step; the core then runs the sequences again, so a runner raises only
        before it changed any sequence's state, or EngineStateLost. `launched()` as for prefill."""

    def release(self, seq: Sequence, finished: bool) -> None:
        """Drop what the runner keeps of the sequence (its KV is the KV manager's, released already: seq.lane is
        no longer set)."""


class Pending:
    """What ModelRunner.prefill returns when it ran only some of the chunk's layers (runtime/cuda/pieces.py)."""

    def __repr__(self) -> str:
        return "PENDING"


PENDING = Pending()


class Backend(Protocol):
    """A model opened on one backend (reference or cuda): everything its users call, and what it can run."""

    spec: ModelSpec
    max_context: int
    draft_options: DraftOptions  # the draft policy of every engine core over it

    @property
    def features(self) -> BackendFeatures:
        """What it can run beyond plain decoding (typed: no caller probes for attributes)."""
        ...

    def runner(self, max_num_seqs: int = 1, kv_tokens: int | None = None) -> ModelRunner:
        """A ModelRunner over up to `max_num_seqs` of its KV lanes and the pages of up to `kv_tokens` positions
        (None: all it has), for an engine core."""
        ...

    def emulate_acceptance(self, k: int | None) -> None:
        """Every verify step commits `k` drafts + 1 whatever the drafts were (None: what they earn; see
        DraftOptions.emulate_acceptance); BackendError without a drafter or past its block."""
        ...

    def generate_stream(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        cancelled: Callable[[], bool] | None = None,
        result: GenerationResult | None = None,
        images: Seq[ImageSpan] = (),
    ) -> Iterator[StepOutput]:
        """Yield committed tokens step by step; stops after a stop id (which is yielded), max_tokens, or cancel.
        Fills the caller's `result` as it goes (the caller keeps it: a value per request, never backend state).
        Request mistakes raise BackendError from this call itself, before any work."""
        ...

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        cancelled: Callable[[], bool] | None = None,
        images: Seq[ImageSpan] = (),
    ) -> GenerationResult: ...

    def close(self) -> None:
        """Release what it holds (the device, its memory); nothing runs on it afterwards."""
        ...
