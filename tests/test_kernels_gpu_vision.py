"""GPU tests: the vision tower's kernels as the vision.encode program launches them (tiny and full-size tower
shapes) against the float64 tower of tests/test_vision_program.py (each kernel alone:
tests/test_kernels_gpu_vision_parts.py), and the sliding layers' image-bounded chunk
attention (attn_pre ..._kvhi): with an image span in the chunk against the float64 reference with the span's keys
visible both ways, with no span bit for bit the plain chunk kernel. Skip without a GPU / cuda-python / nvcc."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling helpers under --import-mode=importlib
import matmul_reference as R  # noqa: E402
from gpu_harness import PRESETS, GpuRunner, bits  # noqa: E402
from test_kernels_gpu_attention import _build, _run  # noqa: E402
from test_vision_program import NP, TOL_ENCODE, _checkpoint, _grid, _image, pixels, tower_f64  # noqa: E402
from thorgen.codegen.families import MAX_STEP_TOKENS  # noqa: E402
from thorgen.codegen.lower import Lower  # noqa: E402
from thorgen.codegen.lower_vision import LowerVision  # noqa: E402
from thorgen.codegen.symbols import Sym  # noqa: E402
from thorgen.model_spec.vision_layout import PATCH_ACTS, TOKEN_ACTS, act_width, vision_dims  # noqa: E402
from thorgen.runtime.convert.vision import vision_arrays  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=PRESETS)
def runner(request):
    return GpuRunner(request.param, ("vision", "attention"))


def encode_on_gpu(r: GpuRunner, ck: dict, patches: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """vision.encode of one image: the lowered launches on the GPU, symbols bound to rig buffers."""
    from thorgen.runtime.cuda.kernels import Ptr

    spec, rig = r.spec, r.rig
    d = vision_dims(spec)
    arrays = vision_arrays(spec, ck.__getitem__, lambda n: np.asarray(ck[n], np.float32))
    weights = {n: rig.upload(a) for n, a in arrays.items()}
    L, N = len(patches), len(patches) // d.pool_rows
    acts = {
        name: rig.alloc((L if name in PATCH_ACTS else N) * act_width(d, width) * np.dtype(NP[dt]).itemsize)
        for name, (width, dt) in {**PATCH_ACTS, **TOKEN_ACTS}.items()
    }
    acts["vis_patches"].upload(np.ascontiguousarray(patches, np.uint8))
    acts["vis_pos"].upload(np.ascontiguousarray(pos, np.int32))

    def bind(v):
        if isinstance(v, Sym):
            if v.kind == "NULL":
                return None
            return Ptr((weights if v.kind == "W" else acts)[v.name].ptr + v.off)
        return v  # (a plain int: the launch sizes it as the kernel declares, as the runtime's binding does)

    try:
        ops = LowerVision(Lower(spec, r.arch, "bf16", MAX_STEP_TOKENS)).encode_ops(N)
        r.add([op.entry for op in ops if op.entry.name not in r.kernels])
        for op in ops:
            rig.launch(
                op.entry.name, [bind(op.args[n]) for n in op.entry.args], _grid(op.entry, op.rows, op.args.get("B"))
            )
        return rig.download(acts["vis_out"], (N, d.text_hidden), np.float32).astype(np.float64)
    finally:
        rig.free()


@pytest.mark.parametrize("gw,gh", [(6, 9), (12, 3)])
def test_encode_program_matches_the_float64_tower(runner, gw, gh):
    """The whole tower (the full-size one: 27 layers) against float64, and the same bits on a second run (a race or
    a read of unwritten memory would move them)."""
    spec = runner.spec
    ck = _checkpoint(spec)
    patches, pos = _image(gw, gh, spec.vision.patch_dim)
    out = encode_on_gpu(runner, ck, patches, pos)
    ref = tower_f64(spec, ck, pixels(patches), pos)
    assert np.isfinite(out).all()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < TOL_ENCODE, err
    assert np.array_equal(encode_on_gpu(runner, ck, patches, pos), out)  # (finite: exact comparison)


def test_image_bounded_chunk_attention(runner):
    kernels = [k for k in runner.kernels.values() if k.name.endswith("_kvhi")]
    assert kernels, "the plan has no image-bounded chunk attention"
    rng = np.random.default_rng(11)
    failures = []
    for kern in kernels:
        plain = runner.kernels[kern.name[: -len("_kvhi")]]
        ring = kern.param("ring")
        for m, p0 in ((77, 0), (100, 2 * ring + 5), (37, 5)):
            q, kc, vc, _ = _build(rng, kern, m, p0)
            base = p0 + np.arange(m, dtype=np.int32)
            span = slice(min(10, m - 2), min(60, m))
            hi = base.copy()
            hi[span] = base[span][-1]
            kv = kern.param("kv_dtype")
            ref = R.attention_ref(q, kc, vc, kv, p0, ring, kern.param("window"), True, kern.param("scale"), hi)
            got = _run_bounded(runner, kern, q, kc, vc, m, p0, hi)
            err = R.norm_err(got, ref)
            if not err <= R.TOL_ATTN[kv]:
                failures.append(f"{kern.name} m={m} p0={p0}: error {err:.2e} > {R.TOL_ATTN[kv]}")
            same = _run_bounded(runner, kern, q, kc, vc, m, p0, base)  # no image: the plain kernel's bits
            if not np.array_equal(bits(same), bits(_run(runner, plain, q, kc, vc, m, p0))):
                failures.append(f"{kern.name} m={m} p0={p0}: kv_hi = positions differs from {plain.name}")
    assert not failures, "\n".join(failures)


def _run_bounded(runner, kern, q, kc, vc, m: int, p0: int, kv_hi: np.ndarray) -> np.ndarray:
    d, hq = kern.param("d"), kern.param("hq")
    inputs = {
        "q": q,
        "kc": kc,
        "vc": vc,
        "positions": np.arange(p0, p0 + m, dtype=np.int32),
        "m": np.int32(m),
        "out": np.full((m, hq, d), np.nan, np.float16),
        "kv_hi": np.asarray(kv_hi, np.int32),
        "rowwise": 0,
        "lane_bytes": 0,
    }  # (one sequence: no rowwise lanes)
    return runner.run_seq([(kern, None)], inputs, {"out": ((m, hq, d), np.float16)})["out"]
