"""The format refusals through the CLI (`thorgen repack-weights`, `thorgen prepare`): one line, nonzero exit, no
traceback; `synth-checkpoint --format` and `repack-weights --quantize nvfp4` printing the error report."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from thorgen.cli import main
from thorgen.model_spec.safetensors_io import SafetensorsFile, write_safetensors
from thorgen.model_spec.tensors import TARGET_PREFIX

P = TARGET_PREFIX


def _edit_json(path, edit):
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _drop_field(folder):
    _edit_json(folder / "hf_quant_config.json", lambda d: d["quantization"].pop("group_size"))
    return "missing field 'group_size'"


def _mixed_role(folder):
    _edit_json(
        folder / "hf_quant_config.json", lambda d: d["quantization"]["exclude_modules"].remove(f"{P}layers.1.mlp*")
    )
    return "dense_mlp linears mix formats"


def _bf16_where_quantized(folder):
    def edit(d):
        d["quantization"]["exclude_modules"] = [p for p in d["quantization"]["exclude_modules"] if ".mlp*" not in p]

    _edit_json(folder / "hf_quant_config.json", edit)
    _edit_json(
        folder / "config.json",
        lambda d: d["quantization_config"].update(
            ignore=[p for p in d["quantization_config"]["ignore"] if ".mlp*" not in p]
        ),
    )
    return "mlp.gate_proj.weight' is BF16 but"


def _scale_shape(folder):
    files = sorted(folder.glob("model*.safetensors"))
    name = f"{P}layers.0.experts.2.gate_proj.weight_scale_2"
    for path in files:
        f = SafetensorsFile(path)
        if name in f.entries:
            arrays = {n: (e.dtype, np.array(f.array(n))) for n, e in f.entries.items()}
            del f
            arrays[name] = ("F32", arrays[name][1].reshape(1, 1))
            write_safetensors(path, arrays)
    return r"weight_scale_2' is F32[1, 1], expected F32[]"


def _unknown_method(folder):
    (folder / "hf_quant_config.json").unlink()
    _edit_json(folder / "config.json", lambda d: d["quantization_config"].update(quant_method="awq"))
    return "quant_method 'awq' is not supported"


@pytest.mark.parametrize("breaks", [_drop_field, _mixed_role, _bf16_where_quantized, _scale_shape, _unknown_method])
@pytest.mark.parametrize("command", ["repack-weights", "prepare"])
def test_refusals_are_one_line_errors(breaks, command, tiny_format_checkpoints, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_format_checkpoints["modelopt"], folder)
    want = breaks(folder)
    args = [command, "--model", str(folder)] + (
        ["--out", str(tmp_path / "art")] if command == "repack-weights" else ["--arch", "sm_90a"]
    )
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert want in lines[0] and "Traceback" not in result.output
    assert not (tmp_path / "art").exists()


def test_synth_format_and_quantize_report_through_the_cli(tmp_path):
    runner = CliRunner()
    out = tmp_path / "bf16"
    r = runner.invoke(main, ["synth-checkpoint", "--preset", "tiny", "--out", str(out), "--format", "bf16", "--quiet"])
    assert r.exit_code == 0, r.output
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    r = runner.invoke(
        main,
        [
            "repack-weights",
            "--model",
            str(out),
            "--out",
            str(tmp_path / "art"),
            "-q",
            "--quantize",
            "nvfp4",
            "--jobs",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "quantized layers.0.self_attn.q_proj: max rel err" in r.output
    assert "quantized layers.0.experts.*.down_proj:" in r.output
    assert (tmp_path / "art" / "quantization_report.json").is_file()
    mo = tmp_path / "mo"
    r = runner.invoke(
        main,
        [
            "synth-checkpoint",
            "--preset",
            "tiny",
            "--out",
            str(mo),
            "--format",
            "modelopt",
            "--modelopt-variant",
            "all-linear",
            "--quiet",
        ],
    )
    assert r.exit_code == 0 and (mo / "hf_quant_config.json").is_file()
    assert not any(
        "self_attn" in p
        for p in json.loads((mo / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    )
