"""CPU tests of the CUDA runtime's host side: driver errors, memory checks, manifests, argument packing, KV plans.

tests/fake_driver.py's FakeDriver stands in for cuda.bindings.driver (runtime.cuda.device.set_driver), its knobs set to
fail, so the error paths a user without a GPU (or with too small a GPU) hits are exercised on any machine.
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np
import pytest

from thorgen.model_spec import get_preset
from thorgen.model_spec.conventions import MANIFEST_SCHEMA
from thorgen.runtime.cuda import device as dev
from thorgen.runtime.backend import BackendError
from thorgen.runtime.cuda.graphs import CudaGraph
from thorgen.runtime.cuda.kv_cache import KVCache, check_context, plan_kv
from thorgen.runtime.cuda.memory import ArenaPlan, OutOfGpuMemory, alloc, check_fits
from thorgen.runtime.cuda.kernels import KernelSet, PackedArgs, Ptr
from thorgen.runtime.manifest import ModuleError, load_manifest

from fake_driver import GiB, CUresult, install


@pytest.fixture
def fake():
    """The fake driver as a machine with one 80 GiB-free H200 shows it, until the test ends."""
    drv = install(free=80 * GiB, name="Fake H200")
    yield drv
    dev.set_driver(None)


@pytest.fixture
def current(fake):
    """The fake driver with a context current on this thread (what Device.open leaves)."""
    fake.cuCtxSetCurrent("ctx")
    return fake


# ---- no GPU / no driver / no cuda-python ---------------------------------------------------------------------


def test_no_device_suggests_reference_backend(fake):
    fake.init = CUresult.CUDA_ERROR_NO_DEVICE
    with pytest.raises(BackendError, match=r"CUDA_ERROR_NO_DEVICE.*--backend reference"):
        dev.Device.open()


def test_zero_devices_suggests_reference_backend(fake):
    fake.devices = 0
    with pytest.raises(BackendError, match=r"0 devices.*--backend reference"):
        dev.Device.open()


def test_missing_driver_library_suggests_reference_backend(fake):
    def boom(flags):
        raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')

    fake.cuInit = boom
    with pytest.raises(BackendError, match=r"no NVIDIA driver found.*--backend reference"):
        dev.Device.open()


def test_missing_cuda_python_suggests_reference_backend(monkeypatch):
    dev.set_driver(None)
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)  # makes `from cuda.bindings import driver` fail
    with pytest.raises(BackendError, match=r"cuda-python.*--backend reference"):
        dev.driver()
    dev.set_driver(None)


def test_gpu_ordinal_out_of_range(fake):
    with pytest.raises(BackendError, match=r"GPU 3 does not exist.*1 GPU"):
        dev.Device.open(3)


def test_device_info_and_arch(fake):
    d = dev.Device.open()
    assert d.info.name == "Fake H200" and d.info.arch == "sm_90a" and d.info.capability == (9, 0)


def test_check_names_the_error(fake):
    with pytest.raises(dev.CudaError, match=r"cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY \(2\)") as info:
        dev.check((CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), "cuMemAlloc")
    assert info.value.code == 2 and info.value.name == "CUDA_ERROR_OUT_OF_MEMORY"
    assert dev.check((CUresult.CUDA_SUCCESS, 7), "x") == 7
    assert dev.check((CUresult.CUDA_SUCCESS, 1, 2), "x") == (1, 2)
    assert dev.check((CUresult.CUDA_SUCCESS,), "x") is None


# ---- GPU memory --------------------------------------------------------------------------------------------------


def test_alloc_reports_needed_and_free(fake):
    fake.free = 3 * GiB
    d = dev.Device.open()
    with pytest.raises(OutOfGpuMemory, match=r"needed 5\.00 GiB, free 3\.00 GiB"):
        alloc(d, 5 * GiB, "model weights")
    assert not any(c.startswith("alloc") for c in fake.calls)  # refused before asking the driver


def test_alloc_driver_oom_is_reported_the_same_way(fake):
    fake.alloc_result = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    d = dev.Device.open()
    with pytest.raises(OutOfGpuMemory, match=r"KV cache: needed 1\.00 GiB, free 80\.00 GiB"):
        alloc(d, GiB, "KV cache")


def test_check_fits_boundary():
    check_fits(10, 10, "x")
    with pytest.raises(OutOfGpuMemory, match="needed"):
        check_fits(11, 10, "x")


def test_arena_plan_aligns_regions():
    plan = ArenaPlan("acts")
    a = plan.add("a", 10)
    b = plan.add_array("b", (3, 5), "f32")
    c = plan.add("c", 0)
    assert (a.offset, b.offset, b.nbytes) == (0, 256, 60)
    assert c.offset == 512 and plan.total == 512
    with pytest.raises(ValueError, match="planned twice"):
        plan.add("a", 1)


# ---- graphs ------------------------------------------------------------------------------------------------------


def test_capture_error_ends_capture_and_reraises(current):
    stream = dev.Stream("s")

    def body():
        raise ValueError("kernel arguments wrong")

    with pytest.raises(ValueError, match="kernel arguments wrong"):
        CudaGraph.capture(stream, body, "decode")
    assert current.calls == ["begin", "end", "destroy graph"]


# ---- manifest / modules ------------------------------------------------------------------------------------------


def _manifest(tmp_path, **over):
    m = {
        "schema": MANIFEST_SCHEMA,
        "model": "tiny",
        "spec_hash": "ab" * 32,
        "arch": "sm_90a",
        "conventions": {},
        "kernels": {
            "k1": {
                "cubin": "k1.cubin",
                "entry": "k1",
                "family": "norms",
                "grid": [1, 1, 1],
                "block": [256, 1, 1],
                "smem_bytes": 0,
                "args": ["x", "n"],
                "params": {"h": 256},
            }
        },
        "programs": {},
    }
    m.update(over)
    (tmp_path / "manifest.json").write_text(json.dumps(m))
    return tmp_path


def test_manifest_loads(tmp_path):
    m = load_manifest(_manifest(tmp_path))
    k = m.kernel("k1")
    assert k.block == (256, 1, 1) and k.args == ("x", "n") and k.param("h") == 256
    assert k.cubin == tmp_path / "k1.cubin"
    with pytest.raises(ModuleError, match="no kernel 'nope'"):
        m.kernel("nope")


def test_manifest_errors(tmp_path):
    with pytest.raises(ModuleError, match="not found.*thorgen build"):
        load_manifest(tmp_path / "missing")
    with pytest.raises(ModuleError, match="schema 7"):
        load_manifest(_manifest(tmp_path, schema=7))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ModuleError, match="unreadable"):
        load_manifest(tmp_path)
    bad = _manifest(tmp_path)
    data = json.loads((bad / "manifest.json").read_text())
    del data["kernels"]["k1"]["grid"]
    (bad / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModuleError, match="'k1' entry is malformed"):
        load_manifest(bad)
    with pytest.raises(ModuleError, match="no step programs"):
        load_manifest(_manifest(tmp_path, programs=None))
    with pytest.raises(ModuleError, match="unreadable step programs"):
        load_manifest(_manifest(tmp_path, programs=None, programs_file="programs.json.gz"))


def test_manifest_mismatch_names_both_sides(tmp_path):
    m = load_manifest(_manifest(tmp_path))
    with pytest.raises(ModuleError, match=r"arch: kernels built for sm_90a, this GPU is sm_100a.*--arch sm_100a"):
        m.check(device_arch="sm_100a")
    with pytest.raises(ModuleError, match=r"spec hash: kernels built for abababababab \(tiny\), model is cdcdcdcdcdcd"):
        m.check(spec_hash="cd" * 32)
    m.check(spec_hash="ab" * 32, device_arch="sm_90a")


def test_kernel_set_refuses_other_arch(fake, tmp_path):
    fake.capability = (12, 0)
    d = dev.Device.open()
    with pytest.raises(ModuleError, match="built for sm_90a, this GPU is sm_120a"):
        KernelSet(load_manifest(_manifest(tmp_path)), d)


def test_pack_args_widths_follow_the_kernel():
    from thorgen.runtime.cuda.memory import DeviceBuffer

    buf = DeviceBuffer(0x7F0000001000, 64, "x")
    packed = PackedArgs([buf, 5, 2.5, Ptr(0x1234), np.int64(-3), 0x7F0000002000], sizes=[8, 4, 4, 8, 8, 8])
    ptrs = (ctypes.c_void_p * 6).from_address(packed.address)
    vals = [
        ctypes.c_uint64.from_address(ptrs[0]).value,
        ctypes.c_int32.from_address(ptrs[1]).value,
        ctypes.c_float.from_address(ptrs[2]).value,
        ctypes.c_uint64.from_address(ptrs[3]).value,
        ctypes.c_int64.from_address(ptrs[4]).value,
        ctypes.c_uint64.from_address(ptrs[5]).value,
    ]
    assert vals == [0x7F0000001000, 5, 2.5, 0x1234, -3, 0x7F0000002000]


def test_pack_args_errors():
    with pytest.raises(ModuleError, match=r"takes 2 arguments \(x, n\), got 1"):
        PackedArgs([1], sizes=[8, 4], names=["x", "n"], kernel="k")
    with pytest.raises(ModuleError, match=r"argument 0 \(x\): passed 4 bytes, the kernel declares 8"):
        PackedArgs([np.int32(1)], sizes=[8], names=["x"], kernel="k")
    with pytest.raises(ModuleError, match="does not fit 32 bits"):
        PackedArgs([2**40])
    with pytest.raises(ModuleError, match="cannot pass str"):
        PackedArgs(["x"])


# ---- KV cache planning ----------------------------------------------------------------------------------------


def test_kv_plan_full_preset_bytes_by_hand():
    spec = get_preset("gemma-4-26b-a4b")
    plan = plan_kv(spec, ctx=65536, dtype="bf16")
    # 25 sliding layers: ring of window 1024 + 2048 step slots, 8 KV heads x 256 dims; 5 full layers: 65536 slots,
    # 2 KV heads x 512 dims; K and V each, 2 bytes per bf16 element.
    sliding = 25 * (1024 + 2048) * 8 * 256 * 2 * 2
    full = 5 * 65536 * 2 * 512 * 2 * 2
    assert plan.nbytes == sliding + full == 1_971_322_880
    assert plan_kv(spec, ctx=65536, dtype="fp8").nbytes == (sliding + full) // 2
    assert [l.ring for l in plan.layers] == [not spec.target.is_full(i) for i in range(30)]


def test_kv_plan_drafter_and_small_context():
    spec = get_preset("tiny")
    plan = plan_kv(spec, ctx=64, dtype="bf16", drafter=True)
    t = [l for l in plan.layers if l.model == "target"]
    d = [l for l in plan.layers if l.model == "drafter"]
    # tiny: window 16 -> ring of 16 + 512 slots, which exceeds ctx 64: every layer is linear with 64 slots
    assert all(not l.ring and l.slots == 64 for l in t + d)
    assert sum(l.nbytes for l in t) == 64 * 2 * 2 * (4 * 2 * 64 + 2 * 1 * 128)
    assert sum(l.nbytes for l in d) == 64 * 2 * 2 * 2 * 2 * 64
    big = plan_kv(spec, ctx=4096, conventions={"ring_slots": {"16": 48}})
    assert [l.slots for l in big.layers] == [48, 48, 4096, 48, 48, 4096]
    assert big.layers[0].slot(100) == 100 % 48 and big.layers[2].slot(100) == 100


def test_kv_plan_errors():
    spec = get_preset("tiny")
    with pytest.raises(BackendError, match="--kv-dtype 'int4'"):
        plan_kv(spec, 64, "int4")
    with pytest.raises(BackendError, match="max_position_embeddings"):
        plan_kv(spec, 10**6)
    with pytest.raises(BackendError, match="at least 1"):
        plan_kv(spec, 0)


def test_prompt_longer_than_ctx():
    check_context(10, 11)
    with pytest.raises(BackendError, match=r"prompt has 11 tokens but the context \(--ctx\) holds 11"):
        check_context(11, 11)
    with pytest.raises(BackendError, match="empty"):
        check_context(0, 11)


def test_kv_cache_allocation_checks_memory(fake):
    fake.free = GiB
    d = dev.Device.open()
    plan = plan_kv(get_preset("gemma-4-26b-a4b"), ctx=65536)
    with pytest.raises(OutOfGpuMemory, match=r"KV cache: needed 1\.84 GiB, free 1\.00 GiB"):
        KVCache(d, plan)


# ---- bench / engine helpers -----------------------------------------------------------------------------------


def test_decode_weight_bytes_matches_the_anchor_roofline():
    from thorgen.runtime.bench.roofline import target_weight_bytes

    # ANCHORS.md 1.2: ~3.82e9 weights read per token; NVFP4 everything (E2M1 + one E4M3 per 16) = 2.15 GB/token,
    # NVFP4 except a bf16 lm_head = 3.21 GB/token (those tables ignore the small bf16 router/norm weights).
    spec = get_preset("gemma-4-26b-a4b")
    assert abs(target_weight_bytes(spec, 1, "nvfp4") - 2.15e9) / 2.15e9 < 0.02
    assert abs(target_weight_bytes(spec, 1, "bf16") - 3.21e9) / 3.21e9 < 0.02


def test_bench_reference_backend_json(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    out = tmp_path / "b.json"
    res = CliRunner().invoke(
        bench,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--prompt-len",
            "6",
            "--gen",
            "3",
            "--runs",
            "2",
            "--ctx",
            "64",
            "--json",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    r = json.loads(res.output.strip().splitlines()[-1])
    for key in ("gpu", "command", "date", "prompt_len", "ttft_ms", "decode_tok_s", "peak_gpu_mem_gib", "load_s"):
        assert key in r
    assert r["prompt_len"] == 6 and len(r["decode_tok_s_runs"]) == 2 and r["decode_tok_s"] > 0
    assert r["copy_gb_s"] > 0 and "--backend reference" in r["command"]
    assert json.loads(out.read_text())["ttft_ms"] == r["ttft_ms"]


def test_bench_image_on_the_reference_backend(tiny_checkpoint, tmp_path):
    from click.testing import CliRunner
    from PIL import Image

    from thorgen.runtime.bench.cli import bench

    photo = tmp_path / "photo.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (80, 120, 3), dtype=np.uint8)).save(photo)
    args = [
        "--model",
        str(tiny_checkpoint),
        "--backend",
        "reference",
        "--prompt-len",
        "8",
        "--gen",
        "3",
        "--runs",
        "2",
        "--ctx",
        "256",
        "--image",
        str(photo),
        "--image-max-tokens",
        "140,70",
    ]
    res = CliRunner().invoke(bench, [*args, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    assert [i["budget"] for i in report["images"]] == [140, 70] and "--image-max-tokens 140,70" in report["command"]
    for image in report["images"]:  # one entry per budget, in the order asked
        assert (image["width"], image["height"]) == (120, 80) and 0 < image["soft_tokens"] <= image["budget"]
        assert image["prompt_tokens"] == 8 + image["soft_tokens"] + 2  # <bos> + boi + soft tokens + eoi + 7 text
        assert image["encode_ms"] > 0 and image["preprocess_ms"] > 0 and image["decode_tok_s"] > 0
        assert image["ttft_ms"] > 0 and len(image["ttft_ms_runs"]) == 2  # (timed apart from encode_ms: no order)
    assert report["images"][0]["soft_tokens"] > report["images"][1]["soft_tokens"]
    text = CliRunner().invoke(bench, [*args[:-1], "70"])
    assert text.exit_code == 0 and "budget   70" in text.output and "TTFT" in text.output, text.output
    (tmp_path / "bad.png").write_bytes(b"no picture")
    bad = CliRunner().invoke(bench, [*args[:-4], "--image", str(tmp_path / "bad.png")])
    assert bad.exit_code != 0 and "bad.png" in bad.output
    for budgets in ("300", "70,x", ""):
        refused = CliRunner().invoke(bench, [*args[:-1], budgets])
        assert refused.exit_code == 2 and "--image-max-tokens" in refused.output, refused.output
    too_long = CliRunner().invoke(bench, [*args, "--ctx", "90"])  # the last --ctx counts
    assert too_long.exit_code != 0 and "at budget 140" in too_long.output, too_long.output


def test_bench_video_on_the_reference_backend(tiny_checkpoint, tmp_path):
    pytest.importorskip("av")
    from click.testing import CliRunner
    from video_clips import mp4

    from thorgen.runtime.bench.cli import bench

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(mp4(frames=6))
    args = ["--model", str(tiny_checkpoint), "--backend", "reference", "--prompt-len", "8", "--gen", "3"]
    args += ["--runs", "2", "--ctx", "256", "--video", str(clip), "--video-frames", "3"]
    res = CliRunner().invoke(bench, [*args, "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output.strip().splitlines()[-1])
    video = report["video"]
    assert "--video-frames 3" in report["command"] and (video["width"], video["height"]) == (64, 48)
    assert (
        video["frames"] == 3 and video["total_frames"] == 6 and 0 < video["soft_tokens"] // 3 <= 70 == video["budget"]
    )
    assert video["prompt_tokens"] > 8 + video["soft_tokens"] + 6  # boi and eoi per frame, and the timestamps
    assert video["decode_ms"] > 0 and video["preprocess_ms"] > 0 and video["encode_ms"] > 0
    assert video["ttft_ms"] > 0 and len(video["ttft_ms_runs"]) == 2 and video["decode_tok_s"] > 0
    text = CliRunner().invoke(bench, args)
    assert text.exit_code == 0 and "decode + sampling" in text.output and "3 of 6 frames" in text.output, text.output
    (tmp_path / "bad.mp4").write_bytes(b"no video")
    bad = CliRunner().invoke(bench, [*args[:-4], "--video", str(tmp_path / "bad.mp4")])
    assert bad.exit_code != 0 and "bad.mp4" in bad.output and "not a video" in bad.output, bad.output
    too_long = CliRunner().invoke(bench, [*args, "--ctx", "40"])
    assert too_long.exit_code != 0 and "exceed the context" in too_long.output, too_long.output


def test_bench_cuda_without_gpu_points_to_reference(tiny_checkpoint, fake):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    fake.init = CUresult.CUDA_ERROR_NO_DEVICE
    res = CliRunner().invoke(bench, ["--model", str(tiny_checkpoint), "--backend", "cuda", "--ctx", "1024"])
    assert res.exit_code != 0 and "--backend reference" in res.output


def test_launch_grid_rules():
    from pathlib import Path

    from thorgen.runtime.cuda.programs import _grid
    from thorgen.runtime.manifest import KernelEntry

    def entry(grid, params, template="x.cu.j2"):
        return KernelEntry("k", Path("k.cubin"), "k", "f", grid, (128, 1, 1), 0, (), params, template)

    assert _grid(entry((512, 1, 1), {"ROW_AXIS": 0}), 3) == (3, 1, 1)
    assert _grid(entry((128, 16, 1), {"ROW_AXIS": 1}), 1) == (128, 1, 1)
    assert _grid(entry((88, 128, 1), {"ROW_GRID": (1, 8, 1)}), 2) == (88, 16, 1)  # rows x top-k
    moe = entry((44, 128, 1), {"ROW_GRID": (1, 8, 1, 128)})  # moe_gateup: a block row per expert the step may select
    assert _grid(moe, 2) == (44, 16, 1) and _grid(moe, 16) == (44, 128, 1) and _grid(moe, 32) == (44, 128, 1)
    assert _grid(entry((11, 8, 1), {"ROW_GRID": (1, 1, 64)}), 130) == (11, 3, 1)  # prefill GEMM: 64-row blocks
    attn = entry((1, 8, 32), {"ROW_GRID": (0, 1, 16), "ROWWISE_GRID": (0, 1, 1), "ROWWISE_SPLITS": (32, 16, 8, 8)})
    assert _grid(attn, 3) == (1, 8, 32) and _grid(attn, 17) == (2, 8, 32)  # query blocks of 16, every split
    assert _grid(attn, 3, rowwise=True) == (3, 8, 8)  # a block per query, the planner's splits for 3 rows
    assert _grid(entry((176, 1, 1), {}), 1) == (176, 1, 1)  # no rule: the planned grid


@pytest.mark.parametrize("preset", ["tiny", "gemma-4-26b-a4b"])
def test_forward_schedule_binds_every_planned_kernel(preset, tmp_path):
    """The engine's forward against a manifest of codegen's real plan (nothing compiled): every kernel it needs
    exists, every argument a kernel declares is provided, and launch grids stay within the planned ones."""
    codegen_plan = pytest.importorskip("thorgen.codegen.plan")  # tests may use codegen; the runtime never does
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.manifest import build_manifest
    from thorgen.runtime.cuda.programs import Forward, _grid

    spec, arch = get_preset(preset), get_arch("sm_90a")
    kernels = codegen_plan.plan(spec, arch)
    (tmp_path / "manifest.json").write_text(json.dumps(build_manifest(spec, arch, kernels, {}, "test", [])))
    man = load_manifest(tmp_path)
    t = spec.target
    for kv in ("bf16", "fp8e4m3"):
        fwd = Forward(spec, man, kv, man.conventions["max_step_tokens"])
        assert fwd.probe() == []
        for rows in (1, 7, 16, 17, man.conventions["max_step_tokens"]):
            from thorgen.runtime.cuda.programs import Copy2D

            ops = fwd.ops(rows, decode=rows == 1, last=True, greedy=rows != 7)
            # rope_kv reads the q|k|v GEMM's rows in place: no split copies, strides = the row width
            assert not [op for op in ops if isinstance(op, Copy2D)]
            for op in ops:
                if op.label.endswith("rope_kv"):
                    pr = op.entry.params
                    width = pr["D"] * (pr["HQ"] + pr["HKV"] * (1 if pr["V_FROM_K"] else 2))  # q | k (| v)
                    assert op.args["q_stride"] == op.args["kv_stride"] == width, op.label
            for op in ops:
                assert set(op.entry.args) <= set(op.args), (op.label, op.entry.name)
                g = _grid(op.entry, op.rows)
                assert all(1 <= a <= b for a, b in zip(g, op.entry.grid)), (op.label, g, op.entry.grid)
                if "mmax" in op.entry.params:
                    assert op.rows <= op.entry.params["mmax"], (op.label, op.rows)
            # up to 16 rows: the M=1 / M=16 MoE pair once per layer; prefill chunks: the grouped (sorted) MoE
            moe = [op.label.rsplit(".", 1)[-1] for op in ops if ".moe_" in op.label]
            assert moe.count("moe_down") == (t.num_hidden_layers if rows <= 16 else 0)
            assert moe.count("moe_grouped_down") == (0 if rows <= 16 else t.num_hidden_layers)
            # the attention prologue (one row: the q|k|v GEMV with rope_kv folded in) writes the engine's KV dtype
            kv_dtypes = {op.entry.params["KV"] for op in ops if op.label.endswith(("rope_kv", "qkv_rope"))}
            assert kv_dtypes == {kv}


def test_engine_refuses_to_start_without_needed_kernels(fake, tiny_checkpoint, tmp_path):
    """A manifest lacking the attention family: the engine names it (and frees what it took) instead of running."""
    pytest.importorskip("thorgen.codegen.plan")
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.manifest import build_manifest
    from thorgen.codegen.plan import plan
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda.engine import Engine
    from thorgen.runtime.cuda.memory import DeviceBuffer
    from thorgen.runtime.convert.repack import repack
    from thorgen.runtime.convert.artifact import WeightsArtifact

    freed = []
    fake.cuStreamCreate = lambda flags: (CUresult.CUDA_SUCCESS, "stream")
    fake.cuStreamDestroy = lambda s: (CUresult.CUDA_SUCCESS,)
    fake.cuMemFree = lambda p: freed.append(p) or (CUresult.CUDA_SUCCESS,)
    spec = Checkpoint.open(tiny_checkpoint).spec
    kernels = [k for k in plan(spec, get_arch("sm_90a")) if k.family != "attention"]
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "manifest.json").write_text(
        json.dumps(build_manifest(spec, get_arch("sm_90a"), kernels, {}, "test", []))
    )
    art = WeightsArtifact.open(repack(tiny_checkpoint, tmp_path / "w"))
    with pytest.raises(BackendError, match=r"lacks what the forward needs: attention layer kind s") as info:
        Engine(spec, dev.Device.open(), load_manifest(tmp_path / "k"), art, DeviceBuffer(0x1000, 64, "w"), 4096)
    assert "attention layer kind f" in str(info.value) and "embedding" not in str(info.value)
    assert freed == [0x1000]
