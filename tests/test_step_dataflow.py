"""Every step shape's launch list passes the dataflow checks (runtime/cuda/dataflow.py), on the emulated tiny engine
and on the full-size preset's plan (its launch lists over the activation plan, no device memory): no launch reads
an activation before a launch writes it (or the engine stages it), and the side stream never races the main one.
The checks themselves catch a dropped launch, an unstaged input, a missing join and a manifest without access."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")

from thorgen.runtime.cuda.dataflow import DataflowError, PlannedPointers, Regions, check_step  # noqa: E402
from thorgen.runtime.cuda.dflash import DraftForward  # noqa: E402

STEP = {"positions", "lanes", "params", "kv_pages"}  # staged before every step (the page table by the runner)
EXT = {"logit_rows", "logit_counts", "logit_biases", "logit_masks"}  # a processed step's per-row inputs


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    from thorgen.runtime.cuda import device as dev

    b = EE.open_emulated(tiny_checkpoint, tmp_path_factory.mktemp("dataflow"), ctx=512, max_num_seqs=2)
    yield b.engine
    b.close()
    dev.set_driver(None)


def _regions(engine) -> Regions:
    return Regions(engine.act.buffer.ptr, engine.act.plan.regions.values())


def _shapes(f, max_rows: int, speculative: bool):
    """(name, launch list, the step's inputs) for each step shape an engine runs (Forward `f`)."""
    dfw = DraftForward(f)
    yield "decode", f.ops(1, decode=True, last=True), STEP | {"out_ids"}
    yield (
        "decode sampled + processed",
        f.ops(1, decode=True, last=True, greedy=False, ext=True),
        STEP | {"out_ids"} | EXT,
    )
    for rows in (2, 16, 17, max_rows):
        yield f"prefill {rows}", f.ops(rows, decode=False, last=True), STEP | {"ids"}
    yield "prefill chunk (not the last)", f.ops(40, decode=False, last=False), STEP | {"ids"}
    for rows in (1, 4, 16, 32):
        yield f"batched x{rows}", f.ops(rows, decode=False, last=True, greedy=False, batched=True), STEP | {"ids"}
    yield "batched x32 processed", f.ops(32, decode=False, last=True, batched=True, ext=True), STEP | {"ids"} | EXT
    yield "prompt scoring x32", f.ops(32, decode=False, last=True, batched=True, score=True), STEP | {"ids", "out_ids"}
    if f.spec.vision is not None:  # chunks holding images (their key bounds staged with them)
        for rows in (1, 40):
            yield f"prefill {rows} with images", f.ops(rows, last=True, images=True), STEP | {"ids", "kv_hi"}
        yield "prefill chunk with images (not the last)", f.ops(40, last=False, images=True), STEP | {"ids", "kv_hi"}
        if speculative:
            yield (
                "prefill with images and DFlash taps",
                f.ops(40, taps=True, images=True) + dfw.ctx_ops(40),
                STEP | {"ids", "kv_hi"},
            )
    if speculative:
        yield (
            "prefill with DFlash taps",
            f.ops(40, decode=False, last=True, taps=True) + dfw.ctx_ops(40),
            STEP | {"ids"},
        )
        yield "draft", dfw.block_ops(), STEP | {"ids"}
        for blocks in (2, 16):  # a batched verify's batched draft step (runtime/cuda/draft_batch.py)
            yield f"batched draft x{blocks}", dfw.batch_ops(blocks), STEP | {"ids"}
        yield "batched draft head x31", dfw.head_ops(31), STEP | {"dhead"}  # (its rows copied from da)
        for greedy in (True, False):  # (the acceptance rule: staged with a fresh block)
            yield f"verify greedy={greedy}", dfw.verify_ops(greedy), STEP | {"ids", "spec_rule"}
        for rows, ext in ((2, False), (32, True)):  # a batched verify (runtime/cuda/spec_batch.py)
            yield (
                f"batched verify x{rows}{' processed' if ext else ''}",
                f.ops(rows, last=True, greedy=False, batched=True, taps=True, ext=ext) + dfw.ctx_ops(rows),
                STEP | {"ids"} | (EXT if ext else set()),
            )


def test_every_step_shape_passes(engine):
    regions = _regions(engine)
    names = []
    for name, ops, inputs in _shapes(engine.fwd, engine.max_rows, engine.speculative):
        check_step(ops, regions, inputs, name)
        names.append(name)
    assert "verify greedy=True" in names and "draft" in names  # the tiny checkpoint has a drafter


def _planned_step_shapes(spec, tmp_path, what: str) -> list[str]:
    """Every step shape of `spec`'s plan checked over its activation plan, laid out but not allocated; the names."""
    from thorgen.runtime.cuda.buffers import plan_activations
    from thorgen.runtime.cuda.programs import Forward
    from thorgen.runtime.manifest import load_manifest

    manifest = load_manifest(EE.write_fake_manifest(spec, tmp_path) / "manifest.json")
    rows = 512
    # the engine's own activation plan, on what it reads of an engine (no device, no weights)
    plan = plan_activations(spec, manifest, rows, 65536, True, spec.drafter is not None)
    fwd = Forward(spec, manifest, "bf16", rows)
    fwd.ptr = ptr = PlannedPointers(plan)
    assert ptr.regions.name(ptr.A("moe", 7).address) == "moe" and ptr.regions.name(ptr.W("x").address) is None
    names = []
    for name, ops, inputs in _shapes(fwd, rows, spec.drafter is not None):
        check_step(ops, ptr.regions, inputs, f"{what}, {name}")
        names.append(name)
    return names


def test_full_size_step_shapes_pass(tmp_path):
    """The full-size model's plan (other kernel forms: grouped prefill MoE, 16-row MoE, split-K attention...) over
    its activation plan, laid out but not allocated."""
    from thorgen.model_spec.presets import get_preset

    names = _planned_step_shapes(get_preset("gemma-4-26b-a4b"), tmp_path, "full size")
    # every shape of _shapes, the DFlash and image ones included
    assert len(names) == 22 + 4 and "verify greedy=True" in names and "prefill 40 with images" in names
    assert "batched verify x32 processed" in names


@pytest.mark.parametrize("formats", ["ALL_BF16", "EXPERTS_ONLY_NVFP4"])
@pytest.mark.parametrize("preset", ["tiny", "gemma-4-26b-a4b"])
def test_step_shapes_pass_in_every_linear_format(preset, formats, tmp_path):
    """bf16 target linears run the fp16-weight kernels (one weight argument where NVFP4 has three, the same fused
    epilogues): every step shape of both presets, the image ones included, still passes, with every linear bf16 and
    with NVFP4 experts only."""
    from thorgen.model_spec import types
    from thorgen.model_spec.presets import get_preset

    spec = dataclasses.replace(get_preset(preset), linear_formats=getattr(types, formats))
    names = _planned_step_shapes(spec, tmp_path, f"{preset} {formats}")
    assert len(names) == 22 + 4 and "prefill 40 with images" in names


def test_the_checks_catch_what_they_are_for(engine):
    regions = _regions(engine)
    ops = engine.fwd.ops(4, decode=False, last=True)
    labels = [op.label for op in ops]
    with pytest.raises(DataflowError, match=r"reads 'x' before any launch writes it"):
        check_step([op for op in ops if op.label != "embed"], regions, STEP | {"ids"})
    with pytest.raises(DataflowError, match=r"reads 'ids' before"):
        check_step(ops, regions, STEP)  # the token ids were never staged
    joined = next(i for i, op in enumerate(ops) if getattr(op, "join", False))
    unjoined = ops[:joined] + [dataclasses.replace(ops[joined], join=False)] + ops[joined + 1 :]
    with pytest.raises(DataflowError, match=r"side stream may still be writing it|never joined"):
        check_step(unjoined, regions, STEP | {"ids"})
    side = next(i for i, op in enumerate(ops) if getattr(op, "branch", 0) == 1)
    early = ops[:side] + [ops[joined]] + ops[side:]  # the join's consumer before the side stream ran
    with pytest.raises(DataflowError):
        check_step(early, regions, STEP | {"ids"})
    bare = [dataclasses.replace(ops[0], entry=dataclasses.replace(ops[0].entry, access={}))] + ops[1:]
    with pytest.raises(DataflowError, match=r"no argument access in the manifest"):
        check_step(bare, regions, STEP | {"ids"})
    assert "embed" in labels
