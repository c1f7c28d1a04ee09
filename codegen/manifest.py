"""Codegen stage: manifest.json, the plain-JSON contract that ties built cubins to a spec hash and an arch.

The runtime reads this file with `json` alone (it never imports codegen). Schema (model_spec/conventions.py
MANIFEST_SCHEMA = 3):
  {"schema": 3, "model": str, "spec_hash": str, "arch": str, "nvcc": str, "flags": [str],
   "conventions": {act_dtype, gemm_out_dtype, q_dtype, kv_dtypes, max_step_tokens, pdl, ring_slots: {window: slots},
                   kv_page, page_pitch},
   "kernels": {name: {"cubin": file name beside manifest.json, "entry": extern "C" symbol, "family", "template",
                      "grid": [x,y,z], "block": [x,y,z], "smem_bytes": dynamic smem, "args": [names in order],
                      "params": {constants, with the launch-grid rules ROW_AXIS / ROW_GRID / ROWWISE_GRID /
                                 ROWWISE_SPLITS (codegen/families/__init__.py)}, "access": {arg: "r" | "w" | "rw"},
                      "registers", "spills", "static_smem_bytes"}},
   "programs": {kv dtype: {program key: [{"lo", "hi", "launches": [...]}]}}, "programs_missing": {group: [str]}}
   (the step programs: codegen/programs.py)
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..model_spec.conventions import KV_PAGE, MANIFEST_SCHEMA, page_pitch
from ..model_spec.paths import MANIFEST_NAME
from ..model_spec.types import ModelSpec
from . import families
from .arch import ArchSpec
from .kernel_spec import KernelSpec
from .nvcc import PtxasInfo
from .programs import emit_programs
from .render import arg_access

PROGRAMS_NAME = "programs.json.gz"


def conventions(spec: ModelSpec) -> dict:
    windows = {spec.target.sliding_window} | ({spec.drafter.sliding_window} if spec.drafter else set())
    return {
        "act_dtype": families.ACT_DTYPE,
        "gemm_out_dtype": families.GEMM_OUT_DTYPE,
        "q_dtype": families.Q_DTYPE,
        "kv_dtypes": list(families.KV_DTYPES),
        "max_step_tokens": families.MAX_STEP_TOKENS,
        "pdl": families.PDL,
        "kv_layout": "[slot][kv_head][head_dim], K and V separate",
        "ring_slots": {str(w): families.ring_slots(w) for w in sorted(windows)},
        # the target's full-attention layers: pages of kv_page positions, page_pitch entries a sequence
        "kv_page": KV_PAGE,
        "page_pitch": page_pitch(spec.target.max_position_embeddings),
    }


def build_manifest(
    spec: ModelSpec,
    arch: ArchSpec,
    kernels: list[KernelSpec],
    infos: dict[str, PtxasInfo],
    nvcc: str,
    flags: list[str],
    sources: dict[str, str] | None = None,
) -> dict:
    """`sources` (name -> rendered .cu): each entry also gets its args' access (render.arg_access)."""
    entries = {}
    for k in kernels:
        info = infos.get(k.name, PtxasInfo())
        entries[k.name] = {
            "cubin": f"{k.name}.cubin",
            "entry": k.name,
            "family": k.family,
            "template": k.template,
            "grid": list(k.grid),
            "block": list(k.block),
            "smem_bytes": k.smem_bytes,
            "args": list(k.args),
            "params": dict(k.params),
            "registers": info.registers,
            "spills": info.spills,
            "static_smem_bytes": info.smem_bytes,
        }
        if sources is not None:
            entries[k.name]["access"] = arg_access(sources[k.name], k)
    conv = conventions(spec)
    steps = emit_programs(spec, arch, kernels, conv["kv_dtypes"], conv["max_step_tokens"])
    return {
        "schema": MANIFEST_SCHEMA,
        "model": spec.name,
        "spec_hash": spec.spec_hash,
        "arch": arch.name,
        "nvcc": nvcc,
        "flags": [f for f in flags if not f.startswith("-I")],
        "conventions": conv,
        "kernels": entries,
        "programs": steps["programs"],
        "programs_missing": steps["missing"],
    }


def write_manifest(out_dir: Path, manifest: dict) -> Path:
    """manifest.json, with the step programs (tens of MB of JSON, ~40x smaller compressed) in PROGRAMS_NAME beside it
    ("programs_file" names it; load_manifest reads either form)."""
    path = Path(out_dir) / MANIFEST_NAME
    manifest = dict(manifest)
    if isinstance(manifest.get("programs"), dict):
        blob = gzip.compress(json.dumps(manifest.pop("programs"), separators=(",", ":")).encode(), mtime=0)
        tmp = path.with_name(PROGRAMS_NAME + ".tmp")
        tmp.write_bytes(blob)
        tmp.replace(path.with_name(PROGRAMS_NAME))
        manifest["programs_file"] = PROGRAMS_NAME
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
    return path
