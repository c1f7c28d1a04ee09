"""Runtime stage: the roofline of one engine step from the ModelSpec: bytes moved and FLOPs for decode (B
sequences, one token each), verify (one speculative step: a DFlash draft plus the target's forward of its block)
and prefill (a chunk of T rows), and the achieved fractions of copy bandwidth and tensor-core throughput for a
measured step time.

Bytes are the minimum traffic a step must make: every weight it uses read once (NVFP4 packed nibbles, E4M3 block
scales and the F32 global scale; bf16 norms, router and embedding rows; the lm_head as the backend stores it),
the experts it touches, the K/V rows its queries see read once and the new rows written. Activations are left
out (they stay in L2 at these sizes). FLOPs count 2 per multiply-add of the linears, the attention products
(QK^T and PV) and the lm_head; norms, RoPE and activations are left out (a few per element, under 1 %).
Touched experts: each row picks top_k distinct experts of E; under uniform routing an expert escapes all R rows
with probability (1 - k/E)^R, so E * (1 - (1 - k/E)^R) are touched on average (exactly k for one row).
"""

from __future__ import annotations

from ...model_spec.tensors import drafter_tensors, target_tensors
from ...model_spec.types import LinearFormats, ModelSpec
from ..cuda.kv_cache import kv_dtype

NVFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # e2m1 nibble + one e4m3 scale per 16
GLOBAL_SCALE_BYTES = 4  # one F32 weight_global_scale per NVFP4 matrix

# Tensor-core ceilings by GPU name. Hopper has no FP4 tensor cores: the NVFP4 weights are dequantized to 16-bit
# and multiplied on the bf16/fp16 path, so the dense bf16 rate is the one to compare with. H200: an
# 8192^3 bf16 matmul through PyTorch ran at 769-798 TFLOP/s on random data on this workplace's H200s
# (device notes, 2026-10-28 and 2026-11-04; the datasheet says 989 dense). The copy ceiling is measured in
# the same run instead (about 4.3 TB/s read + write there): it is the one number the engine's kernels share.
TC_TFLOPS = {"H200": 788.0}
COPY_GBS_SEEN = {"H200": 4300.0}


def tc_ceiling(gpu: str | None) -> float | None:
    """Dense bf16 tensor-core TFLOP/s of the named GPU (None when this table does not know it, or a CPU)."""
    return next((v for k, v in TC_TFLOPS.items() if gpu and k in gpu), None)


