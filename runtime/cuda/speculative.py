"""Runtime stage: DFlash speculative decoding on the CUDA engine — the drafter's launches and buffers (the engine
core's CudaRunner drives the draft/verify steps).

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
Both graphs have fixed shapes (16 rows): only positions (host -> device) and ids[0] change between steps.
"""

from __future__ import annotations

from ...model_spec.conventions import VERIFY_ROWS  # DFlashSpec.block_size must match
from ...model_spec.step_program import DRAFT_BLOCK, DRAFT_CONTEXT, drafter_problem, program_key, verify_key
from ...model_spec.types import ModelSpec
from ..backend import BackendError
from .programs import Forward, Op
from .memory import ArenaPlan



def split_weights(spec: ModelSpec) -> list[tuple[str, str, int, int, int]]:
    """(name, fused source, first row, rows, k) of the drafter's k|v matrices cut out of the repacked q|k|v: the
    context update projects only keys and values (the block's GEMM reads the fused matrix whole; see
    Engine._split_drafter_weights)."""
    d = spec.drafter
    assert d is not None
    nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    return [(f"dsplit.{l}.kv", f"draft.layers.{l}.self_attn.qkv_proj.weight", nq, 2 * nkv, d.hidden_size)
            for l in range(d.num_hidden_layers)]


def plan_drafter_activations(p: ArenaPlan, spec: ModelSpec, rows: int) -> None:
    """Drafter buffers: context path sized for a prefill chunk (`rows`), block path for VERIFY_ROWS rows."""
    d, H = spec.drafter, spec.target.hidden_size
    assert d is not None
    nq, nkv = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    for name, shape, dt in (
            ("taps", (rows, len(d.target_layer_ids) * H), "f16"), ("dctx", (rows, d.hidden_size), "f32"),
            ("dctx_a", (rows, d.hidden_size), "f16"), ("dkv_raw", (rows, 2 * nkv), "f32"),
            ("dx", (VERIFY_ROWS, d.hidden_size), "f32"), ("da", (VERIFY_ROWS, d.hidden_size), "f16"),
            ("dqkv_raw", (VERIFY_ROWS, nq + 2 * nkv), "f32"), ("dq", (VERIFY_ROWS, nq), "bf16"),
            ("dattn", (VERIFY_ROWS, nq), "f16"),
            ("do", (VERIFY_ROWS, d.hidden_size), "f32"), ("dmlp", (VERIFY_ROWS, d.intermediate_size), "f16"),
            # the acceptance rule on the device: [most tokens a step commits, emulated K or -1]; its count
            ("spec_rule", (2,), "i32"), ("spec_acc", (1,), "i32")):
        p.add_array(name, shape, dt)


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

    def verify_ops(self, greedy: bool = True) -> list[Op]:
        """The verify step: target forward (taps), drafter context update beside its head, acceptance (LowerDraft)."""
        return self.fwd.program(verify_key(greedy), VERIFY_ROWS)

    def probe(self) -> list[str]:
        """What the speculative path lacks (empty: it can run)."""
        return self.fwd.missing("speculative", verify_key(True), verify_key(False), program_key(last=True, taps=True),
                                DRAFT_BLOCK, DRAFT_CONTEXT)


__all__ = ["DraftForward", "plan_drafter_activations", "split_weights"]
