"""Model-spec stage (shared bottom constants): the step shapes that codegen plans kernels for and the runtime runs
them at, written once here so that neither stage copies the other's numbers (the manifest's `conventions` carry
the ones a build was made with), and the device records both sides lay out."""

from typing import Sequence

import numpy as np

MAX_STEP_TOKENS = 2048  # most tokens one forward appends to a KV cache (a prefill chunk); rings add this to the window.
# 2048, not 512: the grouped MoE streams and decodes every touched expert's weights once a chunk, so a 2,048-token
# prompt in one chunk reads them once instead of four times (TTFT at 2,048 tokens 86.4 -> 69.9 ms on an H200,
# df7f63d); the price is a sliding ring of window + 2048 slots a sequence (3,072 at window 1,024) and activations for
# 2,048 rows.
VERIFY_ROWS = 16  # a DFlash draft / verify block, and the rows the M <= 16 kernels and lm_head epilogues handle
MAX_BATCH = 32  # rows of a batched decode step (one per sequence); its lm_head runs in VERIFY_ROWS slices
DECODE_BUCKETS = (1, 2, 4, 8, 16, 32)  # batched decode graphs are captured for these row counts (up to MAX_BATCH)
KV_PAGE = 16  # positions per page of a paged KV cache (the full-attention layers); also the scheduler's block size
MANIFEST_SCHEMA = 4  # the kernel manifest's format (codegen writes it, the runtime refuses others); 2: launch-grid
# rules (ROW_GRID, ROWWISE_GRID, ROWWISE_SPLITS) in the kernels' params; 3: the step programs; 4: the drafter's
# context in a lane per sequence (its programs' "dlane_bytes")


def decode_bucket(rows: int) -> int:
    """The smallest of DECODE_BUCKETS that holds `rows` rows (1..MAX_BATCH): the batched graph a step of them runs."""
    return next(b for b in DECODE_BUCKETS if b >= rows)


def ring_slots(window: int, max_step_tokens: int = MAX_STEP_TOKENS) -> int:
    """Slots of a sliding layer's KV ring: a step writes up to max_step_tokens new keys before its queries have read
    the `window - 1` older keys they need, so the ring holds both."""
    return window + max_step_tokens


def page_pitch(max_position_embeddings: int) -> int:
    """Entries of one sequence's row of the page table: pages for the model's longest context (the kernels index
    rows at this pitch, so it is a build-time constant; a shorter --ctx leaves the tail of each row unused)."""
    return -(-max_position_embeddings // KV_PAGE)


# thorgen::SampleParams (templates/include/thorgen/sample.cuh): one row's sampling, in device memory so that a
# captured graph samples each request its own way. tests/test_conventions.py checks it against the C struct.
SAMPLE_PARAMS = np.dtype(
    [("temperature", "<f8"), ("top_p", "<f8"), ("min_p", "<f8"), ("seed", "<u8"), ("top_k", "<i4"), ("pad", "<i4")]
)


def max_step_tokens(conventions: dict) -> int:
    """The step rows a build's conventions record (older builds without the key: the current default)."""
    return int(conventions.get("max_step_tokens", MAX_STEP_TOKENS))


def accepted_count(drafts: Sequence[int], targets: Sequence[int], most: int, emulate: int | None = None) -> int:
    """Tokens a DFlash verify step commits (targets[0..n)): the longest run where draft i (the block's slot i + 1)
    equals target i, plus the target's token after it, at most `most` (1 + a request's draft cap); `emulate` K:
    exactly K + 1 (bench --emulate-acceptance). The runtime applies it on the host, spec_accept.cuh on the device
    (its launched-ahead next step), the reference backend on its verify block, and the kernel tests' reference."""
    most, n = min(max(most, 1), len(targets)), 1
    while n < most and (drafts[n - 1] == targets[n - 1] if emulate is None else n <= emulate):
        n += 1
    return n
