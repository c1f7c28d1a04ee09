"""Every repository path, module and relative link the docs name exists: README.md, docs/*.md and
docs/benchmarks/NOTES.md (paths such as `probes/x.json` there, and in the BENCHMARKS.md made from it, are relative
to docs/benchmarks; a `*` pattern must match a file). The files under docs/ are named by what they hold, never by a
run's place in a series of work (`-s28-`, `-c3-`)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "docs" / "benchmarks"
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), BENCH / "NOTES.md"]
ROOTS = r"(?:model_spec|codegen|runtime|serve|tests|templates|build|docs|\.ci)"
REPO_PATH = re.compile(rf"(?<![\w/.-]){ROOTS}/[\w/.*-]*\w")
BENCH_PATH = re.compile(r"(?<![\w/.-])(?:probes/[\w.*-]+|h[0-9]+-[\w.*-]+\.json)")
MODULE = re.compile(r"(?<![\w/.-])(?:thorgen\.)?(?:model_spec|codegen|runtime|serve)(?:\.\w+)+")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
SERIES_TAG = re.compile(r"(?:^|[-_])(?:s[0-9]{2}|c[0-9])(?=[-_.])")
# named on purpose though not here: a file of sgl-project/sgl-cookbook the benchmarks cite, and the module the
# committed kernel runs were measured with (thorgen.runtime.bench.kernels now)
ELSEWHERE = {"docs/autoregressive/Google/Gemma4.md", "thorgen.codegen.bench_kernels"}


def _exists(base: Path, name: str) -> bool:
    if "*" in name:
        return any(base.glob(name))
    return (base / name).exists() or (base / f"{name}.py").exists()


def _module_exists(dotted: str) -> bool:
    """A dotted name: its longest leading module of the package, then names that module's source defines or uses
    (`model_spec.step_program.program_key`, `runtime.dataflow.PlannedPointers` fails: no runtime/dataflow.py)."""
    parts = dotted.split(".")[1:] if dotted.startswith("thorgen.") else dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = REPO.joinpath(*parts[:i])
        source = path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"
        if source.is_file():
            text = source.read_text()
            return all(re.search(rf"\b{name}\b", text) for name in parts[i:])
    return False


def missing_names(doc: Path) -> list[str]:
    text = doc.read_text()
    missing = [p for p in REPO_PATH.findall(text) if p not in ELSEWHERE and not _exists(REPO, p)]
    missing += [p for p in BENCH_PATH.findall(text) if not _exists(BENCH, p)]
    missing += [m for m in MODULE.findall(text) if m not in ELSEWHERE and not _module_exists(m)]
    missing += [
        link
        for link in LINK.findall(text)
        if "://" not in link and not link.startswith("mailto:") and not (doc.parent / link).exists()
    ]
    return sorted(set(missing))


def test_docs_name_only_what_exists():
    found = {str(doc.relative_to(REPO)): missing_names(doc) for doc in DOCS}
    stale = {doc: names for doc, names in found.items() if names}
    assert not stale, f"docs name paths, modules or links that do not exist: {stale}"


def test_docs_files_are_named_by_what_they_hold():
    tagged = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*") if SERIES_TAG.search(p.name))
    assert not tagged, f"name these by what they measure: {tagged}"
    assert SERIES_TAG.search("h200-s28-c3-probe-fold.json") and SERIES_TAG.search("run-c2.json")
    assert not SERIES_TAG.search("h200-step-probe-dense-fold-racy-f4ed264.json")


def test_the_scan_finds_what_is_missing(tmp_path):
    doc = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("")
    doc.write_text(
        "see **runtime/client.py**, runtime/nowhere.py, `thorgen.serve.app`, serve.gone.module, "
        "`probes/probe_step.py`, `probes/nothing-*.json`, [a](other.md#x), [b](gone.md) and "
        "[c](https://example.com/x.md)\n"
    )
    assert missing_names(doc) == ["gone.md", "probes/nothing-*.json", "runtime/nowhere.py", "serve.gone.module"]
