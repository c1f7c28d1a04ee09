"""thorgen's ModelOpt NVFP4 arithmetic (model_spec/nvfp4.py quantize_nvfp4_modelopt / dequantize_nvfp4_mul) against
NVIDIA Model Optimizer's own NVFP4QTensor on random matrices; skipped when nvidia-modelopt is not installed."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from thorgen.model_spec.nvfp4 import dequantize_nvfp4_mul, quantize_nvfp4, quantize_nvfp4_modelopt

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # modelopt warns about the installed transformers version
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
NVFP4QTensor = nvfp4_tensor.NVFP4QTensor


def _matrices():
    rng = np.random.default_rng(11)
    w = rng.standard_normal((64, 512)).astype(np.float32) * rng.uniform(0.01, 3.0, (64, 1)).astype(np.float32)
    w[5, 32:48] = 0.0  # an all-zero block (ModelOpt: block scale 1.0)
    w[7, :16] = np.float32(1e-6)  # a block far below the tensor's amax (the 2^-9 clamp)
    heavy = rng.standard_t(3, (32, 256)).astype(np.float32)  # heavy tails: most blocks far below amax
    return [w, heavy]


@pytest.mark.parametrize("index", [0, 1])
def test_quantize_matches_modelopt(index):
    w = _matrices()[index]
    q, scale, scale_2 = NVFP4QTensor.quantize(torch.from_numpy(w), 16)
    packed, ours_scale, ours_2 = quantize_nvfp4_modelopt(w)
    assert np.float32(scale_2.item()) == ours_2
    np.testing.assert_array_equal(ours_scale, scale.view(torch.uint8).numpy().reshape(ours_scale.shape))
    np.testing.assert_array_equal(packed, q._quantized_data.numpy().reshape(packed.shape))
    deq = q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}).numpy()
    np.testing.assert_array_equal(dequantize_nvfp4_mul(packed, ours_scale, ours_2), deq)


def test_modelopt_and_compressed_tensors_quantize_alike():
    """Same block-scale meaning: only the scalar convention (multiplier vs divisor) and zero blocks differ."""
    w = _matrices()[0]
    mo_packed, mo_scale, s2 = quantize_nvfp4_modelopt(w)
    ct_packed, ct_scale, g = quantize_nvfp4(w)
    assert abs(float(s2) * float(g) - 1.0) < 1e-6
    live = np.abs(w.reshape(64, 32, 16)).max(axis=2) > 1e-3
    assert (mo_scale[live] == ct_scale[live]).mean() > 0.999
