"""Runtime stage (engine core): one request through an engine core of its own: `generate_one`, and `EngineBackend`,
the generate_stream / generate every backend shares on top of it."""

from __future__ import annotations

from typing import Callable, Iterator, Sequence as Seq

from ..backend import BackendError, GenerationResult, ImageSpan, SamplingParams, StepOutput
from ..options import DraftOptions
from .core import EngineCore
from .interface import ModelRunner


def generate_one(
    runner: ModelRunner,
    prompt: list[int],
    max_tokens: int,
    sampling: SamplingParams,
    stop_ids: frozenset[int],
    speculative: bool,
    cancelled: Callable[[], bool] | None,
    result: GenerationResult,
    images: tuple[ImageSpan, ...] = (),
    drafts: DraftOptions | None = None,
) -> Iterator[StepOutput]:
    """A backend's `generate_stream` for one request, through the engine core (`drafts`: its draft policy's
    options): request mistakes raise BackendError here; the returned iterator yields StepOutputs and fills
    `result` as it goes."""
    core = EngineCore(runner, drafts=drafts)
    core.add("generate", prompt, max_tokens, sampling, stop_ids, speculative, images)
    result.prompt_tokens = len(prompt)

    def steps() -> Iterator[StepOutput]:
        try:
            while core.unfinished:
                if cancelled is not None and cancelled():
                    core.abort("generate")
                for out in core.step():
                    if out.error is not None:
                        raise out.error
                    if out.finished:
                        r = out.result
                        assert r is not None
                        result.finish_reason, result.accepted_lengths = r.finish_reason, r.accepted_lengths
                        result.cached_prompt_tokens, result.prefill_s, result.decode_s = (
                            r.cached_prompt_tokens,
                            r.prefill_s,
                            r.decode_s,
                        )
                        return
                    result.token_ids += out.token_ids
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = list(out.prompt_logprobs)
                    yield StepOutput(list(out.token_ids), out.accepted)
        finally:
            if core.unfinished:  # the consumer stopped early: finish it as cancelled, releasing its state
                core.abort("generate")
                core.step()
                result.finish_reason = "cancelled"

    return steps()


class EngineBackend:
    """What both backends share: one request's `generate_stream` through an engine core over a one-lane runner
    of their own (`generate_one`), and `generate`, which drains it. A backend supplies
    `runner()`. `draft_options`: the draft policy of every engine core over it (bench --emulate-acceptance turns
    adaptive draft counts off)."""

    draft_options = DraftOptions()

    def runner(self, max_num_seqs: int = 1, kv_tokens: int | None = None) -> ModelRunner:
        raise NotImplementedError

    def emulate_acceptance(self, k: int | None) -> None:
        """Every verify step commits `k` drafts + 1 whatever the drafts were (None: what they earn); BackendError
        without a drafter or past its block."""
        drafter = self.spec.drafter  # type: ignore[attr-defined]
        if k is not None and (not self.features.speculative or drafter is None):  # type: ignore[attr-defined]
            raise BackendError("emulated acceptance needs a checkpoint with a DFlash drafter (MODEL/dflash)")
        if k is not None and not 0 <= k < drafter.block_size:
            raise BackendError(f"emulated acceptance {k}: 0..{drafter.block_size - 1} drafts a step")
        self._emulate(k)

    def _emulate(self, k: int | None) -> None:
        raise NotImplementedError

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
        result = GenerationResult() if result is None else result
        args = (list(prompt_ids), max_tokens, sampling, frozenset(stop_ids), speculative, cancelled, result)
        return generate_one(self.runner(1), *args, tuple(images), self.draft_options)

    def generate(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: frozenset[int] = frozenset(),
        speculative: bool = False,
        cancelled: Callable[[], bool] | None = None,
        images: Seq[ImageSpan] = (),
    ) -> GenerationResult:
        result = GenerationResult()
        for _ in self.generate_stream(
            prompt_ids, max_tokens, sampling, stop_ids, speculative, cancelled, result, images
        ):
            pass
        return result
