"""CPU tests (slow): the GPU tests of the lm_logits family (tests/test_kernels_gpu_logits.py), run on kernels that
g++ builds from the same rendered sources against a host stand-in for the CUDA runtime (tests/host_kernels.py),
for the tiny preset (one vocabulary chunk) and the tiny preset widened to V = 8192 (four chunks of 2048, as at
full size). Skips without g++."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ is not a package (importlib import mode)
from host_kernels import HostRunner, host_compiler
from test_kernels_gpu_logits import (
    test_logprobs_match_the_reference,  # noqa: F401  (collected here)
)
from thorgen.codegen.arch import get_arch
from thorgen.codegen.plan import plan
from thorgen.model_spec.presets import get_preset

pytestmark = pytest.mark.slow
USED = ("lm_process__", "lm_pick_", "lm_sample_select__", "lm_logprobs_")


@pytest.fixture(scope="module", params=[512, 8192], ids=lambda v: f"V{v}")
def runner(request, tmp_path_factory):
    if host_compiler() is None:
        pytest.skip("no g++")
    spec = get_preset("tiny")
    spec = dataclasses.replace(
        spec,
        target=dataclasses.replace(spec.target, vocab_size=request.param),
        drafter=dataclasses.replace(spec.drafter, vocab_size=request.param),
    )
    arch = get_arch("sm_90a")
    kernels = [k for k in plan(spec, arch) if k.name.startswith(USED)]
    return HostRunner(kernels, arch, tmp_path_factory.mktemp(f"host_V{request.param}"))
