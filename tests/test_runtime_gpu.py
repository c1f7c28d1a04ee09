"""GPU tests of the CUDA runtime (tiny preset): device memory, kernel launch + graph replay, and the engine against
the reference backend — greedy tokens (prompt suite, a prompt longer than the sliding window), logits, seeded
sampling, the fp8 KV cache, and the context limit. Skipped without a GPU, cuda-python or nvcc.

Run on the H200: `python -m pytest tests/test_runtime_gpu.py -m gpu -q`.
Tolerances (first-run values, to be tightened with measurements): logits of the last prompt token, softcapped,
relative L2 vs the float64-accumulating reference <= 2e-2 with the bf16 KV cache (W4A16: fp16 activations,
NVFP4 weights; bf16 queries/KV) and <= 5e-2 with the fp8 e4m3 KV cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from thorgen.runtime.backend import BackendError, SamplingParams

pytestmark = pytest.mark.gpu
GEN = 64
LOGITS_TOL = {"bf16": 2e-2, "fp8": 5e-2}


@pytest.fixture(scope="module")
def device():
    from thorgen.runtime.device import Device

    try:
        return Device.open(0)
    except BackendError as exc:
        pytest.skip(f"no GPU: {exc}")


@pytest.fixture(scope="module")
def built(device, tiny_checkpoint, tmp_path_factory):
    """(checkpoint dir, kernels dir): weights repacked for this GPU's arch, kernels built with codegen (or taken
    prebuilt from $THORGEN_KERNELS, e.g. `thorgen build --preset tiny --arch sm_90a` run where nvcc is)."""
    import os

    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.repack import repack

    repack(tiny_checkpoint, arch=device.info.arch)
    pre = os.environ.get("THORGEN_KERNELS")
    if pre and (Path(pre) / "manifest.json").is_file():
        return tiny_checkpoint, Path(pre)
    try:
        from thorgen.codegen.arch import get_arch
        from thorgen.codegen.builder import build
        from thorgen.codegen.nvcc import find_nvcc

        find_nvcc()
    except Exception as exc:  # tests may use codegen; the runtime itself never does
        pytest.skip(f"no nvcc / codegen: {exc}")
    spec = Checkpoint.open(tiny_checkpoint).spec
    kernels = tmp_path_factory.mktemp("kernels")
    build(spec, get_arch(device.info.arch), kernels)
    return tiny_checkpoint, kernels


def _open(built, **kw):
    from thorgen.runtime.cuda_backend import open_backend

    model, kernels = built
    return open_backend(model, kernels_dir=kernels, **kw)


@pytest.fixture(scope="module")
def cuda(built):
    b = _open(built, ctx=4096)  # a BackendError here (missing kernels) fails the tests: the engine is incomplete
    yield b
    b.close()


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    from thorgen.runtime.reference.backend import ReferenceBackend

    return ReferenceBackend(tiny_ckpt, max_context=4096, prefix_slots=0)


def _suite_prompts(tiny_checkpoint: Path, shared_dir: Path) -> list[tuple[str, list[int]]]:
    from thorgen.runtime.tokenizer import Tokenizer
    from thorgen.serve.chat_template import ChatTemplate, load_chat_template

    suite = json.loads((shared_dir / "seed_data" / "prompt_suite.json").read_text())["prompts"]
    source, bos = load_chat_template(tiny_checkpoint)
    tmpl, tok = ChatTemplate(source, bos), Tokenizer.from_file(tiny_checkpoint / "tokenizer.json")
    return [(p["id"], tok.encode(tmpl.render(p["messages"]))) for p in suite]


# ---- runtime pieces -------------------------------------------------------------------------------------------

def test_device_memory_round_trip(device):
    from thorgen.runtime.memory import OutOfGpuMemory, alloc

    data = np.arange(1 << 20, dtype=np.float32)
    buf = alloc(device, data.nbytes, "test buffer")
    try:
        buf.upload(data)
        np.testing.assert_array_equal(buf.download(np.float32, data.shape), data)
        buf.view(1024, 4096).zero()
        got = buf.download(np.float32, data.shape)
        assert (got[256:1280] == 0).all() and got[255] == 255 and got[1280] == 1280
    finally:
        buf.free()
    with pytest.raises(OutOfGpuMemory, match=r"needed 1048576\.00 GiB, free"):
        alloc(device, 1 << 50, "an absurd buffer")


def test_kernel_launch_and_graph_replay(device, built):
    """The embedding kernel through the manifest, launched eagerly and from a captured graph."""
    from thorgen.model_spec.nvfp4 import bf16_to_f32
    from thorgen.runtime.graphs import CudaGraph
    from thorgen.runtime.memory import alloc
    from thorgen.runtime.modules import KernelSet, load_manifest

    model, kdir = built
    man = load_manifest(kdir)
    entry = next(k for k in man.kernels.values() if k.family == "embedding" and k.params["MASK_ID"] == -1)
    H, V, scale = entry.params["H"], entry.params["V"], np.float32(entry.params["SCALE"])
    ks = KernelSet(man, device)
    rng = np.random.default_rng(0)
    table = rng.integers(0x0080, 0x3F80, (V, H), dtype=np.uint16)  # positive normal bf16 values below 1.0
    ids = np.array([3, 0, V - 1, 7], np.int32)
    bufs = [alloc(device, n, "t") for n in (table.nbytes, 64, 4 * 4 * H)]
    stream = device.stream()
    try:
        bufs[0].upload(table)
        bufs[1].upload(ids)
        launch = ks.kernel(entry.name).bind([bufs[1], bufs[0], bufs[2], 4], grid=(4, 1, 1))
        launch(stream)
        stream.synchronize()
        want = bf16_to_f32(table[ids]) * scale
        np.testing.assert_array_equal(bufs[2].download(np.float32, (4, H)), want)
        graph = CudaGraph.capture(stream, lambda: launch(stream), "embed")
        ids2 = np.array([1, 2, 5, 9], np.int32)
        bufs[1].upload(ids2)  # a graph reads device memory at replay time
        graph.replay(stream)
        stream.synchronize()
        np.testing.assert_array_equal(bufs[2].download(np.float32, (4, H)), bf16_to_f32(table[ids2]) * scale)
        graph.destroy()
    finally:
        for b in bufs:
            b.free()
        stream.destroy()
        ks.unload()


# ---- the engine against the reference ---------------------------------------------------------------------------

def test_greedy_prompt_suite_matches_reference(cuda, reference, tiny_checkpoint, shared_dir):
    prompts = _suite_prompts(tiny_checkpoint, shared_dir)
    assert prompts
    for pid, ids in prompts:
        want = reference.generate(ids, GEN, SamplingParams()).token_ids
        got = cuda.generate(ids, GEN, SamplingParams()).token_ids
        assert got == want, f"{pid}: first difference at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"


def test_prompt_longer_than_sliding_window(cuda, reference):
    window = cuda.spec.target.sliding_window
    ids = [2] + np.random.default_rng(1).integers(256, 512, 3 * window).tolist()
    assert cuda.generate(ids, GEN, SamplingParams()).token_ids == reference.generate(ids, GEN, SamplingParams()).token_ids


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def _check_logits(backend, reference, kv: str) -> None:
    from thorgen.runtime.reference.ops import softcap

    ids = [2] + np.random.default_rng(2).integers(256, 512, 40).tolist()
    backend.engine.prefill(ids)
    got = softcap(backend.engine.logits(), backend.spec.target.final_logit_softcapping)
    model = reference.target
    want = model.forward(ids, model.new_cache(), last_only=True).logits[-1]
    assert _rel_l2(got, want) <= LOGITS_TOL[kv], f"{kv} KV: logits rel L2 {_rel_l2(got, want):.3g}"


def test_logits_within_tolerance(cuda, reference):
    _check_logits(cuda, reference, "bf16")


def test_fp8_kv_logits_within_tolerance(built, reference):
    b = _open(built, ctx=4096, kv_dtype="fp8")
    try:
        _check_logits(b, reference, "fp8")
    finally:
        b.close()


def test_seeded_sampling_matches_reference(cuda, reference):
    ids = [2] + np.random.default_rng(3).integers(256, 512, 20).tolist()
    for params in (SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_k=20, top_p=0.9,
                                                                          min_p=0.05, seed=123)):
        assert cuda.generate(ids, 32, params).token_ids == reference.generate(ids, 32, params).token_ids, params


def test_stop_ids_and_length(cuda, reference):
    ids = [2, 300, 301, 302]
    free_run = reference.generate(ids, 8, SamplingParams()).token_ids
    stop = frozenset({free_run[3]})
    got = cuda.generate(ids, 8, SamplingParams(), stop_ids=stop)
    assert got.token_ids == free_run[:free_run.index(free_run[3]) + 1] and got.finish_reason == "stop"


def test_prompt_longer_than_ctx(built):
    b = _open(built, ctx=32)
    try:
        with pytest.raises(BackendError, match=r"prompt has 40 tokens but the context \(--ctx\) holds 32"):
            b.generate([2] * 40, 4, SamplingParams())
    finally:
        b.close()


def test_bench_cuda_report(built):
    from thorgen.runtime.bench import run_bench

    model, kernels = built
    r = run_bench("cuda", model, prompt_len=32, gen=16, runs=5, ctx=4096, kv_dtype="bf16", kernel_dir=kernels)
    for key in ("gpu", "command", "date", "prompt_len", "ttft_ms", "decode_tok_s", "peak_gpu_mem_gib", "load_s"):
        assert key in r
    assert r["decode_tok_s"] > 0 and r["copy_gb_s"] > 0 and r["decode_step_kernels"]
