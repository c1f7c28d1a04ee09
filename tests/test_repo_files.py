"""The tree-walking tests see what git tracks: a virtual environment inside the checkout (the README's quickstart
puts `.venv` there; others name it `venv`) holds packages that are not the project's, and no walk finds them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from repo_files import REPO, repo_files


def test_a_virtual_environment_in_the_checkout_is_not_walked(tmp_path: Path) -> None:
    if shutil.which("git") is None:
        pytest.skip("git not installed")
    for rel in ("pkg/__init__.py", "pkg/mod.py", ".venv/lib/site/x/__init__.py", "venv/lib/y/__init__.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / ".gitignore").write_text("/.venv/\n/venv/\n")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "pkg/__init__.py", ".gitignore"], check=True)
    found = [p.relative_to(tmp_path).as_posix() for p in repo_files("*.py", tmp_path)]
    assert found == ["pkg/__init__.py", "pkg/mod.py"]  # tracked, and new but not ignored
    assert [p.relative_to(tmp_path).as_posix() for p in repo_files("__init__.py", tmp_path)] == ["pkg/__init__.py"]


def test_the_checkout_itself_is_listed() -> None:
    names = {p.relative_to(REPO).as_posix() for p in repo_files("*.py")}
    assert {"cli.py", "serve/app.py", "tests/repo_files.py"} <= names
    assert not any(n.startswith((".venv/", "venv/", ".git/")) for n in names)
