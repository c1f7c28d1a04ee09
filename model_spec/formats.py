"""Model spec stage: which checkpoint format a folder holds (compressed-tensors NVFP4, ModelOpt NVFP4 or bf16),
read from config.json and hf_quant_config.json, and the per-role linear formats that follow from its exclusions.

Formats and the tensors of one quantized linear `P` (every scale kept as the checkpoint stores it):
  * "compressed-tensors" (RedHatAI): P.weight_packed U8 [N, K/2], P.weight_scale F8_E4M3 [N, K/16],
    P.weight_global_scale F32 [1] (a DIVISOR, 2688/amax), optional P.input_global_scale F32 [1];
    `quantization_config.ignore` lists the unquantized modules (names, or `re:` regular expressions).
  * "modelopt" (NVIDIA Model Optimizer): P.weight U8 [N, K/2], P.weight_scale F8_E4M3 [N, K/16],
    P.weight_scale_2 F32 [] (a MULTIPLIER, amax/2688), optional P.input_scale F32 []; exclusions are
    `hf_quant_config.json` quantization.exclude_modules (or config.json quantization_config.ignore), fnmatch
    wildcards such as `model.language_model.layers.0.self_attn*`.
  * "bf16" (Google's original): no quantization_config, every linear P.weight BF16 [N, K].
An excluded (or bf16-checkpoint) linear is P.weight BF16 [N, K] in every format.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass

from .tensors import target_linears
from .types import ALL_BF16, LinearFormats, ModelSpec, SpecError
from .weight_layout import GROUP

SOURCE_FORMATS = ("compressed-tensors", "modelopt", "bf16")
CT_FORMAT = "nvfp4-pack-quantized"
MODELOPT_ALGOS = ("NVFP4", "W4A16_NVFP4")
ROLES = ("attention", "dense_mlp", "experts")
HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass(frozen=True)
class CheckpointFormat:
    """The source format and its exclusion patterns; `excluded(prefix)` says whether a linear is left bf16."""

    source: str
    exclusions: tuple[str, ...] = ()

    def excluded(self, prefix: str) -> bool:
        if self.source == "bf16":
            return True
        return any(_matches(pattern, prefix, self.source) for pattern in self.exclusions)

    def linear_format(self, prefix: str) -> str:
        return "bf16" if self.excluded(prefix) else "nvfp4"


def _matches(pattern: str, name: str, source: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    if source == "modelopt":
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.startswith(pattern + ".")  # compressed-tensors module names


def role_of(prefix: str) -> str:
    """The LinearFormats role of a target linear prefix (...self_attn.q_proj, ...mlp.up_proj,
    ...experts.3.down_proj)."""
    if ".experts." in prefix:
        return "experts"
    if ".self_attn." in prefix:
        return "attention"
    if ".mlp." in prefix:
        return "dense_mlp"
    raise SpecError(f"{prefix}: not a target linear of a known role ({', '.join(ROLES)})")


def _check_ct(q: dict) -> CheckpointFormat:
    if q.get("format") != CT_FORMAT:
        raise SpecError(f"config.json: quantization format {q.get('format')!r} is not supported ({CT_FORMAT})")
    for name, group in q.get("config_groups", {}).items():
        w = group.get("weights") or {}
        got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("strategy"))
        if got != (4, "float", GROUP, "tensor_group"):
            raise SpecError(
                f"config.json: quantization group {name} weights {got} are not NVFP4 "
                f"(4, 'float', {GROUP}, 'tensor_group')"
            )
    ignore = q.get("ignore", [])
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise SpecError("config.json: quantization_config.ignore must be a list of module names")
    return CheckpointFormat("compressed-tensors", tuple(ignore))


def _modelopt_group_size(q: dict, where: str) -> object:
    if "group_size" in q:
        return q["group_size"]
    groups = q.get("config_groups")
    if isinstance(groups, dict) and groups:
        sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values() if isinstance(g, dict)}
        if len(sizes) == 1:
            return sizes.pop()
        raise SpecError(f"{where}: config_groups disagree on weights.group_size ({sorted(map(str, sizes))})")
    raise SpecError(f"{where}: missing field 'group_size'")


def _check_modelopt(q: dict, where: str, exclusions_key: str, need: tuple[str, ...]) -> CheckpointFormat:
    for key in need:
        if key not in q:
            raise SpecError(f"{where}: missing field {key!r}")
    algo = q.get("quant_algo")
    if algo not in MODELOPT_ALGOS:
        raise SpecError(f"{where}: quant_algo {algo!r} is not supported ({', '.join(MODELOPT_ALGOS)})")
    group = _modelopt_group_size(q, where)
    if group != GROUP:
        raise SpecError(f"{where}: group_size {group!r} is not NVFP4's {GROUP}")
    patterns = q.get(exclusions_key, [])
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise SpecError(f"{where}: {exclusions_key} must be a list of module patterns")
    return CheckpointFormat("modelopt", tuple(patterns))


def detect_format(config: dict, hf_quant_config: dict | None) -> CheckpointFormat:
    """The checkpoint's format from its config.json and (ModelOpt) hf_quant_config.json; SpecError if unknown."""
    q = config.get("quantization_config")
    if hf_quant_config is not None:
        producer = (hf_quant_config.get("producer") or {}).get("name")
        quant = hf_quant_config.get("quantization")
        if producer != "modelopt" or not isinstance(quant, dict):
            raise SpecError(
                f"{HF_QUANT_CONFIG}: producer {producer!r} with no 'quantization' object is not a ModelOpt export"
            )
        fmt = _check_modelopt(
            quant,
            f"{HF_QUANT_CONFIG} quantization",
            "exclude_modules",
            ("quant_algo", "group_size", "kv_cache_quant_algo", "exclude_modules"),
        )
        if q is not None and (q.get("quant_method") != "modelopt" or q.get("quant_algo") != quant["quant_algo"]):
            raise SpecError(
                f"config.json: quantization_config (quant_method {q.get('quant_method')!r}, quant_algo "
                f"{q.get('quant_algo')!r}) disagrees with {HF_QUANT_CONFIG} (modelopt, "
                f"{quant['quant_algo']!r})"
            )
        return fmt
    if q is None:
        return CheckpointFormat("bf16")
    if not isinstance(q, dict):
        raise SpecError("config.json: quantization_config is not an object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _check_ct(q)
    if method == "modelopt":
        key = "ignore" if "ignore" in q else "exclude_modules"
        return _check_modelopt(q, "config.json quantization_config", key, ("quant_algo", key))
    raise SpecError(
        f"config.json: quant_method {method!r} is not supported ({', '.join(SOURCE_FORMATS[:2])}, "
        "or no quantization_config for bf16)"
    )


def linear_formats_of(fmt: CheckpointFormat, prefixes: list[str]) -> LinearFormats:
    """One format per role over every target linear prefix; a role with mixed formats is refused, naming a
    linear of each format."""
    if fmt.source == "bf16":
        return ALL_BF16
    seen: dict[str, dict[str, str]] = {r: {} for r in ROLES}
    for prefix in prefixes:
        seen[role_of(prefix)].setdefault(fmt.linear_format(prefix), prefix)
    for role, kinds in seen.items():
        if len(kinds) > 1:
            raise SpecError(
                f"{role} linears mix formats: {kinds['nvfp4']!r} is NVFP4 but {kinds['bf16']!r} is "
                "excluded (bf16); thorgen serves one format per role"
            )
    return LinearFormats(**{role: next(iter(kinds), "nvfp4") for role, kinds in seen.items()})


def with_checkpoint_formats(spec: ModelSpec, config: dict, hf_quant_config: dict | None) -> ModelSpec:
    """`spec` with the per-role linear formats its checkpoint's config.json (and hf_quant_config.json) declare, from
    the configs alone (SpecError as detect_format / linear_formats_of): the formats `thorgen build --model` plans
    kernels for and the cuda backend expects (Checkpoint.open derives the same from the same configs)."""
    fmt = detect_format(config, hf_quant_config)
    prefixes = [
        lin.prefix for layer in range(spec.target.num_hidden_layers) for lin in target_linears(spec.target, layer)
    ]
    return dataclasses.replace(spec, linear_formats=linear_formats_of(fmt, prefixes))
