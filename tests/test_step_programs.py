"""Step programs (codegen/programs.py -> manifest -> runtime/cuda/programs.py): a program bound at any row count of its
range gives exactly the launches that lowering the forward at that row count gives; what a program cannot express
is a build error; a manifest whose programs name a kernel it lacks is refused with that kernel's name; the
programs survive the written manifest (programs.json.gz)."""

from __future__ import annotations

import json
import zlib

import pytest

pytest.importorskip("thorgen.codegen.plan")

from thorgen.codegen.arch import get_arch  # noqa: E402
from thorgen.codegen.lower import Lower  # noqa: E402
from thorgen.codegen.lower_draft import LowerDraft  # noqa: E402
from thorgen.codegen.lower_vision import LowerVision  # noqa: E402
from thorgen.model_spec.vision_layout import VISION_ENCODE  # noqa: E402
from thorgen.codegen.manifest import build_manifest, write_manifest  # noqa: E402
from thorgen.codegen.plan import plan  # noqa: E402
from thorgen.codegen.programs import ProgramError, _fit, _merge  # noqa: E402
from thorgen.codegen.symbols import LaneBytes, Sym  # noqa: E402
from thorgen.model_spec.step_program import (  # noqa: E402
    DRAFT_BATCH,
    DRAFT_BLOCK,
    DRAFT_CONTEXT,
    DRAFT_HEAD,
    program_key,
    verify_key,
)
from thorgen.model_spec.conventions import MAX_STEP_TOKENS  # noqa: E402
from thorgen.model_spec.presets import get_preset  # noqa: E402
from thorgen.runtime.backend import BackendError  # noqa: E402
from thorgen.runtime.cuda.programs import Forward  # noqa: E402
from thorgen.runtime.cuda.kernels import Ptr  # noqa: E402
from thorgen.runtime.manifest import load_manifest  # noqa: E402


def _h(*key) -> int:
    return zlib.crc32(repr(key).encode()) << 24


class Addresses:
    """Pointers giving every buffer its own made-up base, so bound arguments compare as integers."""

    def A(self, name, row=0):
        return Ptr(_h("A", name) + row * 4096)

    def W(self, name, byte_offset=0):
        return Ptr(_h("W", name) + byte_offset)

    def KV(self, layer, which):
        return Ptr(_h("KV", layer, which))

    def DKV(self, layer, which):
        return Ptr(_h("DKV", layer, which))

    def lane_bytes(self, layer):
        return 1000 + layer

    def dlane_bytes(self, layer):
        return 2000 + layer


def _lowered(v):
    """A lowering's argument in the same integers as Addresses."""
    if isinstance(v, Sym):
        base = {
            "A": lambda: _h("A", v.name) + v.row * 4096,
            "W": lambda: _h("W", v.name),
            "KV": lambda: _h("KV", v.name, v.which),
            "DKV": lambda: _h("DKV", v.name, v.which),
            "NULL": lambda: 0,
        }[v.kind]()
        return base + v.off
    if isinstance(v, LaneBytes):
        return (1000 if v.model == "target" else 2000) + v.layer
    return v


def _bound(v):
    return v.address if isinstance(v, Ptr) else v


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    spec, arch = get_preset("tiny"), get_arch("sm_90a")
    kernels = plan(spec, arch)
    out = tmp_path_factory.mktemp("programs")
    write_manifest(out, build_manifest(spec, arch, kernels, {}, "test", []))
    return spec, kernels, load_manifest(out), out


@pytest.mark.parametrize("kv", ["bf16", "fp8e4m3"])
def test_programs_bind_exactly_what_lowering_gives(built, kv):
    spec, kernels, manifest, _ = built
    rows_max = manifest.conventions["max_step_tokens"]
    fwd = Forward(spec, manifest, kv, rows_max)
    fwd.ptr = Addresses()
    low = Lower(spec, get_arch("sm_90a"), kv, rows_max, kernels)
    dl = LowerDraft(low)
    checked = 0
    for key, ranges in fwd.programs.items():
        for rng in ranges:
            lo, hi = rng["lo"], rng["hi"]
            rows_list = range(lo, hi + 1) if hi - lo < 32 else range(lo, hi + 1, 37)
            for rows in rows_list:
                if key == DRAFT_BLOCK:
                    want = dl.block_ops()
                elif key == DRAFT_CONTEXT:
                    want = dl.ctx_ops(rows)
                elif key == DRAFT_BATCH:
                    want = dl.batch_ops(rows)
                elif key == DRAFT_HEAD:
                    want = dl.head_ops(rows)
                elif key.startswith("draft.verify"):
                    want = dl.verify_ops(key == verify_key(True))
                elif key.startswith(VISION_ENCODE):  # "vision.encode" or "vision.encode images=B"
                    want = LowerVision(low).encode_ops(rows, int(key.partition("images=")[2] or 1))
                else:
                    flags = dict(f.split("=") for f in key.split())
                    want = low.ops(rows, **{k: v == "1" for k, v in flags.items()})
                got = fwd.program(key, rows)
                assert [o.label for o in got] == [o.label for o in want], (key, rows)
                for g, w in zip(got, want):
                    assert g.entry.name == w.entry.name and g.rows == w.rows, (key, rows, g.label)
                    assert (g.branch, g.join, g.rowwise, g.pdl) == (w.branch, w.join, w.rowwise, w.pdl), (
                        key,
                        rows,
                        g.label,
                    )
                    assert {n: _bound(v) for n, v in g.args.items()} == {n: _lowered(v) for n, v in w.args.items()}, (
                        key,
                        rows,
                        g.label,
                    )
                checked += 1
    assert checked > 500


