"""Runtime stage (reference backend): `ReferenceBackend`, the NumPy implementation of the Backend protocol.

It is the numerical oracle for the CUDA runtime: float32 weights dequantized from the NVFP4 checkpoint,
float64-accumulated reductions, exact DFlash draft-then-verify, counter-based sampling, and prefix reuse decided by
the engine core's KV manager as for the cuda backend (runtime/engine/kv_manager.py; `prefix_cache=False` turns it
off, as the bench's TTFT runs need).

`numerics="float32"` (default) is the model's own math (checked against HF transformers); `numerics="w4a16"`
rounds where the CUDA engine stores (fp16 GEMM inputs, bf16 queries, `kv_dtype` "bf16" | "fp8" K/V cache,
`lm_head` "nvfp4" | "bf16"; see w4a16.py), the like-for-like oracle for the engine's tokens.
"""

from __future__ import annotations


from ..backend import (
    BackendError,
    BackendFeatures,
    ImageRowCache,
)
from ..engine.single import EngineBackend
from .drafter import DFlashDrafter, Drafter
from .model import TargetModel
from .runner import ReferenceRunner
from .speculative import Decoder
from .vision import VisionModel
from .w4a16 import W4A16Target
from .weights import DEFAULT_EXPERT_BUDGET, WeightSource

NUMERICS = ("float32", "w4a16")


class ReferenceBackend(EngineBackend):
    """Backend over a checkpoint (or any WeightSource). `drafter=` injects a drafter (scripted in tests)."""

    def __init__(
        self,
        checkpoint: WeightSource,
        max_context: int | None = None,
        drafter: Drafter | None = None,
        prefix_cache: bool = True,
        embed_scale: float | None = None,
        expert_budget_bytes: int = DEFAULT_EXPERT_BUDGET,
        numerics: str = "float32",
        kv_dtype: str | None = None,
        lm_head: str | None = None,
        kernels=None,
        encoder_slots: int = 8,
    ) -> None:
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        limit = self.spec.target.max_position_embeddings
        self.max_context = limit if max_context is None else int(max_context)
        if not 1 < self.max_context <= limit:
            raise BackendError(f"max_context {self.max_context} must lie in 2..{limit} (max_position_embeddings)")
        self.numerics = numerics
        if numerics == "w4a16":
            kv_dtype, lm_head = kv_dtype or "bf16", lm_head or "nvfp4"
            try:  # bad kv_dtype / lm_head / a weight source without raw NVFP4 tensors
                self.target: TargetModel = W4A16Target(
                    checkpoint,
                    kv_dtype=kv_dtype,
                    lm_head=lm_head,
                    embed_scale=embed_scale,
                    expert_budget_bytes=expert_budget_bytes,
                    kernels=kernels,
                )
            except (ValueError, RuntimeError) as exc:
                raise BackendError(f"numerics 'w4a16': {exc}") from None
        elif numerics == "float32":
            if kv_dtype is not None or lm_head is not None or kernels is not None:
                raise BackendError(
                    "kv_dtype, lm_head and kernels describe the CUDA engine: they apply to "
                    "numerics='w4a16' only (float32 keeps everything in float32)"
                )
            self.target = TargetModel(checkpoint, embed_scale=embed_scale, expert_budget_bytes=expert_budget_bytes)
        else:
            raise BackendError(f"numerics {numerics!r}: choose one of {', '.join(NUMERICS)}")
        self.kv_dtype, self.lm_head = kv_dtype, lm_head
        if drafter is None and self.spec.drafter is not None:
            drafter = DFlashDrafter(checkpoint, self.target)
        self.drafter = drafter
        self.decoder = Decoder(self.target, drafter)
        self.prefix_cache = prefix_cache
        self.encoder_cache = (
            ImageRowCache(VisionModel(checkpoint), encoder_slots) if self.spec.vision is not None else None
        )

    @property
    def features(self) -> BackendFeatures:
        """Speculative decoding with a drafter; grammars always (its runner applies llguidance masks)."""
        return BackendFeatures(speculative=self.drafter is not None, grammar=True)

    def close(self) -> None:
        pass  # (NumPy arrays: nothing to release)

    def _emulate(self, k: int | None) -> None:
        self.decoder.emulate_acceptance = k

    def runner(self, max_num_seqs: int = 8, kv_tokens: int | None = None) -> ReferenceRunner:
        """The engine core's ModelRunner over this backend (shares its model and drafter; the KV lanes are its own,
        so a prefix cache lives as long as the engine core driving the runner)."""
        return ReferenceRunner(self, max_num_seqs, kv_tokens)
