"""Model spec stage: open and validate a Gemma-4 checkpoint (+ z-lab DFlash drafter), memory-mapped.

`Checkpoint.open(model_dir)` reads the configs into a ModelSpec, detects the checkpoint's format (RedHatAI's
compressed-tensors NVFP4, NVIDIA's ModelOpt NVFP4, or Google's bf16: model_spec/formats.py) and the per-role
linear formats that follow, and validates the whole tensor inventory (names, dtypes, shapes, file sizes, global
scales) against model_spec.tensors before anything runs. Tensor data is only touched on request: opening the
16 GB checkpoint reads its headers and the ~12k scalar global scales, nothing else.
Every NVFP4 scale leaves this module as a MULTIPLIER (`nvfp4_parts`): compressed-tensors' divisor g becomes
float32(1)/float32(g) here, ModelOpt's weight_scale_2 is one already; nothing downstream inverts a scale.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np

from .config import spec_from_configs
from .formats import HF_QUANT_CONFIG, detect_format, linear_formats_of
from .nvfp4 import bf16_to_f32, dequantize_nvfp4, dequantize_nvfp4_mul, multiplier_of_divisor
from .safetensors_io import CheckpointError, SafetensorsDir
from .tensors import TensorInfo, drafter_tensors, ignored_prefixes, target_linears, target_tensors, vision_tensors
from .types import ModelSpec, SpecError

__all__ = ["Checkpoint", "CheckpointError"]

MAX_LISTED = 8  # names listed in an error before "... and N more"
SCALAR_ROLES = ("weight_global_scale", "input_global_scale", "weight_scale_2", "input_scale", "kv_scale")


def _listing(names: list[str]) -> str:
    more = f" ... and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else ""
    return ", ".join(names[:MAX_LISTED]) + more


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing ({what})")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot parse {what}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object")
    return data


def _validate_inventory(
    st: SafetensorsDir, expected: list[TensorInfo], where: str, ignored: tuple[str, ...] = ()
) -> None:
    """Missing / extra / wrong dtype / wrong shape, every problem at once, each naming file and tensor."""
    want = {t.name: t for t in expected}
    missing = [t.name for t in expected if not t.optional and t.name not in st]
    extra = [n for n in st.where if n not in want and not n.startswith(ignored)]
    wrong = []
    for t in expected:
        if t.name in st:
            e = st.entry(t.name)
            if not t.accepts(e.dtype) or e.shape != tuple(t.shape):
                wrong.append(
                    f"{st.file_of(t.name)}: tensor {t.name!r} is {e.dtype}{list(e.shape)}, "
                    f"expected {t.dtype}{list(t.shape)}"
                )
    problems = []
    if missing:
        problems.append(f"{where}: {len(missing)} tensor(s) missing: {_listing(missing)}")
    if extra:
        problems.append(
            f"{where}: {len(extra)} unexpected tensor(s) (in "
            f"{_listing(sorted({st.file_of(n).name for n in extra}))}): {_listing(extra)}"
        )
    problems += wrong[:MAX_LISTED] + (
        [f"... and {len(wrong) - MAX_LISTED} more dtype/shape errors"] if len(wrong) > MAX_LISTED else []
    )
    if problems:
        raise CheckpointError("\n".join(problems))


def _check_bf16_where_quantized(st: SafetensorsDir, inventory: list[TensorInfo], source: str) -> None:
    """A bf16 weight where the config says NVFP4 (a layer missing from the exclusions): one line naming it."""
    for t in inventory:
        if t.role == "weight_packed" and t.name in st and st.entry(t.name).dtype == "BF16":
            config = "hf_quant_config.json / config.json" if source == "modelopt" else "config.json"
            raise CheckpointError(
                f"{st.file_of(t.name)}: tensor {t.name!r} is BF16 but {config} says "
                f"{t.name.rsplit('.', 1)[0]!r} is NVFP4 ({source}); add it to the exclusion list"
            )
        if t.role == "weight_packed" and source == "compressed-tensors":
            plain = t.name.rsplit(".", 1)[0] + ".weight"
            if plain in st and st.entry(plain).dtype == "BF16":
                raise CheckpointError(
                    f"{st.file_of(plain)}: tensor {plain!r} is BF16 but config.json says "
                    f"{plain.rsplit('.', 1)[0]!r} is NVFP4 (compressed-tensors); add it to "
                    "quantization_config.ignore"
                )


class Checkpoint:
    """A validated, memory-mapped checkpoint. Construct with `Checkpoint.open(model_dir, draft_dir=None)`."""

    def __init__(
        self,
        model_dir: Path,
        draft_dir: Path | None,
        spec: ModelSpec,
        config: dict,
        draft_config: dict | None,
        generation_config: dict,
        tokenizer_path: Path,
        chat_template: str | None,
        target: SafetensorsDir,
        drafter: SafetensorsDir | None,
        source_format: str = "compressed-tensors",
    ) -> None:
        self.model_dir, self.draft_dir, self.spec = model_dir, draft_dir, spec
        self.config, self.draft_config, self.generation_config = config, draft_config, generation_config
        self.tokenizer_path, self.chat_template = tokenizer_path, chat_template
        self._target, self._drafter = target, drafter
        self.source_format = source_format  # "compressed-tensors" | "modelopt" | "bf16"
        self.target_inventory = target_tensors(spec.target, source_format, spec.linear_formats)
        self._storage = {
            lin.prefix: lin.storage
            for layer in range(spec.target.num_hidden_layers)
            for lin in target_linears(spec.target, layer, source_format, spec.linear_formats)
        }
        self.drafter_inventory = drafter_tensors(spec.drafter) if spec.drafter is not None else []
        self.vision_inventory = [] if spec.vision is None else vision_tensors(spec.vision, spec.target.hidden_size)

    @classmethod
    def open(cls, model_dir: str | os.PathLike, draft_dir: str | os.PathLike | None = None) -> "Checkpoint":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: not a directory")
        if draft_dir is None and (model_dir / "dflash").is_dir():
            draft_dir = model_dir / "dflash"
        draft_dir = Path(draft_dir) if draft_dir is not None else None
        config = _read_json(model_dir / "config.json", "model config")
        draft_config = _read_json(draft_dir / "config.json", "drafter config") if draft_dir is not None else None
        hf_quant = model_dir / HF_QUANT_CONFIG
        hf_quant_config = _read_json(hf_quant, "ModelOpt quantization config") if hf_quant.exists() else None
        try:
            spec = spec_from_configs(config, draft_config, name=model_dir.name)
        except SpecError as exc:  # SpecError names the file ("config.json" / "drafter config.json") and the key
            where = str(model_dir) + (f" + drafter {draft_dir}" if draft_dir else "")
            raise CheckpointError(f"{where}: {exc}") from exc
        try:  # SpecError names config.json / hf_quant_config.json and the field
            fmt = detect_format(config, hf_quant_config)
            prefixes = [
                lin.prefix
                for layer in range(spec.target.num_hidden_layers)
                for lin in target_linears(spec.target, layer)
            ]
            spec = dataclasses.replace(spec, linear_formats=linear_formats_of(fmt, prefixes))
        except SpecError as exc:
            raise CheckpointError(f"{model_dir}: {exc}") from exc
        gen_path = model_dir / "generation_config.json"
        generation_config = _read_json(gen_path, "generation config") if gen_path.exists() else {}
        tokenizer_path = model_dir / "tokenizer.json"
        if not tokenizer_path.is_file():
            raise CheckpointError(f"{tokenizer_path}: missing (the tokenizer)")
        chat_template = cls._find_chat_template(model_dir)
        target = SafetensorsDir(model_dir)
        inventory = target_tensors(spec.target, fmt.source, spec.linear_formats)
        _check_bf16_where_quantized(target, inventory, fmt.source)
        vision = [] if spec.vision is None else vision_tensors(spec.vision, spec.target.hidden_size)
        _validate_inventory(target, inventory + vision, f"{model_dir} (target)", ignored_prefixes(spec.vision))
        drafter = None
        if draft_dir is not None:
            drafter = SafetensorsDir(draft_dir)
            _validate_inventory(drafter, drafter_tensors(spec.drafter), f"{draft_dir} (drafter)")
        ckpt = cls(
            model_dir,
            draft_dir,
            spec,
            config,
            draft_config,
            generation_config,
            tokenizer_path,
            chat_template,
            target,
            drafter,
            fmt.source,
        )
        ckpt._check_global_scales()
        return ckpt

    @staticmethod
    def _find_chat_template(model_dir: Path) -> str | None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        tok_cfg = model_dir / "tokenizer_config.json"
        if tok_cfg.is_file():
            template = _read_json(tok_cfg, "tokenizer config").get("chat_template")
            if isinstance(template, str):
                return template
            if isinstance(template, list):  # HF also allows [{"name": "default", "template": ...}, ...]
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                return named.get("default") or next(iter(named.values()), None)
        return None

    def _check_global_scales(self) -> None:
        bad = []
        for t in self.target_inventory:
            if t.role in SCALAR_ROLES and t.name in self._target:
                v = self._target.array(t.name)
                if not (np.isfinite(v).all() and (v > 0).all()):
                    bad.append(
                        f"{self._target.file_of(t.name)}: tensor {t.name!r} = {v.tolist()} "
                        "(a global scale must be finite and > 0)"
                    )
        if bad:
            raise CheckpointError(
                "\n".join(bad[:MAX_LISTED])
                + (f"\n... and {len(bad) - MAX_LISTED} more" if len(bad) > MAX_LISTED else "")
            )

    # ---- tensors ----------------------------------------------------------------------------------------------
    def tensor(self, name: str) -> np.ndarray:
        """Raw memory-mapped target tensor (U8/F8_E4M3 -> uint8, BF16 -> uint16, F32 -> float32)."""
        return self._target.array(name)

    def draft_tensor(self, name: str) -> np.ndarray:
        """Raw memory-mapped drafter tensor (BF16 -> uint16)."""
        if self._drafter is None:
            raise CheckpointError(f"{self.model_dir}: this checkpoint has no drafter (tensor {name!r})")
        return self._drafter.array(name)

    def has_tensor(self, name: str) -> bool:
        return name in self._target

    def tensor_file(self, name: str) -> Path:
        return self._target.file_of(name)

    def _to_f32(self, st: SafetensorsDir, name: str) -> np.ndarray:
        if name not in st:
            raise CheckpointError(f"{st.folder}: no tensor {name!r}")
        dtype = st.entry(name).dtype
        raw = st.array(name)
        if dtype == "BF16":
            return bf16_to_f32(raw)
        if dtype in ("F32", "F16"):
            return np.array(raw, dtype=np.float32)
        raise CheckpointError(f"{st.file_of(name)}: tensor {name!r} is {dtype}, not a BF16/F32 weight")

    def weight_f32(self, name: str) -> np.ndarray:
        """float32 copy of a BF16/F32 target tensor."""
        return self._to_f32(self._target, name)

    def draft_weight_f32(self, name: str) -> np.ndarray:
        """float32 copy of a drafter tensor."""
        if self._drafter is None:
            raise CheckpointError(f"{self.model_dir}: this checkpoint has no drafter (tensor {name!r})")
        return self._to_f32(self._drafter, name)

    def linear_storage(self, prefix: str) -> str:
        """How a target linear is stored: "compressed-tensors" or "modelopt" (NVFP4), or "bf16"."""
        storage = self._storage.get(prefix)
        if storage is None:
            raise CheckpointError(f"{self.model_dir}: {prefix!r} is not a target linear of this checkpoint")
        return storage

    def _nvfp4_raw(self, prefix: str) -> tuple[np.ndarray, np.ndarray, np.float32, str]:
        """(packed, block scales, the stored scalar, storage) of one NVFP4 linear, block scales checked."""
        storage = self.linear_storage(prefix)
        if storage == "bf16":
            raise CheckpointError(
                f"{self.model_dir}: {prefix!r} is a bf16 linear in this checkpoint, not NVFP4 "
                "(read it with linear_bf16)"
            )
        suffixes = (
            ("weight", "weight_scale", "weight_scale_2")
            if storage == "modelopt"
            else ("weight_packed", "weight_scale", "weight_global_scale")
        )
        names = [f"{prefix}.{s}" for s in suffixes]
        for n in names:
            if n not in self._target:
                raise CheckpointError(f"{self.model_dir}: no tensor {n!r} (is {prefix!r} an NVFP4 Linear?)")
        packed, scale, gs = (self._target.array(n) for n in names)
        nan = (scale & 0x7F) == 0x7F
        neg = (scale & 0x80) != 0
        if nan.any() or neg.any():
            row, col = np.argwhere(nan | neg)[0]
            kind = "NaN" if nan.any() else "negative"
            raise CheckpointError(
                f"{self._target.file_of(names[1])}: tensor {names[1]!r} holds {int(nan.sum())} NaN "
                f"and {int(neg.sum())} negative E4M3 block scales (first {kind} at [{row}, {col}])"
            )
        return packed, scale, np.float32(gs.reshape(-1)[0]), storage

    def nvfp4_parts(self, prefix: str) -> tuple[np.ndarray, np.ndarray, np.float32]:
        """(packed u8 [out, in/2], block scales u8 [out, in/16], global MULTIPLIER f32) of one NVFP4 Linear:
        w = e2m1 * e4m3(scale) * multiplier. compressed-tensors: float32(1) / weight_global_scale (what the
        kernels multiply by); ModelOpt: weight_scale_2 as stored. Each part keeps its own (gate and up too)."""
        packed, scale, stored, storage = self._nvfp4_raw(prefix)
        return packed, scale, stored if storage == "modelopt" else multiplier_of_divisor(stored)

    def linear_bf16(self, prefix: str) -> np.ndarray:
        """Raw bf16 bits (uint16 [out, in]) of a target linear stored bf16 (e.g. ...layers.0.self_attn.q_proj)."""
        if self.linear_storage(prefix) != "bf16":
            raise CheckpointError(
                f"{self.model_dir}: {prefix!r} is an NVFP4 linear in this checkpoint, not bf16 "
                "(read it with nvfp4_parts)"
            )
        return self._target.array(prefix + ".weight")

    def linear_f32(self, prefix: str) -> np.ndarray:
        """float32 [out, in] weight of a target Linear prefix (e.g. ...layers.0.self_attn.q_proj): bf16 widened,
        or NVFP4 dequantized as its format defines it (compressed-tensors e2m1 * (e4m3 / g), ModelOpt
        e2m1 * (e4m3 * weight_scale_2))."""
        if self.linear_storage(prefix) == "bf16":
            return bf16_to_f32(self.linear_bf16(prefix))
        packed, scale, stored, storage = self._nvfp4_raw(prefix)
        if storage == "modelopt":
            return dequantize_nvfp4_mul(packed, scale, stored)
        return dequantize_nvfp4(packed, scale, stored)

    def __repr__(self) -> str:
        return f"Checkpoint({self.model_dir}, drafter={self.draft_dir}, tensors={len(self._target.where)})"
