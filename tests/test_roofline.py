"""Roofline arithmetic (runtime/bench/roofline.py) against hand computations on the tiny preset, and `thorgen bench
--roofline` on the reference backend."""

from __future__ import annotations

import json

import numpy as np
import pytest

from thorgen.model_spec.presets import get_preset
from thorgen.runtime.bench.roofline import (
    expected_experts,
    roofline_entry,
    step_cost,
    target_flops,
    target_kv_bytes,
    target_weight_bytes,
    tc_ceiling,
)

TINY = get_preset("tiny")  # V 512, H 256, layers S S F S S F, window 16, Hq 4; sliding Hkv 2 D 64; full Hkv 1 D 128


def nv(out_features: int, in_features: int) -> float:
    """One NVFP4 matrix by hand: nibbles + one E4M3 scale per 16 + the F32 global scale."""
    return out_features * in_features / 2 + out_features * in_features / 16 + 4


def test_decode_weight_bytes_by_hand():
    h, i, ie = 256, 256, 128
    sliding = nv(256, h) + nv(128, h) + nv(128, h) + nv(h, 256)  # q (4x64), k, v (2x64), o
    full = nv(512, h) + nv(128, h) + nv(h, 512)  # q (4x128), k (1x128) reused as V (k_eq_v), o
    dense = 2 * nv(i, h) + nv(h, i)
    experts = 4 * (2 * nv(ie, h) + nv(h, ie))  # one token touches exactly top_k = 4 of the 16 experts

    def small(d):  # q/k norms, 7 norms, router, its scales, scalar
        return 2 * (d + d + 7 * h + 16 * h + h + 16 + 1)

    layers = 4 * (sliding + dense + experts + small(64)) + 2 * (full + dense + experts + small(128))
    tail = 2 * h + 2 * h  # one embedding row + the final norm (bf16)
    assert target_weight_bytes(TINY, 1, "nvfp4") == pytest.approx(layers + tail + nv(512, h))
    assert target_weight_bytes(TINY, 1, "bf16") == pytest.approx(layers + tail + 2 * 512 * h)


def test_expected_experts_matches_sampling():
    assert expected_experts(16, 4, 1) == pytest.approx(4)
    assert expected_experts(128, 8, 1) == pytest.approx(8)
    rng = np.random.default_rng(0)
    for e, k, rows in ((16, 4, 3), (128, 8, 16), (128, 8, 64)):
        distinct = [len({x for _ in range(rows) for x in rng.choice(e, k, replace=False)}) for _ in range(3000)]
        assert expected_experts(e, k, rows) == pytest.approx(np.mean(distinct), rel=0.01)
    assert expected_experts(128, 8, 4096) == pytest.approx(128)


def test_kv_bytes_and_flops_by_hand():
    row_s, row_f = 2 * 2 * 64 * 2, 2 * 1 * 128 * 2  # K and V of one position, bf16
    # decode at ctx 100: sliding layers see 16 keys, full layers 100; one new row written in each
    assert target_kv_bytes(TINY, 100, 1) == 4 * row_s * (16 + 1) + 2 * row_f * (100 + 1)
    assert target_kv_bytes(TINY, 100, 1, "fp8", seqs=3) == 3 * (4 * row_s * 17 + 2 * row_f * 101) / 2
    # a 16-row block ending at ctx 100: its queries see positions 69..99 (sliding), 0..99 (full); 16 written
    assert target_kv_bytes(TINY, 100, 16) == 4 * row_s * (31 + 16) + 2 * row_f * (100 + 16)
    lin_s = 256 * (256 + 128 + 128) + 256 * 256  # qkv, o
    lin_f = 256 * (512 + 128) + 512 * 256
    per_layer = 3 * 256 * 256 + 4 * 3 * 256 * 128 + 16 * 256  # dense MLP, 4 experts, router
    macs = 4 * (lin_s + per_layer) + 2 * (lin_f + per_layer)
    attn = 4 * (2 * 4 * 64 * 16) + 2 * (2 * 4 * 128 * 100)  # QK^T + PV at position 99
    assert target_flops(TINY, 100, 1, 1) == 2 * (macs + attn + 512 * 256)
    # a prefill chunk of 3 rows at positions 0..2: each sees 1, 2, 3 keys; logits for the last row only
    attn3 = sum(4 * 2 * 4 * 64 * p + 2 * 2 * 4 * 128 * p for p in (1, 2, 3))
    assert target_flops(TINY, 3, 3, 1) == 2 * (3 * macs + attn3 + 512 * 256)


