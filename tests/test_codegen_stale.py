"""CPU test: the committed generated sources under build/ equal a fresh regeneration (else: run
`python -m thorgen.codegen.regen` and commit the diff)."""

from __future__ import annotations

from pathlib import Path

from thorgen.codegen.regen import BUILD_DIR, COMMITTED_ARCHS, regenerate
from thorgen.model_spec.presets import PRESETS


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): p.read_text()
        for p in sorted(root.rglob("*"))
        if p.is_file() and (p.suffix == ".cu" or p.name == "plan.json")
    }


def test_build_folder_is_fresh(tmp_path: Path) -> None:
    regenerate(tmp_path)
    fresh = _tree(tmp_path)
    committed = {k: v for k, v in _tree(BUILD_DIR).items() if k.split("/")[0] in PRESETS}
    assert fresh, "regeneration produced nothing"
    missing = sorted(set(fresh) - set(committed))
    extra = sorted(set(committed) - set(fresh))
    changed = sorted(k for k in set(fresh) & set(committed) if fresh[k] != committed[k])
    assert not (missing or extra or changed), (
        "build/ is stale; run `python -m thorgen.codegen.regen`.\n"
        f"missing: {missing[:10]}\nno longer planned: {extra[:10]}\nchanged: {changed[:10]}"
    )
    for preset in PRESETS:
        for arch in COMMITTED_ARCHS:
            assert f"{preset}/{arch}/plan.json" in fresh
