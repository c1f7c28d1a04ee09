"""The package's rooms and the one way their imports point, and no import cycle anywhere.

model_spec <- codegen; model_spec <- runtime <- serve. Inside runtime each sub-package (room) has one job, and
ALLOWED says which rooms each may import: the engine core, convert, text and the reference never import cuda;
nothing imports bench; no runtime room imports codegen (the runtime reads what `thorgen build` wrote: the kernel
benchmark too, from manifest.json and bench_cases.json); serve reaches the runtime only through its client API
(api, client, the engine process (process), the engine options, the request/result types in backend, and text) and
the media room (image preprocessing), which generate and bench use too and which imports only model_spec and the
request types. Every import counts, including ones inside functions and under TYPE_CHECKING.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from repo_files import repo_files

ROOT = Path(__file__).resolve().parents[1]
SKIP = {"tests", "docs", "build", "templates", ".git", ".ci", ".setuptools-build"}
RUNTIME = {
    "runtime.backend",
    "runtime.manifest",
    "runtime.engine",
    "runtime.text",
    "runtime.convert",
    "runtime.reference",
    "runtime.cuda",
    "runtime.api",
    "runtime.client",
    "runtime.process",
    "runtime.generate",
    "runtime.media",
    "runtime.options",
}
CLIENT_API = {"runtime.api", "runtime.client", "runtime.process", "runtime.options", "runtime.backend", "runtime.text"}
ALLOWED = {
    "model_spec": set(),
    "codegen": {"model_spec"},
    "runtime": set(),  # the package's own __init__: a docstring
    "runtime.backend": {"model_spec"},
    "runtime.options": set(),  # backend-neutral: what api and the engines share without loading a cuda module
    "runtime.manifest": {"model_spec", "runtime.backend"},
    "runtime.engine": {"model_spec", "runtime.backend", "runtime.options"},
    "runtime.text": {"model_spec", "runtime.backend"},
    "runtime.media": {"model_spec", "runtime.backend"},
    "runtime.convert": {"model_spec", "runtime.backend"},
    "runtime.reference": {"model_spec", "runtime.backend", "runtime.engine", "runtime.manifest"},
    "runtime.cuda": {
        "model_spec",
        "runtime.backend",
        "runtime.engine",
        "runtime.manifest",
        "runtime.convert",
        "runtime.options",
    },
    "runtime.api": {
        "model_spec",
        "runtime.backend",
        "runtime.engine",
        "runtime.options",
        "runtime.reference",
        "runtime.cuda",
    },
    "runtime.client": {"model_spec", "runtime.backend", "runtime.engine", "runtime.cuda", "runtime.api"},
    "runtime.process": {"model_spec", "runtime.backend", "runtime.engine", "runtime.api", "runtime.client"},
    "runtime.generate": {"model_spec", "runtime.media"} | CLIENT_API,
    "runtime.bench": {"model_spec"} | RUNTIME,
    "serve": {"model_spec", "runtime.media"} | CLIENT_API,
    "serve.cluster": {"model_spec", "serve", "runtime.media"} | CLIENT_API,
    "serve.tools": {"model_spec", "serve", "runtime.media"} | CLIENT_API,
    "cli": set(),  # the command table names modules as strings, imported when a command runs
    "prepare": {"model_spec", "codegen", "runtime.convert"},
    "": set(),  # thorgen/__init__.py
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("runtime", "serve") and len(parts) > 1:
        sub = parts[1]
        if parts[0] == "runtime" or (ROOT / "serve" / sub).is_dir():
            return f"{parts[0]}.{sub}"
    return parts[0]


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Modules of the package (names relative to its root) that a file imports, absolute or relative."""
    module = module_name(path, root)
    here = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name[len("thorgen.") :] for a in node.names if a.name.startswith("thorgen.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                if not (node.module or "").startswith("thorgen"):
                    continue
                base = (node.module or "").split(".")[1:]
            else:
                if node.level - 1 > len(here):
                    continue
                base = here[: len(here) - (node.level - 1)] + ((node.module or "").split(".") if node.module else [])
            names = []
            for alias in node.names:  # `from . import x` imports the module x when it exists
                sub = [*base, alias.name]
                is_module = root.joinpath(*sub).with_suffix(".py").is_file() or root.joinpath(*sub).is_dir()
                names.append(".".join(sub if is_module else base))
        else:
            continue
        found.update(n for n in names if n)
    return found


def package_files(root: Path = ROOT) -> list[Path]:
    """The package's modules: what git tracks (a .venv or any other ignored folder in the checkout holds none)."""
    return [
        p
        for p in repo_files("*.py", root)
        if not (set(p.relative_to(root).parts[:-1]) & SKIP) and p.relative_to(root).parts[0] not in SKIP
    ]


def test_every_room_is_known() -> None:
    unknown = {room_of(module_name(p)) for p in package_files()} - set(ALLOWED)
    assert not unknown, f"rooms without a rule in ALLOWED: {sorted(unknown)}"


def test_rooms_import_only_what_they_may() -> None:
    bad = []
    for path in package_files():
        room = room_of(module_name(path))
        for target in imports_of(path):
            other = room_of(target)
            if other != room and other not in ALLOWED.get(room, set()):
                bad.append(f"{path.relative_to(ROOT)} ({room}) imports {target} ({other})")
    assert not bad, "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of the graph, or None (depth-first search with an on-stack colour)."""
    colour: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if colour[nxt] == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if colour[nxt] == 0 and (found := visit(nxt)):
                return found
        stack.pop()
        colour[node] = 2
        return None

    for node in sorted(graph):
        if colour[node] == 0 and (found := visit(node)):
            return found
    return None


def test_no_import_cycle() -> None:
    modules = {module_name(p): p for p in package_files()}
    graph = {m: {t for t in imports_of(p) if t in modules and t != m} for m, p in modules.items()}
    # a package's __init__ is imported with any of its modules; it imports none of them, so it adds no edge
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checkers_can_fail(tmp_path: Path) -> None:
    """Guard against checkers that cannot fail: planted imports and a planted cycle are seen."""
    (tmp_path / "runtime" / "engine").mkdir(parents=True)
    (tmp_path / "codegen").mkdir()
    (tmp_path / "codegen" / "plan.py").write_text("")
    planted = tmp_path / "runtime" / "engine" / "probe.py"
    planted.write_text(
        "from ...codegen import plan\nimport thorgen.serve.app\nfrom . import core\nfrom ..cuda.engine import Engine\n"
    )
    assert imports_of(planted, root=tmp_path) == {"codegen.plan", "serve.app", "runtime.engine", "runtime.cuda.engine"}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_room_is_flat_again() -> None:
    """runtime/ keeps its few top-level modules; everything else lives in a room."""
    top = sorted(p.stem for p in (ROOT / "runtime").glob("*.py"))
    assert top == ["__init__", "api", "backend", "client", "generate", "manifest", "options"], top


@pytest.mark.parametrize(
    "room", sorted(r for r in ALLOWED if r.startswith(("runtime.", "serve.")) and (ROOT / r.replace(".", "/")).is_dir())
)
def test_each_room_says_its_job(room: str) -> None:
    init = ROOT / room.replace(".", "/") / "__init__.py"
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split(".")[0]) > 20, f"{init.relative_to(ROOT)} opens with no sentence saying its job"


def loaded_by(modules: list[str]) -> list[str]:
    """The package's modules and cuda-python's that importing `modules` loads, in a fresh interpreter."""
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in modules)
        + "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('thorgen', 'cuda'))))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


BACKEND_MODULES = ("thorgen.runtime.cuda", "thorgen.runtime.convert", "cuda")


def test_the_client_api_loads_no_backend() -> None:
    """Importing the client API (what serve, generate and the cluster load) pulls in no cuda module, cuda-python or
    the repack: a backend is imported only when an engine of that kind is opened."""
    loaded = loaded_by(["thorgen.runtime.api", "thorgen.runtime.client"])
    assert "thorgen.runtime.api" in loaded and "thorgen.runtime.client" in loaded
    backend = [m for m in loaded if m == "cuda" or m.startswith(tuple(p + "." for p in BACKEND_MODULES))]
    assert not backend, f"importing the client API loads {backend}"
    # the check sees such a module where one is loaded
    assert "thorgen.runtime.cuda.kv_cache" in loaded_by(["thorgen.runtime.cuda.kv_cache"])