def test_step_costs_compose():
    decode = step_cost(TINY, "decode", 100, rows=1)
    assert decode["bytes"] == target_weight_bytes(TINY, 1) + target_kv_bytes(TINY, 100, 1)
    batch = step_cost(TINY, "decode", 100, rows=8)  # 8 sequences: experts shared, K/V and FLOPs per sequence
    assert batch["bytes"] == target_weight_bytes(TINY, 8) + 8 * target_kv_bytes(TINY, 100, 1)
    assert batch["flops"] == 8 * decode["flops"]
    prefill = step_cost(TINY, "prefill", 64, rows=64)
    assert prefill["flops"] == target_flops(TINY, 64, 64, 1)
    verify = step_cost(TINY, "verify", 116, rows=16, accepted=2.0)
    target_only = target_weight_bytes(TINY, 16) + target_kv_bytes(TINY, 116, 16)
    assert verify["bytes"] > target_only and verify["flops"] > target_flops(TINY, 116, 16, 16)
    assert step_cost(TINY, "verify", 116, rows=16, accepted=16.0)["flops"] > verify["flops"]  # more to fuse
    with pytest.raises(ValueError):
        step_cost(TINY, "sample", 10)


def test_roofline_entry_fractions():
    e = roofline_entry({"bytes": 1e9, "flops": 1e11}, ms=1.0, copy_gbs=4000.0, tc_tflops=788.0)
    assert set(e) == {"bytes", "flops", "ms", "copy_gbs", "frac_copy", "frac_tc"}
    assert e["frac_copy"] == pytest.approx(0.25)  # 1 TB/s of 4 TB/s
    assert e["frac_tc"] == pytest.approx(100 / 788, abs=1e-5)  # 100 TFLOP/s
    assert roofline_entry({"bytes": 1, "flops": 1}, 1.0, 1.0, None)["frac_tc"] is None
    assert tc_ceiling("NVIDIA H200") == 788.0 and tc_ceiling("none (cpu: x86_64)") is None


def test_bench_roofline_on_the_reference_backend(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    out = tmp_path / "r.json"
    res = CliRunner().invoke(
        bench,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-len",
            "24",
            "--gen",
            "6",
            "--runs",
            "1",
            "--ctx",
            "256",
            "--roofline",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    rl = r["roofline"]
    assert set(rl) == {"decode", "prefill", "verify"}
    for step, e in rl.items():
        assert set(e) == {"bytes", "flops", "ms", "copy_gbs", "frac_copy", "frac_tc"}, step
        assert e["ms"] > 0 and e["frac_tc"] is None and e["copy_gbs"] == r["copy_gb_s"]
        assert e["frac_copy"] == pytest.approx(e["bytes"] / (e["ms"] / 1e3) / (e["copy_gbs"] * 1e9), rel=1e-3)
    assert rl["decode"]["ms"] == r["step_ms"]
    assert rl["decode"]["bytes"] == int(step_cost(TINY, "decode", 24 + 3, 1, "bf16", "bf16")["bytes"])
    assert rl["prefill"]["ms"] == r["ttft_ms"]
    assert rl["prefill"]["flops"] == int(step_cost(TINY, "prefill", 24, 24, "bf16", "bf16")["flops"])
    assert 1.0 <= r["speculative_tau"] <= 16
    assert "roofline prefill" in res.output


def test_format_footprint_by_hand_and_against_the_facts():
    from thorgen.runtime.bench.roofline import format_footprint
    from thorgen.model_spec.types import ALL_BF16, ALL_NVFP4, EXPERTS_ONLY_NVFP4

    fp4 = format_footprint(TINY, ALL_NVFP4)
    assert fp4["decode"]["total"] == pytest.approx(target_weight_bytes(TINY, 1))  # the decode roofline's bytes
    h, i, ie = 256, 256, 128
    bf = lambda o, k: 2 * o * k  # noqa: E731
    attn = 4 * (bf(256, h) + 2 * bf(128, h) + bf(h, 256)) + 2 * (bf(512, h) + bf(128, h) + bf(h, 512))
    exp_only = format_footprint(TINY, EXPERTS_ONLY_NVFP4)
    assert exp_only["decode"]["attention"] == attn and exp_only["memory"]["attention"] == attn
    assert exp_only["decode"]["dense_mlp"] == 6 * 3 * bf(i, h)
    assert exp_only["decode"]["experts"] == fp4["decode"]["experts"] == 6 * 4 * (2 * nv(ie, h) + nv(h, ie))
    assert fp4["memory"]["experts"] == 4 * fp4["decode"]["experts"]  # 16 experts resident, top-4 read
    assert format_footprint(TINY, ALL_BF16)["decode"]["experts"] == 6 * 4 * 3 * bf(ie, h)
    # full size: facts/MODELOPT_NVFP4.md's 4.09 GB (bf16 attention + MLP, 8 of 128 experts) and 1.73 GB (all FP4),
    # both without the lm_head
    full = get_preset("gemma-4-26b-a4b")

    def no_head(formats):
        return sum(format_footprint(full, formats)["decode"][k] for k in ("attention", "dense_mlp", "experts"))

    assert no_head(EXPERTS_ONLY_NVFP4) / 1e9 == pytest.approx(4.09, abs=0.01)
    assert no_head(ALL_NVFP4) / 1e9 == pytest.approx(1.73, abs=0.01)
