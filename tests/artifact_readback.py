"""Reading a weights artifact back into checkpoint form (the inverse of runtime/convert/layouts.py's packers), for
the tests that compare the repack and the engine against the checkpoint."""

from __future__ import annotations

import numpy as np

from thorgen.runtime.convert import layouts as L
from thorgen.runtime.convert.artifact import DRAFT_PREFIX, ArtifactError


def _find(art, source: str) -> tuple[str, int, int]:
    """(stored matrix base, part index, row offset) holding the checkpoint projection `source` (short prefix)."""
    for name, e in art.tensors.items():
        meta = dict(e.meta)
        if name.endswith(".weight_packed") or (name.startswith(DRAFT_PREFIX) and name.endswith(".weight")):
            row = 0
            for idx, (src, rows) in enumerate(meta.get("parts") or ()):
                if src == source:
                    return name.rsplit(".", 1)[0], idx, row
                row += rows
    raise ArtifactError(f"{art.folder}: no stored matrix holds {source!r}")


def unpack_linear(art, source: str, expert: int | None = None) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """Checkpoint form (packed [N,K/2], scale [N,K/16], global multiplier) of projection `source` (short prefix, e.g.
    layers.0.self_attn.k_proj, layers.0.experts.up_proj with `expert`, or embed_tokens for the NVFP4 lm_head)."""
    base, idx, row = _find(art, source)
    entry = art.entry(base + ".weight_packed")
    meta = dict(entry.meta)
    w, s, g = (art.array(f"{base}.{x}") for x in ("weight_packed", "weight_scale", "weight_multiplier"))
    if expert is not None:
        w, s, g = w[expert], s[expert], g[expert]
    n, k = meta["logical_shape"]
    packed, scale = L.unpack_nvfp4(w, s, n, k, meta["order"])
    rows = meta["parts"][idx][1]
    if meta["fusion"] == "interleave8":
        packed, scale = L.deinterleave8(packed)[idx], L.deinterleave8(scale)[idx]
        row = 0
    return packed[row : row + rows], scale[row : row + rows], np.float32(np.asarray(g).reshape(-1)[idx])


def unpack_half(art, source: str) -> np.ndarray:
    """fp16 bits [N, K] of drafter projection `source` (e.g. draft.layers.0.mlp.up_proj)."""
    base, idx, row = _find(art, source)
    meta = dict(art.entry(base + ".weight").meta)
    n, k = meta["logical_shape"]
    w = L.unpack_half(np.asarray(art.array(base + ".weight")).view(np.uint16), n, k)
    rows = meta["parts"][idx][1]
    if meta["fusion"] == "interleave8":
        return L.deinterleave8(w)[idx]
    return w[row : row + rows]
