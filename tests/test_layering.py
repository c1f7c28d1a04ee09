"""The pipeline's dependencies point one way: model_spec <- codegen, model_spec <- runtime <- serve.

codegen never imports runtime or serve; runtime never imports codegen (it reads build artifacts: manifest.json)
or serve; model_spec imports none of the later stages. The one sanctioned exception is `thorgen bench --kernels`,
a developer tool that runs codegen's kernel benchmark by module name (runpy), not by import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {"model_spec": {"codegen", "runtime", "serve"}, "codegen": {"runtime", "serve"},
             "runtime": {"codegen", "serve"}}


def _imported_stages(path: Path, stage: str, root: Path = ROOT) -> set[str]:
    """Top-level thorgen stages a module imports (absolute thorgen.x or relative imports resolved from its folder)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    depth_of_file = len(path.relative_to(root).parts) - 1  # folders below the package root
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                names = [node.module or ""]
            else:  # resolve `from ..x import y` against the file's folder inside the package
                parts = list(path.relative_to(root).parts[:-1])
                up = node.level - 1
                if up > depth_of_file:
                    continue
                base = parts[:len(parts) - up] if up else parts
                mod = (node.module or "").split(".") if node.module else [a.name for a in node.names][:1]
                names = [".".join(["thorgen", *base, *mod])]
        else:
            continue
        for name in names:
            bits = name.split(".")
            if bits[0] == "thorgen" and len(bits) > 1:
                found.add(bits[1])
    return found - {stage}


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_stage_imports_point_one_way(stage: str) -> None:
    bad = []
    for path in sorted((ROOT / stage).rglob("*.py")):
        hits = _imported_stages(path, stage) & FORBIDDEN[stage]
        if hits:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(hits)}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_relative_imports(tmp_path: Path) -> None:
    """Guard against a checker that cannot fail: a planted relative import of codegen from runtime is caught."""
    (tmp_path / "runtime" / "sub").mkdir(parents=True)
    planted = tmp_path / "runtime" / "sub" / "probe.py"
    planted.write_text("from ...codegen import plan\nimport thorgen.serve.app\nfrom . import engine\n")
    assert _imported_stages(planted, "runtime", root=tmp_path) == {"codegen", "serve"}
