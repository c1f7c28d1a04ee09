"""CPU tests of the SM-limited runs (`thorgen bench --sms N`): Device.open(sms=N) makes a green context of N
multiprocessors current (tests/fake_driver.py models the driver's split granularity), the cuda engine on the
emulated GPU runs every launch in it and generates what it generates on the whole GPU, and the bench refuses what
it cannot do with a one-line error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_emulator as EE  # noqa: E402
from fake_driver import install  # noqa: E402

from thorgen.runtime.backend import BackendError, SamplingParams  # noqa: E402
from thorgen.runtime.cuda import device as dev  # noqa: E402


@pytest.fixture
def fake():
    drv = install()
    yield drv
    dev.set_driver(None)


def test_open_with_sms_makes_a_green_context_current(fake):
    d = dev.Device.open(0, sms=20)
    green = fake.green_contexts[0]
    assert d.sms == 20 and d.info.sm_count == 132 and green.sms == 20
    assert fake._ctx.current == green.ctx and not green.destroyed
    d.close()
    assert green.destroyed


def test_the_granted_count_is_what_the_driver_rounds_to(fake):
    d = dev.Device.open(0, sms=21)  # 2-SM granularity once co-scheduling is ignored
    assert d.sms == 22
    d.close()


def test_whole_gpu_without_sms(fake):
    d = dev.Device.open(0)
    assert d.sms == 132 and not fake.green_contexts
    d.close()


@pytest.mark.parametrize("sms", [0, 133])
def test_sms_outside_the_gpu_is_refused(fake, sms):
    with pytest.raises(BackendError, match="132 multiprocessors"):
        dev.Device.open(0, sms=sms)


def test_a_split_the_driver_cannot_make_is_refused(fake):
    fake.sms = 21
    with pytest.raises(BackendError, match="cannot split"):
        dev.Device.open(0, sms=21)  # rounds up to 22 SMs, one more than the device has


def test_bindings_without_green_contexts_are_refused(fake, monkeypatch):
    monkeypatch.delattr(type(fake), "cuGreenCtxCreate")
    with pytest.raises(BackendError, match="needs green contexts"):
        dev.Device.open(0, sms=20)


def test_bindings_without_the_split_flag_get_the_default_granularity(fake, monkeypatch):
    monkeypatch.delattr(type(fake), "CUdevSmResourceSplit_flags")
    d = dev.Device.open(0, sms=20)
    assert d.sms == 24  # 8-SM granularity on compute capability 9.0
    d.close()


def test_engine_runs_in_the_green_context(tiny_checkpoint, tmp_path):
    prompt, params = [2, 17, 33, 5, 9], SamplingParams(temperature=0.0)
    try:
        whole = EE.open_emulated(tiny_checkpoint, tmp_path / "whole", ctx=64)
        want = whole.generate(prompt, 4, params).token_ids
        whole.close()
        limited = EE.open_emulated(tiny_checkpoint, tmp_path / "green", ctx=64, sms=20)
        fake = dev.driver()
        got = limited.generate(prompt, 4, params).token_ids
        assert limited.device.sms == 20 and got == want
        assert fake.launch_contexts == {fake.green_contexts[0].ctx}
        limited.close()
        assert fake.green_contexts[0].destroyed
    finally:
        dev.set_driver(None)


def test_bench_sms_needs_the_cuda_backend(tiny_checkpoint):
    from click.testing import CliRunner

    from thorgen.runtime.bench.cli import bench

    res = CliRunner().invoke(
        bench,
        [
            "--model",
            str(tiny_checkpoint),
            "--backend",
            "reference",
            "--sms",
            "20",
            "--ctx",
            "64",
            "--gen",
            "2",
            "--runs",
            "1",
            "--prompt-len",
            "4",
        ],
    )
    assert res.exit_code != 0 and "--backend cuda" in res.output
    res = CliRunner().invoke(bench, ["--model", str(tiny_checkpoint), "--sms", "0"])
    assert res.exit_code != 0 and "--sms" in res.output
