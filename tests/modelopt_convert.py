"""Rewriting a compressed-tensors checkpoint as ModelOpt NVFP4 (the exact oracle of the ModelOpt reader and repack):
the same packed bytes and block scales, weight_scale_2 = float32(1)/weight_global_scale as a 0-d F32, input_scale =
float32(1)/input_global_scale, roles the variant leaves bf16 written as the bf16 of the dequantized weight, and the
config.json quantization_config + hf_quant_config.json of a ModelOpt export; the vision tower copied as it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from thorgen.model_spec.checkpoint import Checkpoint
from thorgen.model_spec.config import hf_quant_config, target_config
from thorgen.model_spec.nvfp4 import f32_to_bf16, multiplier_of_divisor
from thorgen.model_spec.safetensors_io import write_safetensors
from thorgen.model_spec.tensors import target_linears
from thorgen.model_spec.types import ALL_NVFP4, EXPERTS_ONLY_NVFP4

VARIANTS = {"all-linear": ALL_NVFP4, "experts-only": EXPERTS_ONLY_NVFP4}
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def convert_ct_to_modelopt(
    src: Path, dst: Path, variant: str = "all-linear", gate_up_scale_2: dict[str, float] | None = None
) -> Path:
    """Write the ModelOpt form of the compressed-tensors checkpoint `src` into `dst` (one model.safetensors).
    gate_up_scale_2: {linear prefix: weight_scale_2} overrides, to write deliberately unequal gate/up scalars."""
    formats = VARIANTS[variant]
    ck = Checkpoint.open(src)
    spec = ck.spec
    top = Path(src).resolve()
    shutil.copytree(
        src,
        dst,
        ignore=lambda folder, names: [
            n for n in names if Path(folder).resolve() == top and (n.endswith((".safetensors", ".index.json")))
        ],
    )
    linears = {
        lin.prefix: lin
        for layer in range(spec.target.num_hidden_layers)
        for lin in target_linears(spec.target, layer, "modelopt", formats)
    }
    arrays: dict[str, tuple[str, np.ndarray]] = {}
    for info in ck.target_inventory:
        name = info.name
        if not ck.has_tensor(name):
            continue
        prefix, _, suffix = name.rpartition(".")
        if prefix not in linears or suffix not in CT_SUFFIXES:
            arrays[name] = (info.dtype, np.array(ck.tensor(name)))
            continue
        lin = linears[prefix]
        if lin.storage == "bf16":
            if suffix == "weight_packed":
                arrays[prefix + ".weight"] = ("BF16", f32_to_bf16(ck.linear_f32(prefix)))
        elif suffix == "weight_packed":
            arrays[prefix + ".weight"] = ("U8", np.array(ck.tensor(name)))
        elif suffix == "weight_scale":
            arrays[name] = ("F8_E4M3", np.array(ck.tensor(name)))
        elif suffix == "weight_global_scale":
            s2 = (gate_up_scale_2 or {}).get(prefix, multiplier_of_divisor(ck.tensor(name)[0]))
            arrays[prefix + ".weight_scale_2"] = ("F32", np.array(s2, np.float32))
        else:
            arrays[prefix + ".input_scale"] = ("F32", np.array(multiplier_of_divisor(ck.tensor(name)[0])))
    for info in ck.vision_inventory:  # the tower is bf16 in every format (its standardize buffers may be F32)
        tower = np.array(ck.tensor(info.name))
        arrays[info.name] = ("F32" if tower.dtype == np.float32 else info.dtype, tower)
    write_safetensors(dst / "model.safetensors", arrays)
    (dst / "config.json").write_text(json.dumps(target_config(spec.target, spec.vision, "modelopt", formats)))
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant_config(spec.target, formats), indent=4))
    return dst
