"""docs/cli.md is tests/cli_docs.py's rendering of the click commands, and its environment table names exactly the
THORGEN_* variables the package reads."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import cli_docs
from repo_files import repo_files
from thorgen.cli import COMMANDS, SUBCOMMANDS

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("model_spec", "codegen", "runtime", "serve")


def _unloadable() -> str | None:
    """Why some command cannot be imported here (its stage's optional dependency is missing), or None."""
    targets = [*COMMANDS.values(), *(t for subs in SUBCOMMANDS.values() for t in subs.values())]
    for target in targets:
        try:
            importlib.import_module(target.split(":")[0])
        except ImportError as exc:
            return f"{target}: {exc}"
    return None


def test_cli_md_is_generated_from_the_commands():
    missing = _unloadable()
    if missing:
        pytest.skip(f"a command cannot load, so its options cannot be listed: {missing}")
    assert (REPO / "docs" / "cli.md").read_text() == cli_docs.render(), (
        "docs/cli.md is stale: run `python tests/cli_docs.py > docs/cli.md` from the repository root"
    )


def test_rendering_ignores_the_terminal_width(monkeypatch):
    wide = cli_docs.render()
    monkeypatch.setenv("COLUMNS", "40")
    assert cli_docs.render() == wide


def test_every_command_has_a_section():
    text = cli_docs.render()
    for name in COMMANDS:
        assert f"## `thorgen {name}`" in text
    for group, subs in SUBCOMMANDS.items():
        for name in subs:
            assert f"## `thorgen {group} {name}`" in text


def test_markdown_escapes_only_outside_code_spans():
    assert cli_docs.markdown("MODEL/<arch>, `<bos>` and '*'") == r"MODEL/\<arch>, `<bos>` and '\*'"
    assert cli_docs.markdown("[a|b] `x|y`", cell=True) == r"[a\|b] `x\|y`"
    assert cli_docs.markdown("one\n    paragraph") == "one paragraph"


def test_environment_table_names_the_variables_the_package_reads():
    sources = [p for p in repo_files("*.py", REPO) if p.parent == REPO or p.relative_to(REPO).parts[0] in PACKAGE_DIRS]
    read = {name for path in sources for name in re.findall(r"\bTHORGEN_[A-Z0-9_]+", path.read_text())}
    assert read == set(cli_docs.ENVIRONMENT), (
        f"tests/cli_docs.py ENVIRONMENT lacks {sorted(read - set(cli_docs.ENVIRONMENT))}, "
        f"names unused {sorted(set(cli_docs.ENVIRONMENT) - read)}"
    )
