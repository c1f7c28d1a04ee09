"""The vision.encode step program (codegen/lower_vision.py) run launch by launch on the CPU emulator's kernel
stand-ins (tests/emulated_vision.py), over weights rewritten by runtime/convert/vision.py (padded to the tiles),
against a float64 tower on the unpadded checkpoint weights (VISION_FACTS §1's formulas); and each vision kernel's
reference against that tower's own steps."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import emulated_vision as EV
import reference_kernels as RK
from emulated_kernels import KernelEmulator
from fake_driver import FakeDriver
from matmul_reference import gelu_tanh
from thorgen.codegen.arch import get_arch
from thorgen.codegen.families import MAX_STEP_TOKENS
from thorgen.codegen.lower import Lower
from thorgen.codegen.lower_vision import LowerVision
from thorgen.codegen.symbols import LaneBytes, Sym
from thorgen.model_spec.nvfp4 import bf16_to_f32, f32_to_bf16
from thorgen.model_spec.presets import get_preset
from thorgen.model_spec.synth.weights import bf16_chunks
from thorgen.model_spec.tensors import vision_tensors as checkpoint_vision_tensors
from thorgen.model_spec.vision_layout import PATCH_ACTS, TOKEN_ACTS, act_width, vision_dims, vision_tensors
from thorgen.runtime.backend import PIXEL_UNIT
from thorgen.runtime.convert.vision import vision_arrays

F64 = np.float64
NP = {"u8": np.uint8, "f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32, "half": np.uint16}


def _checkpoint(spec, seed: int = 0) -> dict[str, np.ndarray]:
    """Tower weights in the checkpoint's form (bf16 bits; std vectors f32), drawn by the synthetic checkpoint's own
    rules (model_spec/synth/weights.py): q_norm / k_norm ~ head_dim^-1/4, so the scale-1 attention logits have
    std ~1. Unit-rms q and k (norm weights ~1) would give logits of std ~sqrt(72) and one-hot attention, a tower so
    chaotic that bf16 rounding of q and k alone moves the float64 tower's output by 0.86 over the real 27 layers
    (measured at the 6x9 grid): no kernel could be checked against it."""
    out = {}
    for t in checkpoint_vision_tensors(spec.vision, spec.target.hidden_size):
        out[t.name] = np.concatenate(list(bf16_chunks(t, seed, spec.target.hidden_size))).reshape(t.shape)
    for name in ("std_bias", "std_scale"):
        out[f"model.vision_tower.{name}"] = bf16_to_f32(out[f"model.vision_tower.{name}"])
    return out


def _w(ck, name):
    return bf16_to_f32(ck[name]).astype(F64)


def tower_f64(spec, ck, patches: np.ndarray, pos: np.ndarray, qk_bf16: bool = False) -> np.ndarray:
    """HF Gemma4VisionModel + embed_vision over valid patches (float64, unpadded); `qk_bf16`: q and k rounded to
    bf16 after RoPE, as the kernels store them."""
    v, d = spec.vision, vision_dims(spec)
    P, eps = "model.vision_tower.", d.eps

    def rms(x, w=None):
        y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
        return y if w is None else y * w

    table = _w(ck, P + "patch_embedder.position_embedding_table")
    x = (
        (2 * (patches - 0.5)) @ _w(ck, P + "patch_embedder.input_proj.weight").T
        + table[0][pos[:, 0]]
        + table[1][pos[:, 1]]
    )
    L = x.shape[0]
    for l in range(v.num_hidden_layers):
        p = f"{P}encoder.layers.{l}."
        h = rms(x, _w(ck, p + "input_layernorm.weight"))
        q, k, vv = (h @ _w(ck, f"{p}self_attn.{n}_proj.linear.weight").T for n in "qkv")
        q, k, vv = (t.reshape(L, d.heads, d.head_dim) for t in (q, k, vv))
        q = EV.rope2d(rms(q, _w(ck, p + "self_attn.q_norm.weight")), pos, d.theta)
        k = EV.rope2d(rms(k, _w(ck, p + "self_attn.k_norm.weight")), pos, d.theta)
        if qk_bf16:
            q, k = (bf16_to_f32(RK.store(t, "bf16")).astype(F64) for t in (q, k))
        vv = rms(vv)
        s = np.einsum("qhd,khd->hqk", q, k)
        pr = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", pr / pr.sum(-1, keepdims=True), vv).reshape(L, -1)
        x = x + rms(o @ _w(ck, p + "self_attn.o_proj.linear.weight").T, _w(ck, p + "post_attention_layernorm.weight"))
        h2 = rms(x, _w(ck, p + "pre_feedforward_layernorm.weight"))
        gate, up = (h2 @ _w(ck, f"{p}mlp.{n}_proj.linear.weight").T for n in ("gate", "up"))
        m = gelu_tanh(gate) * up
        x = x + rms(m @ _w(ck, p + "mlp.down_proj.linear.weight").T, _w(ck, p + "post_feedforward_layernorm.weight"))
    gw = int(pos[-1, 0]) + 1
    cells = x.reshape(L // gw // 3, 3, gw // 3, 3, -1).mean(axis=(1, 3)).reshape(-1, x.shape[1])
    s = (cells * math.sqrt(d.hidden) - ck[P + "std_bias"]) * ck[P + "std_scale"]
    return rms(s) @ _w(ck, "model.embed_vision.embedding_projection.weight").T


def _image(gw: int, gh: int, patch_dim: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ys, xs = np.divmod(np.arange(gw * gh), gw)
    return rng.integers(0, 256, (gw * gh, patch_dim), np.uint8), np.stack([xs, ys], 1).astype(np.int32)


def pixels(patches: np.ndarray) -> np.ndarray:
    """uint8 patches as the float64 [0, 1] pixels the float64 tower takes (the processor's float32 rescale)."""
    return PIXEL_UNIT[patches].astype(F64)


def _grid(kernel, rows: int, images: int | None = None) -> tuple[int, int, int]:
    """The launch grid by the kernel's planned rule (runtime/cuda/programs.py's _grid)."""
    p, g = kernel.param_dict, list(kernel.grid)
    if "IMAGE_AXIS" in p and images is not None:
        g[p["IMAGE_AXIS"]] = images
    if "ROW_GRID" in p:
        axis, mul, div, *cap = p["ROW_GRID"]
        g[axis] = min(-(-rows * mul // div), *(cap or [g[axis]]))
    elif "ROW_AXIS" in p:
        g[p["ROW_AXIS"]] = min(rows, g[p["ROW_AXIS"]])
    return tuple(g)


def run_encode(spec, ck, patches, pos, arch_name: str = "sm_90a", images: int = 1) -> np.ndarray:
    """vision.encode of one image (or of `images` images of one grid, their patches and positions back to back) on
    the emulator: the lowered launches, symbols bound to fake device memory."""
    d, drv = vision_dims(spec), FakeDriver(None)
    drv.cuCtxSetCurrent("ctx")
    arrays = vision_arrays(spec, ck.__getitem__, lambda n: np.asarray(ck[n], np.float32))

    def alloc(arr: np.ndarray) -> int:
        _, addr = drv.cuMemAlloc(arr.nbytes)
        drv.view(addr, np.uint8, arr.nbytes)[:] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        return addr

    weights = {n: alloc(a) for n, a in arrays.items()}
    L, N = len(patches), len(patches) // d.pool_rows
    acts = {}
    for name, (width, dt) in {**PATCH_ACTS, **TOKEN_ACTS}.items():
        rows = L if name in PATCH_ACTS else N
        acts[name] = alloc(
            np.full((rows, act_width(d, width)), 0xFF, np.uint8).view(np.uint8).repeat(np.dtype(NP[dt]).itemsize, 1)
        )
    drv.view(acts["vis_patches"], np.uint8, patches.shape)[:] = patches
    drv.view(acts["vis_pos"], np.int32, pos.shape)[:] = pos
    emu = KernelEmulator(drv)

    def bind(v):
        if isinstance(v, Sym):
            if v.kind == "NULL":
                return 0
            base = weights[v.name] if v.kind == "W" else acts[v.name]
            assert v.row == 0, "the vision program addresses whole buffers"
            return base + v.off
        assert not isinstance(v, LaneBytes)
        return v

    low = LowerVision(Lower(spec, get_arch(arch_name), "bf16", MAX_STEP_TOKENS))
    for op in low.encode_ops(N // images, images):
        grid = _grid(op.entry, op.rows, op.args.get("B"))
        emu.run(op.entry.name, op.entry.to_json(), {k: bind(v) for k, v in op.args.items()}, grid)
    return drv.view(acts["vis_out"], np.float32, (N, d.text_hidden)).astype(F64)


# The program against the float64 tower (norm_err): measured on the emulator 1.0e-3 / 1.3e-3 (tiny, 6x9 / 12x3) and
# 1.7e-3 / 1.7e-3 (full-size tower, 27 layers): the fp16 GEMM inputs, bf16 q / k / v and probabilities.
TOL_ENCODE = 5e-3


def with_layers(spec, layers: int):
    """`spec` with a tower of `layers` encoder layers (the full width at a CPU-test cost)."""
    return dataclasses.replace(spec, vision=dataclasses.replace(spec.vision, num_hidden_layers=layers))


@pytest.mark.parametrize(
    "preset,layers,gw,gh", [("tiny", None, 6, 9), ("tiny", None, 12, 3), ("gemma-4-26b-a4b", 2, 12, 3)]
)
def test_encode_program_matches_the_float64_tower(preset, layers, gw, gh):
    """Tiny, and the full-size tower's shapes (16 heads of 72 padded to 128, hidden 1152, intermediate 4304 padded
    to 4352, several row tiles and query blocks) on two of its layers."""
    spec = get_preset(preset)
    spec = with_layers(spec, layers) if layers else spec
    ck = _checkpoint(spec)
    patches, pos = _image(gw, gh, spec.vision.patch_dim)
    out, ref = run_encode(spec, ck, patches, pos), tower_f64(spec, ck, pixels(patches), pos)
    assert out.shape == ref.shape == (gw * gh // 9, spec.target.hidden_size)
    assert np.isfinite(out).all()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL_ENCODE, err


@pytest.mark.parametrize(
    "preset,layers,gw,gh,images", [("tiny", None, 6, 9, 2), ("tiny", None, 12, 3, 3), ("gemma-4-26b-a4b", 1, 12, 3, 2)]
)
def test_images_encoded_together_equal_each_alone(preset, layers, gw, gh, images):
    """The program for several images of one grid (patches back to back) gives each image's rows bit for bit as
    its encode alone: the attention and the pool keep to each image's rows, the rest is row-wise. The images
    differ, so rows attending (or pooling) across images would show."""
    spec = get_preset(preset)
    spec = with_layers(spec, layers) if layers else spec
    ck = _checkpoint(spec)
    shots = [_image(gw, gh, spec.vision.patch_dim, seed=5 + i) for i in range(images)]
    alone = [run_encode(spec, ck, patches, pos) for patches, pos in shots]
    together = run_encode(
        spec, ck, np.concatenate([p for p, _ in shots]), np.concatenate([q for _, q in shots]), images=images
    )
    n = gw * gh // 9
    assert together.shape == (images * n, spec.target.hidden_size)
    for i, rows in enumerate(alone):
        np.testing.assert_array_equal(together[i * n : (i + 1) * n], rows)
    assert not np.array_equal(alone[0], alone[1])


def test_the_test_tower_is_well_conditioned():
    """The oracle can tell a kernel bug from rounding: rounding q and k to bf16 (what the kernels store) moves the
    float64 full-size tower, all 27 layers, by far less than TOL_ENCODE (measured 8.0e-4). With unit q_norm /
    k_norm weights it moved by 0.86, which hid every kernel behind chaos."""
    spec = get_preset("gemma-4-26b-a4b")
    ck = _checkpoint(spec)
    patches, pos = _image(6, 9, spec.vision.patch_dim)
    ref = tower_f64(spec, ck, pixels(patches), pos)
    rounded = tower_f64(spec, ck, pixels(patches), pos, qk_bf16=True)
    assert np.linalg.norm(rounded - ref) / np.linalg.norm(ref) < TOL_ENCODE / 4


def test_a_wrong_pool_order_is_caught():
    """The check has teeth: the tower with its patch rows transposed (column-major grid) differs."""
    spec = get_preset("tiny")
    ck = _checkpoint(spec)
    patches, pos = _image(6, 9, spec.vision.patch_dim)
    out = run_encode(spec, ck, patches, pos)
    swapped = tower_f64(spec, ck, pixels(patches), pos[:, ::-1].copy())
    assert np.linalg.norm(out - swapped) / np.linalg.norm(swapped) > 0.05


def test_artifact_layout_shapes_and_zero_padding():
    spec = get_preset("tiny")
    d = vision_dims(spec)
    arrays = vision_arrays(spec, _checkpoint(spec).__getitem__, lambda n: np.float32(_checkpoint(spec)[n]))
    assert set(arrays) == set(vision_tensors(spec))
    from thorgen.runtime.convert.layouts import unpack_half

    o = unpack_half(arrays["vision.layers.0.o"], d.hidden, d.heads * d.dp).reshape(d.hidden, d.heads, d.dp)
    assert (o[:, :, d.head_dim :] == 0).all() and (o[:, :, : d.head_dim] != 0).any()
    down = unpack_half(arrays["vision.layers.0.down"], d.hidden, d.ip)
    assert (down[:, d.intermediate :] == 0).all()


def test_kernel_references_against_the_towers_steps():
    """Each kernel reference (emulated_vision) reproduces its step of the float64 tower within its tolerance."""
    spec = get_preset("tiny")
    d = vision_dims(spec)
    rng = np.random.default_rng(3)
    qkv = rng.normal(0, 1, (18, 3 * d.hidden)).astype(np.float32)
    pos = _image(6, 3, 1)[1]
    w = f32_to_bf16(rng.uniform(0.5, 1.5, d.head_dim).astype(np.float32))
    q, k, v = EV.qkv_rope_ref(qkv, w, w, pos, d.heads, d.head_dim, d.dp, d.theta, d.eps)
    assert (bf16_to_f32(q)[..., d.head_dim :] == 0).all()
    raw = qkv.astype(F64).reshape(18, 3, d.heads, d.head_dim)
    want = EV.rope2d(
        raw[:, 0] / np.sqrt((raw[:, 0] ** 2).mean(-1, keepdims=True) + d.eps) * bf16_to_f32(w), pos, d.theta
    )
    got = bf16_to_f32(q)[..., : d.head_dim]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < EV.TOL_VIS_ROPE
    # rotation keeps each half's norm: a wrong pair distance would not
    assert np.allclose(
        np.linalg.norm(want[..., :36], axis=-1),
        np.linalg.norm(
            raw[:, 0, :, :36] / np.sqrt((raw[:, 0] ** 2).mean(-1, keepdims=True) + d.eps) * bf16_to_f32(w)[:36], axis=-1
        ),
    )
