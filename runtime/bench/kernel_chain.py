"""The kernel chain benchmark (`thorgen bench kernels --chain N`): a build's one-row decode GEMVs launched as a
dependent chain in one CUDA graph, every launch after the first with programmatic dependent launch (PDL) as the
engine's step graphs launch them, in the planned form and in each bench-only prologue form that
`thorgen build --prologue-variants` added (codegen/prologue_variants.py: weights loaded, or copied into shared
memory, before griddepcontrol.wait). Each form launches on its own manifest grid (the smem form groups units into
fewer blocks) with the planned kernel's arguments.

A kernel's chain is N launches of it, each on one of several copies of its inputs (enough copies, up to N, that no
launch finds its weights in L2); the step-order chain is the one-row decode step's launches of these kernels (its
program's order, the other kernels left out) over N layers, the step's layers over again past its last. Each
reports us a launch (the graph's replay time over its launches), bytes, GB/s and the fraction of the copy bandwidth
probe, so the exposed cost of a kernel boundary shows as the gap between a form's time and its bytes at copy
bandwidth.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..cuda.device import Stream
from ..cuda.graphs import CudaGraph
from ..cuda.memory import DeviceBuffer
from ...model_spec.step_program import program_key
from ..manifest import KernelEntry, KernelManifest
from .cases import BenchCase, host_args

PLANNED = "planned"


class ChainRig(Protocol):
    """What the chain needs of kernels.py's KernelRig (which imports this module)."""

    stream: Stream

    def add(self, entries: Iterable[KernelEntry]) -> None: ...

    def upload(self, arr: np.ndarray) -> DeviceBuffer: ...

    def launch(
        self, name: str, args: Sequence[Any], grid: tuple[int, int, int] | None = None, pdl: bool = False
    ) -> None: ...

    def time_ms(self, launch: Callable[[], None], iters: int = 20) -> float: ...


# input copies a timing cycles through (a kernel's chain here, kernels.py's stream timing), several times the L2
# (50-60 MB)
ROTATE_BYTES = 512 << 20


@dataclass(frozen=True)
class ChainKernel:
    """One planned GEMV of the chain: its bench case, its forms' kernel names, its uploaded argument copies."""

    case: BenchCase
    forms: dict[str, str]  # form ("planned", "early", "nc", "slice", "smem") -> kernel name
    copies: list[list[Any]]


def prologue_forms(manifest: KernelManifest) -> dict[str, dict[str, str]]:
    """{planned kernel: {form: kernel}} of the build's bench-only prologue forms (entry params "variant_of",
    "prologue"); empty for a build without them."""
    out: dict[str, dict[str, str]] = {}
    for name, entry in manifest.kernels.items():
        base, form = entry.params.get("variant_of"), entry.params.get("prologue")
        if base is not None and form is not None and base in manifest.kernels:
            out.setdefault(base, {PLANNED: base})[form] = name
    return out


