"""Codegen check: every kernel template is safe to launch with programmatic dependent launch (the manifest says
"pdl": the runtime launches each kernel that follows a kernel with programmatic stream serialization).

A PDL-launched kernel may start while its predecessor still runs, so before reading any earlier kernel's output or
writing anything it must execute griddepcontrol.wait (thorgen::pdl_wait). A template is safe when its wrapper calls
pdl_wait itself, or it calls a header function whose body calls pdl_wait (directly or through unit_steps[_rows]<...,
true>,
the weight loop that waits after its weight prologue). A new template without either fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "templates" / "kernels"
HEADERS = ROOT / "templates" / "include" / "thorgen"


def _function_body(text: str, name: str) -> str | None:
    """The brace-matched body of `void name(` in header text, or None."""
    m = re.search(rf"\bvoid\s+{name}\s*\(", text)
    if m is None:
        return None
    i = text.index("{", m.end())
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i : j + 1]
    return None


def _waiting_functions() -> set[str]:
    """Header functions whose body calls pdl_wait() (or the waiting form of unit_steps), directly or through other
    such functions (e.g. a kernel body that hands its K loop to WgmmaLoop::k_loop, which waits after the weight
    prologue). unit_steps_rows' own `if constexpr (kWait) pdl_wait();` does not count: its callers wait only with
    kWait = true. A name defined in several headers counts only when every definition waits."""
    bodies: dict[str, list[str]] = {}
    for h in HEADERS.glob("*.cuh"):
        text = re.sub(r"//[^\n]*", "", h.read_text())  # calls named in comments are not calls
        for name in set(re.findall(r"\bvoid\s+(\w+)\s*\(", text)):
            body = (_function_body(text, name) or "").replace("if constexpr (kWait) pdl_wait();", "")
            bodies.setdefault(name, []).append(body)
    direct = re.compile(r"pdl_wait\(\)|unit_steps(?:_rows)?<[^;]*,\s*true\s*(,[^;]*)?>\(")
    out = {name for name, defs in bodies.items() if all(direct.search(b) for b in defs)}
    while True:
        more = {
            name
            for name, defs in bodies.items()
            if name not in out and all(any(re.search(rf"::{w}\s*[<(]|\b{w}\s*<", b) for w in out) for b in defs)
        }
        if not more:
            return out
        out |= more


def test_pdl_convention_is_on():
    from thorgen.codegen import families

    assert families.PDL is True


def test_every_template_waits_before_reading_earlier_outputs():
    waiting = _waiting_functions()
    assert {"gemm_small", "gemm_large", "moe_gateup", "moe_down", "attn_fwd", "attn_combine"} <= waiting, waiting
    unsafe = []
    for t in sorted(KERNELS.glob("*.cu.j2")):
        text = t.read_text()
        wrappers = re.split(r'extern "C" __global__', text)[1:]
        assert wrappers, f'{t.name}: no extern "C" kernel'
        for w in wrappers:
            body = w[w.index("{") :]
            # thorgen::f<...>(...), Sampler::prep(...), RopeKv<Cfg>::run(...)
            calls = set(re.findall(r"(?:\w|>)::(\w+)\s*[<(]", body))
            if "pdl_wait()" not in body and not calls & waiting:
                unsafe.append(t.name)
    assert not unsafe, f"templates that never wait (griddepcontrol.wait) before their reads: {unsafe}"
