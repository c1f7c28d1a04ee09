"""pyproject.toml's package list names every package of the repository, so a wheel (and `.ci/run`'s install) ships
them."""

from __future__ import annotations

import tomllib
from pathlib import Path

from repo_files import repo_files

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "build", ".git", ".ci", "docs", "templates"}


def test_every_package_is_listed() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"thorgen"}
    for init in repo_files("__init__.py", ROOT):  # what git tracks: a .venv in the checkout holds none of ours
        rel = init.parent.relative_to(ROOT)
        if rel.parts and rel.parts[0] not in SKIP:
            found.add(".".join(("thorgen",) + rel.parts))
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