def _upload(rig: ChainRig, case: BenchCase, launches: int, rng: np.random.Generator) -> list[list[Any]]:
    host = host_args(case, rng)
    footprint = sum(h.nbytes for h in host if isinstance(h, np.ndarray))
    count = max(1, min(launches, -(-ROTATE_BYTES // max(footprint, 1))))
    return [[rig.upload(h) if isinstance(h, np.ndarray) else h for h in host] for _ in range(count)]


def _time_chain(rig: ChainRig, launches: list[tuple[str, list[Any], Any]], iters: int) -> float:
    """Microseconds a launch of `launches` (kernel, args, grid) captured in order in one graph, each after the
    first with PDL."""

    def body() -> None:
        for i, (name, args, grid) in enumerate(launches):
            rig.launch(name, args, grid, pdl=i > 0)

    graph = CudaGraph.capture(rig.stream, body, "kernel chain")
    try:
        return rig.time_ms(lambda: graph.replay(rig.stream), iters) * 1e3 / len(launches)
    finally:
        graph.destroy()


def _row(name: str, us: float, nbytes: int, copy_gbps: float) -> dict:
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"kernel": name, "us": us, "gbps": gbps, "fraction_of_copy": gbps / copy_gbps}


def step_layers(manifest: KernelManifest, kernels: Iterable[str]) -> list[list[str]]:
    """The one-row decode step's launches of `kernels`, a list a target layer in step order (its program for the
    manifest's first KV dtype; launch labels "layers.<i>.<what>")."""
    wanted, layers = set(kernels), {}
    programs = manifest.programs[next(iter(manifest.programs))][program_key(decode=True)]
    for launch in programs[0]["launches"]:
        label = str(launch["label"])
        if launch["kernel"] in wanted and label.startswith("layers."):
            layers.setdefault(int(label.split(".")[1]), []).append(launch["kernel"])
    return [layers[i] for i in sorted(layers)]


def run_chain(
    rig: ChainRig, manifest: KernelManifest, cases: list[BenchCase], n: int, copy_gbps: float, iters: int
) -> dict:
    """The chain report of every case whose kernel has prologue forms in `manifest` (the rest are skipped): each
    kernel in a graph of `n` launches, and the decode step's launches of them over `n` layers (the step's layers
    over again past its last) in one graph."""
    forms = prologue_forms(manifest)
    if not forms:
        raise ValueError(
            f"{manifest.path.parent} has no prologue forms of its decode GEMVs: build it with "
            "`thorgen build --prologue-variants`"
        )
    chosen = [c for c in cases if c.kernel in forms]
    rig.add(manifest.kernel(k) for c in chosen for k in forms[c.kernel].values())
    rng = np.random.default_rng(0)
    chain = {c.kernel: ChainKernel(c, forms[c.kernel], _upload(rig, c, n, rng)) for c in chosen}
    names = list(dict.fromkeys(f for k in chain.values() for f in k.forms))
    rows = []
    for k in chain.values():
        timed = {
            form: _time_chain(rig, [(kern, k.copies[i % len(k.copies)], k.case.grid) for i in range(n)], iters)
            for form, kern in k.forms.items()
        }
        rows.append(
            {
                "kernel": k.case.kernel,
                "note": k.case.note,
                "bytes": k.case.bytes_moved,
                "input_copies": len(k.copies),
                "us_at_copy": k.case.bytes_moved / (copy_gbps * 1e9) * 1e6,
                "forms": {f: _row(kern, timed[f], k.case.bytes_moved, copy_gbps) for f, kern in k.forms.items()},
            }
        )
    layers = step_layers(manifest, chain)
    order = [chain[name] for i in range(n) for name in layers[i % len(layers)]] if layers else []
    nbytes = sum(k.case.bytes_moved for k in order)
    step: dict[str, Any] = {"layers": n, "launches": len(order), "bytes": nbytes, "forms": {}}
    for form in names if order else ():
        turn: dict[str, int] = {}
        launches = []
        for k in order:  # each launch of a kernel on its next input copy, as each layer has its own weights
            i = turn[k.case.kernel] = turn.get(k.case.kernel, -1) + 1
            launches.append((k.forms.get(form, k.forms[PLANNED]), k.copies[i % len(k.copies)], k.case.grid))
        us = _time_chain(rig, launches, iters)
        step["forms"][form] = dict(_row(form, us, nbytes // len(order), copy_gbps), ms=us * len(order) / 1e3)
    return {"launches": n, "forms": names, "kernels": rows, "step": step}


def format_chain(report: dict) -> str:
    """The chain report as text: a line a kernel, its forms' us a launch and fraction of copy, then the step-order
    chain."""
    chain = report["chain"]
    forms = chain["forms"]
    lines = [
        f"{report['device']} ({report['arch']}), {report['model']} kernels of {report['kernel_dir']}: copy bandwidth "
        f"{report['copy_gbps']:.0f} GB/s (read+write); chains of {chain['launches']} dependent PDL launches in one "
        "graph, us a launch (of copy)",
        f"{'kernel':<60} {'MB':>7} {'at copy':>8} " + " ".join(f"{f:>17}" for f in forms),
    ]
    for r in chain["kernels"]:
        cells = [
            f"{r['forms'][f]['us']:>8.2f} ({r['forms'][f]['fraction_of_copy']:>5.1%})" if f in r["forms"] else " " * 17
            for f in forms
        ]
        lines.append(f"{r['kernel'][:60]:<60} {r['bytes'] / 1e6:>7.2f} {r['us_at_copy']:>8.2f} " + " ".join(cells))
    step = chain["step"]
    lines.append(
        f"decode step order, {step['layers']} layers ({step['launches']} launches, {step['bytes'] / 1e6:.1f} MB): "
        + ", ".join(
            f"{f} {m['ms']:.3f} ms ({m['us']:.2f} us a launch, {m['fraction_of_copy']:.1%} of copy)"
            for f, m in step["forms"].items()
        )
    )
    return "\n".join(lines)
