"""Codegen stage: step programs, the launch lists of every kind of forward the engine runs, written into the manifest.

Each kind (its flags: model_spec.step_program.program_key) is lowered (codegen/lower.py) for row ranges whose launch
structure does not change: one row, 2..16, 17, and more. Within a range the lowering is evaluated at 4 row counts
(both ends, the second, the middle); the launches must be the same, and a launch argument that differs must be linear
in the row count (a grid-stride count, a last-row pointer, a second slice's rows): it is written as
["rows", a, b] = a * rows + b. Anything else is an error at build time. Arguments are symbols the runtime binds to
its buffers (runtime/cuda/programs.py):
  ["A", activation, row, byte offset]  ["W", weight, byte offset]  ["KV" | "DKV", layer, "k" | "v", byte offset]
  ["NULL"]  ["lane_bytes" | "dlane_bytes", layer] (a target | drafter layer's lane stride)  and integers (row and
  offset entries may themselves be ["rows", a, b]).
A launch: {"label", "kernel" (a manifest kernel name), "args", "rows", "branch", "join", "rowwise", "pdl"}; launch grids
follow the kernels' planned rules (their params) at bind time. Kinds that lack a kernel are left out, their reasons
listed under "missing" by what they serve: "core" (plain decoding), "ext" (logits processing, logprobs, prompt
scoring), "speculative" (DFlash) and, with a vision tower, "vision" (the image encoder: codegen/lower_vision.py)."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from ..model_spec.conventions import MAX_BATCH, VERIFY_ROWS
from ..model_spec.step_program import (
    DRAFT_BATCH,
    DRAFT_BLOCK,
    DRAFT_CONTEXT,
    DRAFT_HEAD,
    Op,
    draft_batch_blocks,
    drafter_problem,
    program_key,
    verify_key,
)
from ..model_spec.types import ModelSpec
from ..model_spec.vision_layout import MAX_ENCODE_IMAGES, MAX_SOFT_TOKENS, VISION_ENCODE, vision_encode_key
from .arch import ArchSpec
from .kernel_spec import KernelSpec
from .lower import Lower, Missing
from .lower_draft import LowerDraft
from .lower_vision import LowerVision
from .symbols import LaneBytes, Sym


class ProgramError(ValueError):
    """A lowering whose structure or arguments change inside a row range in a way a program cannot express."""


def _ranges(lo: int, hi: int, key: str = "") -> list[tuple[int, int]]:
    """[lo, hi] cut where the launch structure changes: 1 row (the M = 1 kernels), up to 16 (the M = 16 ones, one
    slice), 17 (a batched step's second slice of one row: the M = 1 lm_head), above (prefill kernels, or a second
    16-row slice). The vision tower's program (rows: soft tokens) runs the same kernels at every row count."""
    if key.startswith(VISION_ENCODE):
        return [(lo, hi)]
    out = []
    for a, b in ((1, 1), (2, VERIFY_ROWS), (VERIFY_ROWS + 1, VERIFY_ROWS + 1), (VERIFY_ROWS + 2, hi)):
        a, b = max(a, lo), min(b, hi)
        if a <= b:
            out.append((a, b))
    return out


def _kinds(max_rows: int, drafter: bool, images: bool = False) -> Iterator[tuple[str, str, dict, int, int]]:
    """(group, key, Lower.ops flags, lowest rows, highest rows) of every forward the engine asks for; `images`
    (a model with a vision tower): also the prefill chunks that hold image spans (group "vision")."""
    for greedy in (True, False):
        for ext in (False, True):
            flags = dict(decode=True, last=True, greedy=greedy, ext=ext)
            yield ("ext" if ext else "core"), program_key(**flags), flags, 1, 1
            flags = dict(last=True, greedy=greedy, batched=True, ext=ext)
            yield ("ext" if ext else "core"), program_key(**flags), flags, 1, MAX_BATCH
    yield (
        "ext",
        program_key(last=True, batched=True, score=True),
        dict(last=True, batched=True, score=True),
        1,
        MAX_BATCH,
    )
    for taps in (False, True) if drafter else (False,):
        group = "speculative" if taps else "core"
        yield group, program_key(last=False, taps=taps), dict(last=False, taps=taps), 1, max_rows
        for greedy in (True, False):
            for ext in (False, True):
                flags = dict(last=True, greedy=greedy, taps=taps, ext=ext)
                yield ("ext" if ext and not taps else group), program_key(**flags), flags, 1, max_rows
    if drafter:
        for greedy in (True, False):
            for ext in (False, True):
                # the one-row step of a lone speculative sequence's plain steps, keeping its taps (the drafter's
                # catch-up before a probe projects them: runtime/cuda/tap_ring.py)
                flags = dict(decode=True, last=True, greedy=greedy, ext=ext, taps=True)
                yield "speculative", program_key(**flags), flags, 1, 1
                # a batched verify step: several sequences' blocks as rows of one batched step, with the taps
                flags = dict(last=True, greedy=greedy, batched=True, taps=True, ext=ext)
                yield "speculative", program_key(**flags), flags, 2, MAX_BATCH
    if images:  # the same prefill chunks holding image spans (after every text kind: those keep their order)
        for taps in (False, True) if drafter else (False,):
            flags = dict(last=False, taps=taps, images=True)
            yield "vision", program_key(**flags), flags, 1, max_rows
            for greedy in (True, False):
                for ext in (False, True):
                    flags = dict(last=True, greedy=greedy, taps=taps, ext=ext, images=True)
                    yield "vision", program_key(**flags), flags, 1, max_rows