def expected_experts(num_experts: int, top_k: int, rows: int) -> float:
    """Mean distinct experts that `rows` tokens touch, each picking top_k distinct of num_experts uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def lm_head_bytes(spec: ModelSpec, lm_head: str) -> float:
    v, h = spec.target.vocab_size, spec.target.hidden_size
    return v * h * NVFP4_BYTES_PER_WEIGHT + GLOBAL_SCALE_BYTES if lm_head == "nvfp4" else v * h * 2


def target_weight_bytes(spec: ModelSpec, rows: int, lm_head: str = "nvfp4") -> float:
    """Weight bytes one target forward of `rows` tokens reads: every tensor of the inventory, the touched share
    of the experts, `rows` embedding rows, the tied lm_head once. input_global_scale is never read (W4A16)."""
    t = spec.target
    share = expected_experts(t.num_experts, t.top_k_experts, rows) / t.num_experts
    total = 0.0
    for ti in target_tensors(t, formats=spec.linear_formats):
        if ti.role in ("input_global_scale", "input_scale", "kv_scale"):
            continue
        if ti.name.endswith("embed_tokens.weight"):
            total += min(rows, t.vocab_size) * t.hidden_size * 2
        elif ".experts." in ti.name:
            total += ti.nbytes * share
        else:
            total += ti.nbytes
    return total + lm_head_bytes(spec, lm_head)


LINEAR_ROLES = ("weight_packed", "weight_scale", "weight_global_scale", "linear_bf16")


def _category(name: str, role: str) -> str:
    if role not in LINEAR_ROLES:
        return "other"  # norms, router, layer scalars, the embedding
    return "experts" if ".experts." in name else "attention" if ".self_attn." in name else "dense_mlp"


def format_footprint(spec: ModelSpec, formats: LinearFormats, lm_head: str = "nvfp4") -> dict:
    """Weight bytes of the target served with these per-role linear formats: `memory` (every weight resident: all
    experts, the bf16 embedding for lookups and the lm_head as stored) and `decode` (bytes read for one decode
    token, by part: attention, dense_mlp, the top_k active experts, lm_head, other = norms, router, one embedding
    row; and their total). NVFP4 linears count nibbles, E4M3 block scales and the F32 global scale; bf16 two
    bytes a weight. KV cache and the drafter are left out."""
    t = spec.target
    memory = {"attention": 0.0, "dense_mlp": 0.0, "experts": 0.0, "other": 0.0}
    decode = dict(memory)
    for ti in target_tensors(t, formats=formats):
        if ti.role in ("input_global_scale", "input_scale", "kv_scale"):
            continue
        part = _category(ti.name, ti.role)
        memory[part] += ti.nbytes
        if ti.name.endswith("embed_tokens.weight"):
            decode[part] += t.hidden_size * 2
        else:
            decode[part] += ti.nbytes * (t.top_k_experts / t.num_experts if part == "experts" else 1)
    memory["lm_head"] = decode["lm_head"] = lm_head_bytes(spec, lm_head) if lm_head == "nvfp4" else 0.0
    if lm_head == "bf16":  # the kernels then read the bf16 embedding itself
        decode["lm_head"] = t.vocab_size * t.hidden_size * 2
    memory["total"], decode["total"] = sum(memory.values()), sum(decode.values())
    return {"memory": memory, "decode": decode}


def _visible(window: int | None, position: int) -> int:
    """Keys a query at `position` sees (itself included)."""
    return position + 1 if window is None else min(position + 1, window)


def _keys_read(window: int | None, ctx: int, rows: int) -> int:
    """Distinct key positions the last `rows` queries of a `ctx`-token context see together."""
    return ctx if window is None else min(ctx, window + rows - 1)


def target_kv_bytes(spec: ModelSpec, ctx: int, rows: int, kv: str = "bf16", seqs: int = 1) -> float:
    """K/V bytes of `seqs` sequences whose last `rows` tokens (positions ctx-rows..ctx-1) run this step: the
    keys their queries see read once (the new rows included), the new rows written."""
    t, elem = spec.target, kv_dtype(kv)[1]
    total = 0
    for layer in range(t.num_hidden_layers):
        row = 2 * t.layer_kv_heads(layer) * t.layer_head_dim(layer) * elem  # K and V of one position
        total += row * (_keys_read(t.layer_window(layer), ctx, rows) + rows)
    return float(seqs * total)


def target_flops(spec: ModelSpec, ctx: int, rows: int, logit_rows: int, seqs: int = 1) -> float:
    """FLOPs of one target forward of `seqs` x `rows` tokens ending at context `ctx`, `logit_rows` lm_head rows
    per sequence."""
    t, h = spec.target, spec.target.hidden_size
    per_row = 0
    attn = 0
    for layer in range(t.num_hidden_layers):
        hd, nq, nkv = t.layer_head_dim(layer), t.num_attention_heads, t.layer_kv_heads(layer)
        qkv = nq * hd + nkv * hd * (2 if t.layer_has_v_proj(layer) else 1)
        per_row += h * qkv + nq * hd * h + 3 * h * t.intermediate_size
        per_row += t.top_k_experts * 3 * h * t.moe_intermediate_size + t.num_experts * h  # experts + router
        window = t.layer_window(layer)
        attn += sum(2 * nq * hd * _visible(window, p) for p in range(ctx - rows, ctx))  # QK^T and PV
    macs = rows * per_row + attn + logit_rows * t.vocab_size * h
    return float(2 * seqs * macs)


def drafter_cost(spec: ModelSpec, ctx: int, new_ctx_rows: float, lm_head: str = "nvfp4") -> dict:
    """{bytes, flops} of one DFlash draft: fuse the target taps of `new_ctx_rows` newly committed positions
    into the context (fc, K/V projections), then run one block of block_size rows against a context of `ctx`
    positions and take its logits through the shared lm_head. Drafter weights and K/V are bf16."""
    d, h = spec.drafter, spec.drafter.hidden_size
    rows = d.block_size
    wbytes = sum(ti.nbytes for ti in drafter_tensors(d)) + rows * h * 2 + lm_head_bytes(spec, lm_head)
    kv_row = 2 * d.num_key_value_heads * d.head_dim * 2
    macs = new_ctx_rows * h * len(d.target_layer_ids) * h  # fc over the taps
    kvbytes = 0.0
    for layer in range(d.num_hidden_layers):
        nq, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
        macs += new_ctx_rows * h * 2 * nkv * hd  # context K/V
        macs += rows * (h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * d.intermediate_size)
        window = d.layer_window(layer)
        seen = ctx if window is None else min(ctx, window)
        macs += rows * 2 * nq * hd * (seen + rows)  # block queries over context + block keys
        kvbytes += kv_row * (seen + new_ctx_rows)
    macs += rows * spec.target.vocab_size * spec.target.hidden_size
    return {"bytes": wbytes + kvbytes, "flops": 2.0 * macs}


def step_cost(
    spec: ModelSpec,
    step: str,
    ctx: int,
    rows: int = 1,
    kv: str = "bf16",
    lm_head: str = "nvfp4",
    accepted: float | None = None,
) -> dict:
    """{bytes, flops} of one step whose last token sits at position ctx-1.

    decode: `rows` sequences (the batch B) of one token each, logits for each; prefill: one chunk of `rows`
    tokens, logits for the last only; verify: one speculative step, the target's forward of a block of `rows`
    tokens (the drafter's block_size) with logits for every row, plus the draft that fed it, which fused the
    `accepted` tokens (the measured tau; default: a whole block) the step before committed."""
    if step == "decode":
        return {
            "bytes": target_weight_bytes(spec, rows, lm_head) + target_kv_bytes(spec, ctx, 1, kv, rows),
            "flops": target_flops(spec, ctx, 1, 1, rows),
        }
    if step not in ("verify", "prefill"):
        raise ValueError(f"unknown step {step!r} (decode, verify, prefill)")
    cost = {
        "bytes": target_weight_bytes(spec, rows, lm_head) + target_kv_bytes(spec, ctx, rows, kv),
        "flops": target_flops(spec, ctx, rows, rows if step == "verify" else 1),
    }
    if step == "verify":
        if spec.drafter is None:
            raise ValueError(f"model {spec.name} has no drafter: no verify step")
        draft = drafter_cost(spec, ctx - rows, float(rows if accepted is None else accepted), lm_head)
        cost = {k: cost[k] + draft[k] for k in cost}
    return cost


def roofline_entry(cost: dict, ms: float, copy_gbs: float, tc_tflops: float | None) -> dict:
    """The `roofline` JSON entry of one step: its bytes and FLOPs, the measured time, the copy bandwidth
    measured in the same run, and the achieved fractions of that and of the tensor-core ceiling."""
    seconds = ms / 1e3
    return {
        "bytes": int(cost["bytes"]),
        "flops": int(cost["flops"]),
        "ms": round(ms, 4),
        "copy_gbs": round(copy_gbs, 3),
        "frac_copy": round(cost["bytes"] / seconds / (copy_gbs * 1e9), 5),
        "frac_tc": None if tc_tflops is None else round(cost["flops"] / seconds / (tc_tflops * 1e12), 5),
    }