def test_what_a_program_cannot_hold_is_a_build_error():
    assert _fit([(2, 5), (3, 7), (9, 19), (16, 33)], "x") == ["rows", 2, 1]
    assert _fit([(2, 4), (16, 4)], "x") == 4
    with pytest.raises(ProgramError, match="not linear"):
        _fit([(2, 2), (3, 3), (9, 16)], "x")  # min(), a ceil, a table: not one launch list for the range
    spec = get_preset("tiny")
    low = Lower(spec, get_arch("sm_90a"), "bf16", MAX_STEP_TOKENS, plan(spec, get_arch("sm_90a")))
    with pytest.raises(ProgramError, match="differ"):  # one row (M = 1 kernels) and two in one range
        _merge([(1, low.ops(1, decode=True)), (2, low.ops(2))], "decode")


def test_a_program_naming_a_kernel_the_manifest_lacks_is_refused(built, tmp_path):
    spec, kernels, _, _ = built
    data = build_manifest(spec, get_arch("sm_90a"), kernels, {}, "test", [])
    gone = next(
        op["kernel"]
        for op in data["programs"]["bf16"][program_key(decode=True)][0]["launches"]
        if op["kernel"].startswith("router_fused")
    )
    del data["kernels"][gone]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    fwd = Forward(spec, load_manifest(tmp_path), "bf16", 512)
    assert any(gone in m for m in fwd.probe())
    with pytest.raises(BackendError, match=gone):
        fwd.ops(1, decode=True)


def test_the_written_manifest_keeps_its_programs(built):
    spec, kernels, manifest, out = built
    assert (out / "programs.json.gz").is_file() and "programs" not in json.loads((out / "manifest.json").read_text())
    again = build_manifest(spec, get_arch("sm_90a"), kernels, {}, "test", [])
    assert manifest.programs == json.loads(json.dumps(again["programs"]))
    assert manifest.programs_missing == {"core": [], "ext": [], "speculative": []} | (
        {"vision": []} if spec.vision is not None else {}
    )


@pytest.mark.parametrize("greedy", [True, False])
def test_a_batched_step_reads_the_lm_head_once(built, greedy):
    """17..32 rows: one lm_head launch (the 32-row kernel, each weight byte read once for every row), then the picks
    on 16-row slices of its logits; a processed head keeps its 16-row slices."""
    spec, _, manifest, _ = built
    fwd = Forward(spec, manifest, "bf16", manifest.conventions["max_step_tokens"])
    fwd.ptr = Addresses()
    ops = fwd.program(program_key(batched=True, greedy=greedy), 27)
    heads = [o for o in ops if o.label == "lm_head"]
    assert len(heads) == 1 and heads[0].entry.name.startswith("nvfp4_gemm32__") and heads[0].args["m"] == 27
    picks = [o for o in ops if o.label in ("argmax", "sample_prep")]
    assert [(o.rows, _bound(o.args["logits"])) for o in picks] == [
        (16, Addresses().A("logits", 0).address),
        (11, Addresses().A("logits", 16).address),
    ]
    ext = fwd.program(program_key(batched=True, greedy=greedy, ext=True), 27)
    assert [o.args["m"] for o in ext if o.label == "lm_head"] == [16, 11]


@pytest.mark.parametrize("preset", ["tiny", "gemma-4-26b-a4b"])
def test_one_row_steps_run_the_attention_prologue_as_one_launch(preset):
    """A one-row forward's layer starts with the q|k|v GEMV that runs rope_kv itself (one launch, its counters a
    buffer of their own); a forward of more rows with the GEMV and rope_kv apart."""
    spec = get_preset(preset)
    low = Lower(spec, get_arch("sm_90a"), "bf16", MAX_STEP_TOKENS, plan(spec, get_arch("sm_90a")))
    layers = spec.target.num_hidden_layers
    for rows, kw in ((1, dict(decode=True)), (1, dict(batched=True)), (16, dict(batched=True)), (40, {})):
        ops = low.ops(rows, **kw)
        labels = [op.label for op in ops]
        folded = [op for op in ops if op.label.endswith(".qkv_rope")]
        if rows == 1:
            assert len(folded) == layers and not any(lb.endswith(".rope_kv") for lb in labels), kw
            assert all(
                op.entry.param("epi") == "rope_kv" and op.args["counters"] == Sym("A", "qkv_cnt") for op in folded
            )
        else:
            assert not folded and sum(lb.endswith(".rope_kv") for lb in labels) == layers, (rows, kw)


def test_the_draft_block_launches_without_pdl_and_the_target_with_it(built):
    """The draft block's launches carry pdl=False through the written program (its graph measured faster without
    programmatic dependent launches on the H200); the target's steps keep the default."""
    spec, _, manifest, _ = built
    fwd = Forward(spec, manifest, "bf16", manifest.conventions["max_step_tokens"])
    fwd.ptr = Addresses()
    block = fwd.program(DRAFT_BLOCK, 16)
    assert block and not any(op.pdl for op in block)
    assert all(op.pdl for op in fwd.program(program_key(decode=True), 1))
    verify = fwd.program(verify_key(), 16)
    assert all(op.pdl for op in verify if op.label != "draft.accept")
