"""Model spec stage: the shipped presets, `gemma-4-26b-a4b` (the real shapes) and `tiny` (same architecture, small)."""

from __future__ import annotations

from .types import FULL, SLIDING, DFlashSpec, Gemma4TextSpec, Gemma4VisionSpec, ModelSpec, RopeSpec, SpecError

S, F = SLIDING, FULL

_GEMMA_ROPE = ((F, RopeSpec("proportional", 1e6, 0.25)), (S, RopeSpec("default", 1e4)))

GEMMA_4_26B_A4B = ModelSpec(
    name="gemma-4-26b-a4b",
    target=Gemma4TextSpec(
        vocab_size=262144,
        hidden_size=2816,
        num_hidden_layers=30,
        layer_types=(S, S, S, S, S, F) * 5,
        sliding_window=1024,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        global_head_dim=512,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        intermediate_size=2112,
        moe_intermediate_size=704,
        num_experts=128,
        top_k_experts=8,
        rope_parameters=_GEMMA_ROPE,
    ),
    drafter=DFlashSpec(
        hidden_size=2816,
        num_hidden_layers=5,
        layer_types=(S, S, S, S, F),
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=5632,
        sliding_window=2048,
        block_size=16,
        mask_token_id=4,
        target_layer_ids=(1, 6, 11, 17, 22, 27),
        num_target_layers=30,
        vocab_size=262144,
    ),
    vision=Gemma4VisionSpec(
        hidden_size=1152,
        num_hidden_layers=27,
        num_attention_heads=16,
        head_dim=72,
        intermediate_size=4304,
        image_token_id=258880,
        boi_token_id=255999,
        eoi_token_id=258882,
        video_token_id=258884,
    ),
)

# Same architecture at small sizes: a full k_eq_v layer, a sliding window (16) shorter than the test prompts,
# top-k (4) below the expert count (16), and a 512-token vocabulary so the real special-token ids (<= 107) exist.
# Its vision tower keeps the real tower's awkward shapes: head_dim 72 (no attention tile of 64 divides it) and an
# intermediate size (272) that is not a multiple of 64; the image ids take unused slots below 107.
TINY = ModelSpec(
    name="tiny",
    target=Gemma4TextSpec(
        vocab_size=512,
        hidden_size=256,
        num_hidden_layers=6,
        layer_types=(S, S, F, S, S, F),
        sliding_window=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=128,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        intermediate_size=256,
        moe_intermediate_size=128,
        num_experts=16,
        top_k_experts=4,
        rope_parameters=_GEMMA_ROPE,
        max_position_embeddings=8192,
    ),
    drafter=DFlashSpec(
        hidden_size=256,
        num_hidden_layers=2,
        layer_types=(S, F),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        sliding_window=32,
        block_size=16,
        mask_token_id=4,
        target_layer_ids=(1, 3, 4),
        num_target_layers=6,
        vocab_size=512,
    ),
    vision=Gemma4VisionSpec(
        hidden_size=144,
        num_hidden_layers=2,
        num_attention_heads=2,
        head_dim=72,
        intermediate_size=272,
        image_token_id=61,
        boi_token_id=60,
        eoi_token_id=62,
        video_token_id=63,
        # every budget's longest strip: 1120 soft tokens x 3 patches a side (the real table has 10240)
        position_embedding_size=3360,
    ),
)

PRESETS: dict[str, ModelSpec] = {s.name: s for s in (GEMMA_4_26B_A4B, TINY)}


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