def _fit(points: list[tuple[int, int]], what: str) -> Any:
    """Integers v(rows) at the sample points -> v, or ["rows", a, b] when they are a * rows + b."""
    (r0, v0), (r1, v1) = points[0], points[-1]
    if all(v == v0 for _, v in points):
        return v0
    a, rem = divmod(v1 - v0, r1 - r0)
    b = v0 - a * r0
    if rem or any(v != a * r + b for r, v in points):
        raise ProgramError(f"{what}: {points} is not linear in the row count")
    return ["rows", a, b]


def _encode(points: list[tuple[int, Any]], what: str) -> Any:
    """One launch argument at the sample points -> its JSON form (module docstring)."""
    vals = [v for _, v in points]
    first = vals[0]
    if isinstance(first, Sym):
        if any(
            not isinstance(v, Sym) or (v.kind, v.name, v.which) != (first.kind, first.name, first.which) for v in vals
        ):
            raise ProgramError(f"{what}: another buffer at another row count ({vals})")
        row = _fit([(r, v.row) for r, v in points], what)
        off = _fit([(r, v.off) for r, v in points], what)
        if first.kind == "A":
            return ["A", first.name, row, off]
        if first.kind == "W":
            return ["W", first.name, off]
        if first.kind in ("KV", "DKV"):
            return [first.kind, first.name, first.which, off]
        return ["NULL"]
    if isinstance(first, LaneBytes):
        if any(not isinstance(v, LaneBytes) or v != first for v in vals):
            raise ProgramError(f"{what}: another lane stride at another row count ({vals})")
        return ["lane_bytes" if first.model == "target" else "dlane_bytes", first.layer]
    if isinstance(first, bool) or not isinstance(first, int) or not all(type(v) is type(first) for v in vals):
        raise ProgramError(f"{what}: an argument no program can hold ({vals})")
    return _fit(list(points), what)


def _merge(samples: list[tuple[int, list[Op]]], what: str) -> list[dict]:
    """The launch lists of one range at its sample row counts -> one program."""
    base = samples[0][1]
    for rows, ops in samples[1:]:
        if [(o.label, o.entry.name, o.branch, o.join, o.rowwise, o.pdl, sorted(o.args)) for o in ops] != [
            (o.label, o.entry.name, o.branch, o.join, o.rowwise, o.pdl, sorted(o.args)) for o in base
        ]:
            raise ProgramError(f"{what}: the launches at {rows} rows differ from those at {samples[0][0]}")
    out = []
    for i, op in enumerate(base):
        at = [(rows, ops[i]) for rows, ops in samples]
        out.append(
            {
                "label": op.label,
                "kernel": op.entry.name,
                "branch": op.branch,
                "join": op.join,
                "rowwise": op.rowwise,
                "pdl": op.pdl,
                "rows": _fit([(r, o.rows) for r, o in at], f"{what} {op.label} rows"),
                "args": {n: _encode([(r, o.args[n]) for r, o in at], f"{what} {op.label} {n}") for n in op.args},
            }
        )
    return out


