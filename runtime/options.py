"""Runtime stage: how an engine is opened, backend-neutral (no cuda module behind it): the context default every
command shares, `EngineOptions`, the CUDA engine's typed switches (each on by default; off for A/B timing), and
`DraftOptions`, the settings of the engine core's draft policy (runtime/engine/speculation.py)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

DEFAULT_CTX = 65536  # every command's --ctx default is min(max_position_embeddings, DEFAULT_CTX)


def default_ctx(max_position_embeddings: int, ctx: int | None = None) -> int:
    """`ctx` when given, else min(the model's max_position_embeddings, DEFAULT_CTX)."""
    return min(max_position_embeddings, DEFAULT_CTX) if ctx is None else int(ctx)


def _switch(help: str, default: bool = True) -> bool:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class EngineOptions:
    """How the CUDA engine launches its work. Every switch keeps the engine's output the same; turning one off
    measures what it buys (docs/BENCHMARKS.md). All are on by default but `prefill_pieces`, which trades
    throughput for shorter token gaps. The reference backend ignores them."""

    pdl: bool = _switch("cuda: programmatic dependent launch between consecutive kernels, where the kernels allow it")
    fork: bool = _switch("cuda: the dense MLP on a side stream beside router + MoE (off: one stream)")
    launch_ahead: bool = _switch(
        "cuda: launch each decode step (batched, one-sequence or DFlash) before the step before it is read, its "
        "input tokens carried on the device (off: each step is launched when it is scheduled)"
    )
    capture_graphs: bool = _switch(
        "cuda: capture every decode, verify and draft step graph when the engine core's runner is made (off: each "
        "when it is first used, while running requests wait)"
    )
    rowwise_splits: bool = _switch(
        "cuda: batched-decode attention over the planner's key-split count for the batch's rows (off: every "
        "planned split)"
    )
    prefill_pieces: bool = _switch(
        "cuda: while sequences decode, a step takes one prompt chunk and runs a long one a few layers a step, so "
        "the running streams' token gaps stay near one decode step plus one piece, at some throughput and first-"
        "token latency under bursts of prompts (off: only the chunks of a request with images run in pieces; "
        "others beside decodes run whole, several a step)",
        default=False,
    )

    @staticmethod
    def flags() -> list[tuple[str, str, str, bool]]:
        """(field name, command-line switch, help, default) of each option: `--pdl/--no-pdl` and so on."""
        return [(f.name, f.name.replace("_", "-"), f.metadata["help"], f.default) for f in fields(EngineOptions)]


@dataclass(frozen=True)
class DraftOptions:
    """The draft policy's settings. `adaptive` off: every speculative step proposes the most drafts the request
    allows, whatever lands (bench --emulate-acceptance measures a chosen acceptance that way)."""

    adaptive: bool = True
    weight: float = 0.3  # the newest step's weight in the estimate
    prior: float = 4.0  # the estimate before a sequence's first verify step (accepted drafts a step)
    probe_every: int = 16  # plain steps before a switched-off sequence probes again
    probe_max: int = 256  # the longest wait between probes (it doubles after each probe that misses)
    # every verify step commits this many drafts + 1, whatever the drafts were (None: what they earn): the speed
    # at a chosen acceptance on a synthetic checkpoint, whose random drafter never agrees; the tokens are not the
    # model's (`thorgen serve --emulate-acceptance K`, `thorgen bench --emulate-acceptance K`)
    emulate_acceptance: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.prior < 0 or not 1 <= self.probe_every <= self.probe_max:
            raise ValueError(f"draft options out of range: {self}")
        if self.emulate_acceptance is not None and self.emulate_acceptance < 0:
            raise ValueError(f"emulate_acceptance {self.emulate_acceptance}: a draft count, 0 or more")


__all__ = ["DEFAULT_CTX", "DraftOptions", "EngineOptions", "default_ctx"]
