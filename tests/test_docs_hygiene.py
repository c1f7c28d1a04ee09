"""Docs hygiene: no tracked text file carries work-log words, and nothing outside tests/ depends on ../shared.

Every file `git ls-files` lists (text files; binaries such as PNGs are skipped) is scanned for words that narrate how
the work went instead of what the code does or what was measured, and for `../shared` or `/work/shared`, which a
user's checkout does not have (tests may read it and skip without it). A failure lists file:line for every hit.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Spelled in pieces so that this file does not match itself.
WORK_LOG = re.compile(
    "|".join(
        [
            r"\b(session|sessions) [0-9]",
            r"\bcall [0-9]+\b",
            r"\bissue [0-9]+\b",
            r"\bdeliver" + r"able\b",
            r"dev" + r"ice tool",
            r"\.g" + r"pu/",
            r"\bthe le" + r"ad\b",
            r"\bhelp" + r"er[- ][0-9]",
            r"\bthis sess" + r"ion\b",
        ]
    ),
    re.IGNORECASE,
)
SHARED = re.compile(r"\.\./sha" + r"red|/work/sha" + r"red")


def tracked_files(root: Path) -> list[str] | None:
    """Paths `git ls-files` lists under root, or None where git or the repository is not there."""
    if shutil.which("git") is None:
        return None
    done = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if done.returncode != 0:
        return None
    return [p for p in done.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def text_of(path: Path) -> str | None:
    """The file's text, or None for a binary (a NUL byte, or not UTF-8) or a file gone from the work tree."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def hits(root: Path, files: list[str]) -> list[str]:
    """ "file:line: text" for every work-log word, and for every ../shared outside tests/."""
    found = []
    for name in files:
        text = text_of(root / name)
        if text is None:
            continue
        outside_tests = not name.startswith("tests/")
        for number, line in enumerate(text.splitlines(), 1):
            if WORK_LOG.search(line) or (outside_tests and SHARED.search(line)):
                found.append(f"{name}:{number}: {line.strip()[:160]}")
    return found


def test_no_work_log_words_in_tracked_files():
    files = tracked_files(REPO)
    if files is None:
        pytest.skip("git or the repository's .git is not available")
    found = hits(REPO, files)
    assert not found, f"{len(found)} lines to rewrite (say what the code does or what was measured):\n" + "\n".join(
        found
    )


def test_the_scan_can_fail(tmp_path):
    """A planted work-log word, a planted ../shared outside tests/, and a binary file: the first two are caught with
    their file:line, the binary and a test's ../shared are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "docs" / "notes.md").write_text("measured\nas in Sess" + "ion 12, the decode step\n")
    (tmp_path / "README.md").write_text("traces in ../sha" + "red/seed_data\n")
    (tmp_path / "tests" / "test_x.py").write_text("SEED = '../sha" + "red/seed_data'\n")
    (tmp_path / "docs" / "plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0 sess" + b"ion 3 \xff")
    names = ["docs/notes.md", "README.md", "tests/test_x.py", "docs/plot.png", "docs/gone.md"]
    assert hits(tmp_path, names) == [
        "docs/notes.md:2: as in Sess" + "ion 12, the decode step",
        "README.md:1: traces in ../sha" + "red/seed_data",
    ]


def test_tracked_files_without_git(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert tracked_files(REPO) is None
    monkeypatch.undo()
    if shutil.which("git") is not None:  # a folder outside any repository: git fails, the scan skips
        assert tracked_files(tmp_path) is None
