"""Model-spec stage (shared bottom constants): the step shapes that codegen plans kernels for and the runtime runs
them at, written once here so that neither stage copies the other's numbers (the manifest's `conventions` carry
the ones a build was made with)."""

MAX_STEP_TOKENS = 512  # most tokens one forward appends to a KV cache (a prefill chunk); rings add this to the window
VERIFY_ROWS = 16  # a DFlash draft / verify block, and the rows the M <= 16 kernels and lm_head epilogues handle
MAX_BATCH = 32  # rows of a batched decode step (one per sequence); its lm_head runs in VERIFY_ROWS slices
DECODE_BUCKETS = (1, 2, 4, 8, 16)  # batched decode graphs are captured for these row counts (more: two steps)
MANIFEST_SCHEMA = 2  # the kernel manifest's format (codegen writes it, the runtime refuses others); 2: launch-grid
# rules (ROW_GRID, ROWWISE_GRID, ROWWISE_SPLITS) in the kernels' params, which a schema-1 build lacks
