"""The weight tile one source feeds to both stages: the t16x64 params codegen renders into the weight kernels are the
repack's (model_spec/weight_layout.py), thorgen/nvfp4.cuh holds the same numbers and every tile kernel asserts them
at compile time, and bytes the repack packs, read the way nvfp4.cuh's load_step and decoders read them at a planned
kernel's tile, give back the checkpoint's matrix."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from thorgen.codegen.arch import ARCHS, get_arch
from thorgen.codegen.plan import plan
from thorgen.codegen.render import INCLUDE_DIR, KERNELS_DIR, render
from thorgen.model_spec import weight_layout as WL
from thorgen.model_spec.nvfp4 import E2M1_VALUES, e4m3_to_f32, unpack_e2m1
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.convert import layouts as L
from thorgen.runtime.convert import plan as RP
from thorgen.runtime.convert.linears import pack_bf16_linear

HEADER = INCLUDE_DIR / "thorgen" / "nvfp4.cuh"


def header_constants() -> dict[str, float]:
    """nvfp4.cuh's tile constants (`constexpr int NAME = expr;`, evaluated in order) and the "shift" decode factor."""
    text = HEADER.read_text()
    out: dict[str, float] = {}
    for name, expr in re.findall(r"^constexpr int (\w+) = ([^;]+);", text, re.M):
        out[name] = eval(expr.replace("/", "//"), {}, dict(out))  # integer C arithmetic on names defined above
    factor = re.search(r"struct DecodeFactor<FP4_SHIFT> \{ static constexpr float value = ([0-9.]+)f; \}", text)
    assert factor, "nvfp4.cuh: no DecodeFactor<FP4_SHIFT>"
    out["SHIFT_DECODE_FACTOR"] = float(factor.group(1))
    return out


def tile_kernels(preset: str, arch: str):
    return [k for k in plan(get_preset(preset), get_arch(arch)) if "w_layout" in k.param_dict]


def test_header_holds_the_python_tile() -> None:
    c = header_constants()
    assert (c["W_TILE_N"], c["W_TILE_K"], c["W_LANES"]) == (WL.TILE_N, WL.TILE_K, WL.LANES)
    assert (c["FP4_LANE_BYTES"], c["SCALE_LANE_BYTES"], c["HALF_LANE_BYTES"]) == (
        WL.FP4_LANE_BYTES,
        WL.SCALE_LANE_BYTES,
        WL.HALF_LANE_BYTES,
    )
    assert c["SHIFT_DECODE_FACTOR"] == WL.SHIFT_DECODE_FACTOR
    assert WL.STEP_BYTES == WL.LANES * WL.FP4_LANE_BYTES == WL.TILE_N * WL.TILE_K // 2


@pytest.mark.parametrize("preset,arch", [("tiny", a) for a in ARCHS] + [("gemma-4-26b-a4b", "sm_90a")])
def test_kernel_params_are_the_repacks_tile(preset: str, arch: str) -> None:
    """Every weight kernel carries the tile, layout name and fp4 byte order that the repack packs with."""
    kernels = tile_kernels(preset, arch)
    assert {k.family for k in kernels} >= {"matmul", "moe", "moe_grouped"}
    for k in kernels:
        p = k.param_dict
        assert (p["tile_n"], p["tile_k"]) == (L.TILE_N, L.TILE_K), k.name
        assert p["w_layout"] == WL.W_LAYOUT and p["fp4_order"] == RP.fp4_order(arch), k.name
        assert p["kind"] in ("half", RP.fp4_order(arch)), k.name
    assert get_arch(arch).has_fp4_cvt == (RP.fp4_order(arch) == "nat")


def test_every_tile_kernel_asserts_its_tile() -> None:
    """The templates that include the tile check are exactly those of the planned weight kernels, and each rendered
    source asserts the planned tile against the header's."""
    spec, arch = get_preset("tiny"), get_arch("sm_90a")
    planned = {k.template for k in plan(spec, arch) if "w_layout" in k.param_dict}
    checking = {p.name for p in KERNELS_DIR.glob("*.cu.j2") if '{% include "_w_tile.inc.j2" %}' in p.read_text()}
    assert planned == checking
    line = f"static_assert(thorgen::W_TILE_N == {WL.TILE_N} && thorgen::W_TILE_K == {WL.TILE_K},"
    for k in tile_kernels("tiny", "sm_90a"):
        assert line in render(k, arch, spec.spec_hash), k.name


# ---- the bytes, read as nvfp4.cuh reads them ----------------------------------------------------------------------


