"""The constants and records the stages share are written once (model_spec/conventions.py and the runtime's logits
records), and the C side agrees: each device record's fields, in order and type, as its struct declares them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from thorgen.model_spec import conventions as C
from thorgen.model_spec.weight_layout import fp4_order_for
from thorgen.runtime.cuda import logits_params as LP

INCLUDE = Path(__file__).resolve().parents[1] / "templates" / "include" / "thorgen"
C_TYPES = {"double": "<f8", "float": "<f4", "unsigned long long": "<u8", "int": "<i4"}


def struct_fields(text: str, name: str) -> list[tuple[str, str]]:
    """(field, numpy type) of `struct name { ... };` in a header's text, in declaration order."""
    m = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S)
    assert m, f"struct {name} not found"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        ctype = next(t for t in sorted(C_TYPES, key=len, reverse=True) if decl.startswith(t + " "))
        fields += [(n.strip(), C_TYPES[ctype]) for n in decl[len(ctype) :].split(",")]
    return fields


@pytest.mark.parametrize(
    "header,struct,dtype",
    [
        ("sample.cuh", "SampleParams", C.SAMPLE_PARAMS),
        ("logits.cuh", "LogitRow", LP.LOGIT_ROW),
        ("logits.cuh", "TokenCount", LP.TOKEN_COUNT),
        ("logits.cuh", "TokenBias", LP.TOKEN_BIAS),
    ],
)
def test_device_records_match_their_c_structs(header, struct, dtype):
    assert struct_fields((INCLUDE / header).read_text(), struct) == _fields(dtype)
    offsets = [dtype.fields[n][1] for n in dtype.names]
    assert offsets == sorted(offsets) and dtype.itemsize % 8 == 0  # packed in order, as the C compiler lays it out


def _fields(dtype: np.dtype) -> list[tuple[str, str]]:
    return [(n, np.dtype(dtype.fields[n][0]).str) for n in dtype.names]


def test_the_struct_parser_sees_a_change():
    """Guard against a check that cannot fail: SampleParams with one field's type changed no longer matches."""
    text = (INCLUDE / "sample.cuh").read_text()
    assert "  double top_p;" in text
    assert struct_fields(text.replace("  double top_p;", "  float top_p;"), "SampleParams") != _fields(C.SAMPLE_PARAMS)


def test_shared_constants_are_the_stages_own():
    from thorgen.codegen.arch import ARCHS
    from thorgen.codegen.families import ring_slots as codegen_ring_slots
    from thorgen.codegen.families.matmul import fp4_order
    from thorgen.runtime.cuda.engine import SAMPLE_PARAMS
    from thorgen.runtime.cuda.kv_cache import ring_slots as runtime_ring_slots
    from thorgen.runtime.convert.plan import fp4_order as repack_fp4_order

    assert SAMPLE_PARAMS is C.SAMPLE_PARAMS
    for arch in ARCHS.values():  # the order codegen builds the kernels for is the order the repack writes
        assert fp4_order(arch) == repack_fp4_order(arch.name) == fp4_order_for(arch.name)
    assert (
        codegen_ring_slots(1024) == runtime_ring_slots(1024) == runtime_ring_slots(1024, {}) == 1024 + C.MAX_STEP_TOKENS
    )
    assert runtime_ring_slots(1024, {"ring_slots": {"1024": 2000}}) == 2000  # a manifest's own table wins


def test_accepted_count():
    """DFlash acceptance (the host's rule; spec_accept.cuh is its device form): the longest agreeing run plus the
    target after it, capped by `most` (clamped to the block), or exactly K + 1 when emulated."""
    from thorgen.model_spec.conventions import accepted_count

    t = list(range(100, 116))
    assert accepted_count(t[:15], t, 16) == 16
    assert accepted_count([0] + t[1:15], t, 16) == 1
    assert accepted_count(t[:4] + [0] + t[5:15], t, 16) == 5
    assert accepted_count(t[:15], t, 6) == 6 and accepted_count(t[:15], t, 99) == 16
    assert accepted_count(t[:15], t, 0) == 1
    assert accepted_count([0] * 15, t, 16, emulate=6) == 7 and accepted_count(t[:15], t, 4, emulate=15) == 4
