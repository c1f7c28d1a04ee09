"""Test support (not a test module): the repository's own files, as git sees them, for the tests that walk the tree:
tracked files and new ones git does not ignore, so that a virtual environment, a build folder or any other ignored
path inside the checkout (the README's quickstart makes `.venv` there) is never taken for the project's code."""

from __future__ import annotations

import subprocess
from functools import lru_cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@lru_cache(maxsize=4)
def _listed(root: Path) -> tuple[Path, ...] | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return tuple(sorted(root / name for name in out.decode().split("\0") if name))


def repo_files(pattern: str = "*", root: Path = REPO) -> list[Path]:
    """The files under `root` whose name matches `pattern` (a glob on the name), as git lists them (deleted ones
    left out); outside a git checkout, every file except under hidden folders (`.venv`, `.git`)."""
    listed = _listed(root)
    if listed is None:
        return sorted(
            p
            for p in root.rglob(pattern)
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts[:-1])
        )
    return [p for p in listed if p.match(pattern) and p.is_file()]