def _shift_decode(v: np.ndarray) -> list[np.ndarray]:
    """nvfp4.cuh fp4_shift_decode, on uint32 words (the multiplies wrap at 32 bits as on the GPU)."""
    v = v.astype(np.uint64)
    m, w = np.uint64(0x8E008E00), np.uint64(0xFFFFFFFF)
    return [
        (v & m),
        ((v << np.uint64(3)) & m),
        (((v & np.uint64(0x40384038)) * np.uint64(66)) & w) & m,
        (((v & np.uint64(0x20072007)) * np.uint64(516)) & w) & m,
    ]


def _half2(reg: np.ndarray) -> np.ndarray:
    """uint32 registers [...] -> float64 [..., 2] (low half, high half)."""
    r = reg.astype(np.uint32)
    lo = (r & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
    hi = (r >> np.uint32(16)).astype(np.uint16).view(np.float16)
    return np.stack([lo, hi], axis=-1).astype(np.float64)


def read_as_kernel(
    kind: str, w: np.ndarray, s: np.ndarray | None, gscale: np.ndarray | None, n: int, k: int, tile_n: int, tile_k: int
) -> np.ndarray:
    """The float64 [n, k] matrix a kernel of weight kind `kind` and tile (tile_n, tile_k) multiplies with: load_step
    (idx = (step * units + unit) * W_LANES + lane, a lane's bytes at idx * its bytes per lane), decode_step (tile t's
    words / uint4s, register (word, q) = codes 8 word + 2q, +1; the scale u16's low byte for tile 0), DecodeFactor
    and tile_factor (one multiplier a GSCALE_ROWS-row tile), all with nvfp4.cuh's own constants."""
    c = header_constants()
    lanes = c["W_LANES"]
    units, steps = n // tile_n, k // tile_k
    step, unit, lane = np.meshgrid(np.arange(steps), np.arange(units), np.arange(lanes), indexing="ij")
    idx = ((step * units + unit) * lanes + lane).reshape(-1)
    if kind == "half":
        lb = c["HALF_LANE_BYTES"]
        raw = w.view(np.uint8)[(idx[:, None] * lb + np.arange(lb)).reshape(-1)].reshape(-1, 2, lb // 2)
        vals = raw.view(np.uint16).view(np.float16).astype(np.float64)  # [.., tile, 16 k]: q[2t], q[2t + 1]
    else:
        lb, sb = c["FP4_LANE_BYTES"], c["SCALE_LANE_BYTES"]
        words = w[(idx[:, None] * lb + np.arange(lb)).reshape(-1)].reshape(-1, 2, 2, 4).view(np.uint32)[..., 0]
        if kind == "shift":
            regs = np.stack(_shift_decode(words), axis=-1)  # [.., tile, word, q]
            codes = _half2(regs) * c["SHIFT_DECODE_FACTOR"]  # [.., tile, word, q, half]
        else:  # nat: cvt.rn.f16x2.e2m1x2 of byte q of the word, its low nibble the low half
            byte = words[..., None] >> (8 * np.arange(4, dtype=np.uint32))
            codes = np.stack([E2M1_VALUES[byte & 0xF], E2M1_VALUES[(byte >> 4) & 0xF]], axis=-1).astype(np.float64)
        two = s[(idx[:, None] * sb + np.arange(sb)).reshape(-1)].reshape(-1, 2)  # tile 0's scale in the low byte
        vals = codes.reshape(-1, 2, 16) * e4m3_to_f32(two).astype(np.float64)[:, :, None]
    # [steps, units, lanes = 4 gid + t4, tile, e] -> row 16 unit + 8 tile + gid, input 64 step + 16 t4 + e
    out = vals.reshape(steps, units, lanes // 4, 4, 2, 16).transpose(1, 4, 2, 0, 3, 5).reshape(n, k)
    if gscale is not None:
        out = out * np.repeat(gscale.astype(np.float64), WL.GSCALE_ROWS)[:, None]
    return out


def _checkpoint_nvfp4(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    scale = rng.integers(0x20, 0x60, size=(n, k // WL.GROUP), dtype=np.uint8)  # finite, no NaN codes
    return packed, scale


def _dense(packed: np.ndarray, scale: np.ndarray, mult: float) -> np.ndarray:
    vals = E2M1_VALUES[unpack_e2m1(packed)].astype(np.float64)
    return vals * np.repeat(e4m3_to_f32(scale).astype(np.float64), WL.GROUP, axis=1) * np.float64(np.float32(mult))


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_repacked_bytes_read_back_at_the_kernels_tile(arch: str) -> None:
    """Each NVFP4 GEMV of the tiny plan: the repack's bytes of a random checkpoint matrix (single, or gate/up
    interleaved for the GELU ones, each part its own multiplier) read as the kernel reads them equal the matrix."""
    rng = np.random.default_rng(0)
    kernels = [k for k in tile_kernels("tiny", arch) if k.name.startswith("nvfp4_gemv__")]
    assert kernels
    for kern in kernels:
        n, kk, order = kern.param("n"), kern.param("k"), RP.fp4_order(arch)
        assert kern.param("kind") == order
        if kern.param("epi") == "gelu_mul":
            m = RP.Matrix("mlp.gate_up_proj", "interleave8", (("mlp.gate_proj", n // 2), ("mlp.up_proj", n // 2)), kk)
        else:
            m = RP.Matrix("o_proj", "single", (("o_proj", n),), kk)
        parts = [(*_checkpoint_nvfp4(rng, rows, kk), float(rng.uniform(1e-3, 2e-3))) for _, rows in m.parts]
        w, s, tiles = RP.pack_matrix(m, parts, order)
        got = read_as_kernel(order, w, s, tiles, n, kk, kern.param("tile_n"), kern.param("tile_k"))
        dense = [_dense(p, sc, g) for p, sc, g in parts]
        want = L.interleave8(*dense) if m.fusion == "interleave8" else dense[0]
        np.testing.assert_array_equal(got, want, err_msg=kern.name)


def test_half_bytes_read_back_at_the_kernels_tile() -> None:
    """The drafter's fp16 GEMMs: the repack's half layout of a bf16 matrix read as the HALF kind reads it."""
    rng = np.random.default_rng(1)
    kernels = [k for k in tile_kernels("tiny", "sm_90a") if k.param("kind") == "half"]
    assert kernels
    for kern in kernels:
        n, kk = kern.param("n"), kern.param("k")
        bits = (rng.standard_normal((n, kk)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        w = pack_bf16_linear([bits], "single")
        got = read_as_kernel("half", w, None, None, n, kk, kern.param("tile_n"), kern.param("tile_k"))
        np.testing.assert_array_equal(got, L.bf16_to_f16_bits(bits).view(np.float16).astype(np.float64))


def test_the_reader_sees_a_wrong_tile() -> None:
    """Guard against a reader that cannot fail: the same bytes read at another tile are not the matrix."""
    rng = np.random.default_rng(2)
    packed, scale = _checkpoint_nvfp4(rng, 64, 256)
    w, s = L.pack_nvfp4(packed, scale, "nat")
    ones = np.ones(64 // WL.GSCALE_ROWS, np.float32)
    np.testing.assert_array_equal(
        read_as_kernel("nat", w, s, ones, 64, 256, WL.TILE_N, WL.TILE_K), _dense(packed, scale, 1.0)
    )
    assert not np.array_equal(
        read_as_kernel("nat", w, s, ones, 64, 256, 2 * WL.TILE_N, WL.TILE_K // 2), _dense(packed, scale, 1.0)
    )


def test_a_planted_tile_fails_to_compile(tmp_path: Path) -> None:
    """nvcc refuses a kernel rendered with a tile other than the header's (the static_assert every tile kernel
    carries), and accepts the real one."""
    from thorgen.codegen.nvcc import CompileError, NvccNotFound, compile_cubin, find_nvcc
    from thorgen.codegen.render import _environment

    try:
        nvcc = find_nvcc()
    except NvccNotFound as exc:
        pytest.skip(str(exc))
    check = _environment().get_template("_w_tile.inc.j2")
    for tile_n, ok in ((WL.TILE_N, True), (2 * WL.TILE_N, False)):
        src = tmp_path / f"tile{tile_n}.cu"
        src.write_text(
            '#include "thorgen/nvfp4.cuh"\n'
            + check.render(tile_n=tile_n, tile_k=WL.TILE_K)
            + 'extern "C" __global__ void probe() {}\n'
        )
        cubin = tmp_path / f"tile{tile_n}.cubin"
        if ok:
            compile_cubin("probe", src, cubin, get_arch("sm_90a"), INCLUDE_DIR, nvcc)
        else:
            with pytest.raises(CompileError, match="weight tile"):
                compile_cubin("probe", src, cubin, get_arch("sm_90a"), INCLUDE_DIR, nvcc)
