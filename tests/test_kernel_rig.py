"""runtime/bench/kernels.py's KernelRig (the kernel benchmark's and the GPU kernel tests' launcher) on the emulated
CUDA driver: plan kernels, given as manifest entries with cubin bytes, load through the runtime's KernelSet, take
uploaded inputs, and their outputs come back; the event and graph timings run."""

from __future__ import annotations

import numpy as np
import pytest

import engine_emulator as EE
import reference_kernels as R
from gpu_harness import manifest_entry
from thorgen.codegen.arch import get_arch
from thorgen.codegen.plan import plan
from thorgen.model_spec.presets import get_preset
from thorgen.runtime.bench.kernels import KernelRig
from thorgen.runtime.cuda import device as dev


@pytest.fixture(scope="module")
def rig_and_norm(tmp_path_factory):
    root = tmp_path_factory.mktemp("rig")
    spec = get_preset("tiny")
    EE.install(EE.write_fake_manifest(spec, root / "kernels"))
    device = dev.Device.open(0)
    rig = KernelRig(device, root / "work")
    kernels = [k for k in plan(spec, get_arch(rig.arch)) if k.family == "norms"]
    # the emulator runs each kernel's NumPy contract: the cubins can be empty
    rig.add([manifest_entry(k) for k in kernels], {k.name: b"" for k in kernels})
    yield rig, next(k for k in kernels if k.name.startswith("rmsnorm__"))
    rig.close()
    device.close()
    dev.set_driver(None)


def _args(rig, k, T: int, x: np.ndarray, w: np.ndarray, y):
    named = {"x": rig.upload(x), "w": rig.upload(w), "y": y, "T": np.int32(T)}
    return [named[a] for a in k.args]


def test_launch_upload_download(rig_and_norm):
    rig, k = rig_and_norm
    T, H, out_t = 5, k.param("H"), k.param("OUT")
    rng = np.random.default_rng(0)
    x = rng.normal(0, 3, (T, H)).astype(np.float32)
    w = EE.f32_to_bf16(rng.normal(1.0, 0.3, H).astype(np.float32))
    y = rig.alloc(T * H * np.dtype(R.np_dtype(out_t)).itemsize)
    rig.launch(k.name, _args(rig, k, T, x, w, y), (T, 1, 1))
    got = rig.download(y, (T, H), R.np_dtype(out_t))
    assert R.norm_err(R.load(got, out_t), R.rmsnorm_ref(x, w, k.param("EPS"))) <= R.TOL[out_t]
    rig.free()


def test_timings_run(rig_and_norm):
    rig, k = rig_and_norm
    T, H = 3, k.param("H")
    args = _args(rig, k, T, np.ones((T, H), np.float32), np.ones(H, np.uint16), rig.alloc(T * H * 4))
    assert rig.time_ms(lambda: rig.launch(k.name, args, (T, 1, 1)), iters=2) >= 0.0
    assert rig.graph_time_ms(lambda: rig.launch(k.name, args, (T, 1, 1)), reps=3, iters=2) >= 0.0
    rig.free()
