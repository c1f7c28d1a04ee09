"""Model-spec stage: the weights' kernel layout (the t16x64 tile, NVFP4's block-scale group, the fp4 byte orders
and the artifact's tensor names) that codegen renders into the weight kernels' params and the repack packs to.

The bytes themselves are described and written by runtime/convert/layouts.py; thorgen/nvfp4.cuh reads them, and
every kernel on the tile static_asserts that its rendered `tile_n` / `tile_k` params equal the header's constants,
so the three cannot drift apart without a build failing (tests/test_weight_layout.py ties them on the CPU).
"""

from __future__ import annotations

GROUP = 16  # NVFP4 inputs per e4m3 block scale (the checkpoint's group; a lane's 16 codes of a step are one group)

W_LAYOUT = "t16x64"  # the NVFP4 tile layout (the kernels' param `w_layout`, the artifact tensors' "layout")
HALF_LAYOUT = "half_t16x64"  # fp16 weights in the same step-major tiling (the artifact tensors' "layout")
TILE_N = 16  # output rows a unit: mma.m16n8k16's two n8 tiles
TILE_K = 64  # inputs a step: four k16 tiles
LANES = 32  # a warp's lanes, which split a unit's step between them
GSCALE_ROWS = 8  # rows that share one f32 global multiplier (an n8 tile; fused gate/up interleave at this grain)
FP4_LANE_BYTES = TILE_N * TILE_K // 2 // LANES  # 16: a lane's e2m1 codes of one step
SCALE_LANE_BYTES = TILE_N * TILE_K // GROUP // LANES  # 2: a lane's e4m3 block scales of one step
HALF_LANE_BYTES = TILE_N * TILE_K * 2 // LANES  # 64: a lane's fp16 weights of one step
STEP_BYTES = LANES * FP4_LANE_BYTES  # 512: NVFP4 codes of one unit and step

# NVFP4 byte orders of the tile: "nat" (the checkpoint's nibbles) where the arch converts e2m1 in hardware
# (cvt.rn.f16x2.e2m1x2, sm_100a and later), "shift" (sm_90a's integer decode) elsewhere. The repack writes the order
# the kernels of the target arch were built for (their param `fp4_order`).
FP4_ORDERS = ("shift", "nat")
FP4_CVT_SM = 100  # the first sm_ number with the hardware e2m1 conversion
# "shift" order: (magnitude bit, sign bit) of register r inside each 16-bit half of a little-endian word, so that
# sm_90a decodes with masks and shifts (nvfp4.cuh fp4_shift_decode) into fp16 bits worth e2m1 * 2^-14 ...
SHIFT_POS = ((9, 15), (6, 12), (3, 14), (0, 13))
SHIFT_DECODE_FACTOR = 2.0**14  # ... which the kernels multiply back (nvfp4.cuh DecodeFactor<FP4_SHIFT>)

# The artifact's tensors of a stored matrix `base`: the repack writes them under these names, the step programs
# bind the weight kernels' arguments to them by name (NVFP4: codes, block scales, tile multipliers; bf16: fp16).
PACKED_SUFFIX = ".weight_packed"
SCALE_SUFFIX = ".weight_scale"
TILE_SCALE_SUFFIX = ".weight_tile_scale"
HALF_SUFFIX = ".weight_half"


def sm_number(arch: str) -> int:
    """90 for "sm_90a", 100 for "sm_100a" ...; ValueError for a name that is not an arch."""
    digits = "".join(ch for ch in arch if ch.isdigit())
    if not arch.lower().startswith("sm_") or not digits:
        raise ValueError(f"{arch!r} is not an arch name such as sm_90a or sm_100a")
    return int(digits)


def fp4_order_for(arch: str) -> str:
    """The NVFP4 byte order of the kernels built for arch `arch` ("sm_90a" -> "shift", "sm_100a" -> "nat")."""
    return "nat" if sm_number(arch) >= FP4_CVT_SM else "shift"


def tile_params() -> dict[str, int]:
    """The tile a weight kernel is rendered with (its params `tile_n`, `tile_k`; its template static_asserts them
    against thorgen/nvfp4.cuh)."""
    return {"tile_n": TILE_N, "tile_k": TILE_K}


def fits_tile(n: int, k: int) -> bool:
    """Whether an [n, k] matrix cuts into whole units and steps."""
    return n % TILE_N == 0 and k % TILE_K == 0


def nvfp4_sizes(n: int, k: int) -> tuple[int, int, int]:
    """(code bytes, e4m3 block-scale bytes, f32 tile multipliers) of an [n, k] NVFP4 matrix in the layout."""
    return n * k // 2, n * k // GROUP, n // GSCALE_ROWS