def _program(build: Callable[[int], list[Op]], lo: int, hi: int, what: str, key: str = "") -> list[dict]:
    """[{"lo", "hi", "launches"}] for each structural range of [lo, hi]."""
    out = []
    for a, b in _ranges(lo, hi, key):
        # the ends, the second row count and the middle: the structure changes only at the cuts above (row
        # counts against 1 and the 16-row slices), and 4 points pin a linear argument and catch most slips
        points = sorted({a, min(a + 1, b), (a + b) // 2, b})
        out.append({"lo": a, "hi": b, "launches": _merge([(r, build(r)) for r in points], f"{what} rows {a}-{b}")})
    return out


def _jobs(low: Lower, drafter: bool) -> list[tuple[str, str, Callable[[int], list[Op]], int, int]]:
    """(group, key, lowering at a row count, lowest rows, highest rows) of every program."""
    jobs = [
        (g, key, (lambda f: lambda r: low.ops(r, **f))(flags), lo, hi)
        for g, key, flags, lo, hi in _kinds(low.max_rows, drafter, low.spec.vision is not None)
    ]
    if drafter:
        dl = LowerDraft(low)
        jobs += [
            ("speculative", DRAFT_BLOCK, lambda r: dl.block_ops(), VERIFY_ROWS, VERIFY_ROWS),
            ("speculative", DRAFT_CONTEXT, dl.ctx_ops, 1, low.max_rows),
            *(
                ("speculative", verify_key(g), (lambda g: lambda r: dl.verify_ops(g))(g), VERIFY_ROWS, VERIFY_ROWS)
                for g in (True, False)
            ),
            ("speculative", DRAFT_HEAD, dl.head_ops, 1, MAX_BATCH),
        ]
        blocks = draft_batch_blocks(low.max_rows)
        if blocks >= 2:  # (a batched draft step of one sequence's block runs two: the second a copy of the first)
            jobs.append(("speculative", DRAFT_BATCH, dl.batch_ops, 2 * VERIFY_ROWS, blocks * VERIFY_ROWS))
    if low.spec.vision is not None:
        lv = LowerVision(low)
        for b in range(1, MAX_ENCODE_IMAGES + 1):  # b images of one patch grid at once, each of up to 1120 / b tokens
            build = (lambda b: lambda r: lv.encode_ops(r, b))(b)
            jobs.append(("vision", vision_encode_key(b), build, 1, MAX_SOFT_TOKENS // b))
    return jobs


def launched_kernels(
    spec: ModelSpec, arch: ArchSpec, kv_dtypes: list[str] | tuple[str, ...], max_rows: int
) -> list[KernelSpec]:
    """Every kernel the programs launch, in order of first use (the launches of a range are those at its first row
    count: emit_programs checks that they are the same at the others)."""
    launched: dict[str, KernelSpec] = {}
    for kv in kv_dtypes:
        low = Lower(spec, arch, kv, max_rows)
        for _, key, build, lo, hi in _jobs(low, drafter_problem(spec) is None):
            for a, _ in _ranges(lo, hi, key):
                build(a)
        for name, kernel in low.launched.items():
            if launched.setdefault(name, kernel) != kernel:
                raise ProgramError(f"two different kernels share the name {name} (KV {kv})")
    return list(launched.values())


def emit_programs(
    spec: ModelSpec, arch: ArchSpec, kernels: list[KernelSpec], kv_dtypes: list[str], max_rows: int
) -> dict:
    """{"programs": {kv dtype: {key: [ranges]}}, "missing": {group: [what is missing]}}: the programs lowered
    against `kernels` (the plan: codegen/plan.py), a kind that launches a kernel absent from them left out."""
    programs: dict[str, dict] = {}
    missing: dict[str, list[str]] = {"core": [], "ext": [], "speculative": []}
    if spec.vision is not None:
        missing["vision"] = []
    problem = drafter_problem(spec)  # no drafter, or one these programs cannot serve: plain decoding only
    if problem and spec.drafter is not None:
        missing["speculative"].append(problem)
    for kv in kv_dtypes:
        low = Lower(spec, arch, kv, max_rows, kernels)
        table = programs[kv] = {}
        for group, key, build, lo, hi in _jobs(low, problem is None):
            try:
                table[key] = _program(build, lo, hi, f"{kv} {key}", key)
            except Missing:  # left out; name every kernel it lacks (lowered again, recording each absent one)
                low.missing, low.probing = [], True
                try:
                    for a, _ in _ranges(lo, hi, key):
                        build(a)
                finally:
                    low.probing = False
                missing[group] += [m for m in low.missing if m not in missing[group]]
    return {"programs": programs, "missing": missing}


__all__ = ["ProgramError", "emit_programs", "launched_kernels"]
