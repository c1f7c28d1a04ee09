"""Probe: the 16-row MoE kernels (moe_gateup, moe_down_pairs) and variants of them, timed alone
on three routings of 16 tokens, each output checked bit for bit against the first kernel of its kind (HEAD's).
Routings (4 of each, rotated so that consecutive launches read other experts): "pool32" (32 experts, each chosen by
4 tokens: the verify graph once routed 32 on 16 distinct tokens), "hot" (11 experts, most chosen by more than
8 tokens: two passes), "random" (8 distinct experts a token drawn uniformly: ~80 experts).
Not part of the engine: a measurement for docs/benchmarks/NOTES.md. The variants' template options (ring, walk,
ahead) exist at commit fe07606 only (VARIANTS=fe07606, the default), the blocks of several one-warp items (wpb) at
2740d14 (VARIANTS=2740d14); each was reverted in the next commit. GRID_Y=exact launches the block-row kernels with
rows only for the experts the routings name (what the empty rows cost).
  prep TAG OUTDIR   (CPU, nvcc) compile this tree's 16-row pair ("old" at the baseline commit) or, with TAG new, the
                    pair and its variants into OUTDIR (cubins + index.json)
  run DIR... OUT    (GPU) time every indexed kernel: a CUDA graph of 64 launches over the rotated routings"""

import dataclasses
import json
import os
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np


def variants(tag):
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.families.moe import moe_kernels
    from thorgen.codegen.kernel_spec import make_params
    from thorgen.model_spec.presets import get_preset

    spec, arch = get_preset("gemma-4-26b-a4b"), get_arch("sm_90a")
    gu, dn = moe_kernels(spec, arch, 16)
    out = [(tag, gu), (tag, dn)]
    if tag == "new":

        def var(k, label, grid=None, block=None, **kw):
            p = dict(k.params)
            p.update(kw)
            p = {a: b for a, b in p.items() if b is not None}
            return (
                label,
                dataclasses.replace(
                    k,
                    name=k.name + "_" + label.replace("-", "_"),
                    params=make_params(**p),
                    grid=grid or k.grid,
                    block=block or k.block,
                ),
            )

        if os.environ.get("VARIANTS", "fe07606") == "fe07606":  # that commit's options
            A = dict(ahead=True)
            out += [
                var(gu, "gu-ahead", **A),
                var(gu, "gu-ahead-bps8", bps=8, **A),
                var(gu, "gu-ahead-bps6", bps=6, **A),
                var(gu, "gu-ahead-un1", un=1, grid=(88, 128, 1), **A),
                var(gu, "gu-r3-un2", ring=3),
                var(gu, "gu-r4-un2-bps6", ring=4, bps=6),
                var(gu, "gu-r4-un1-bps8", ring=4, un=1, bps=8, grid=(88, 128, 1)),
                var(gu, "gu-r6-un1", ring=6, un=1, grid=(88, 128, 1)),
                var(dn, "dn-ahead", **A),
                var(dn, "dn-ahead-pf4", pf=4, **A),
                var(dn, "dn-ahead-un1", un=1, grid=(176, 128, 1), **A),
                var(dn, "dn-r4", ring=4),
                var(dn, "dn-r6-un1", ring=6, un=1, grid=(176, 128, 1)),
                var(dn, "dn-r8-un1-bps24", ring=8, un=1, bps=24, grid=(176, 128, 1)),
                var(
                    dn,
                    "dn-ahead-walk-w4",
                    wpb=4,
                    bps=6,
                    grid=(792, 1, 1),
                    block=(128, 1, 1),
                    walk=True,
                    ROW_GRID=None,
                    **A,
                ),
            ]
        else:  # "2740d14": that commit's groups of one-warp items a block (wpb)
            out += [
                var(dn, "dn-w2", wpb=2, grid=(44, 128, 1), block=(64, 1, 1)),
                var(dn, "dn-w8", wpb=8, grid=(11, 128, 1), block=(256, 1, 1)),
            ]
    return out


def prep(tag, outdir):
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.builder import compile_sources
    from thorgen.codegen.render import render

    arch = get_arch("sm_90a")
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    vs = variants(tag)
    comp = compile_sources({k.name: render(k, arch, "sweep") for _, k in vs}, arch, Path("/tmp/sweep-work-" + tag))
    idx = []
    for label, k in vs:
        (out / (k.name + ".cubin")).write_bytes(comp[k.name][0])
        idx.append(dict(label=label, kernel=pickle.dumps(k).hex(), regs=str(comp[k.name][1])[-200:]))
    (out / "index.json").write_text(json.dumps(idx))


def routing(rng, kind, m=16, e=128, k=8, shift=0):
    ids = np.zeros((m, k), np.int32)
    for t in range(m):
        if kind == "pool32":  # 32 experts, each chosen by 4 of the 16 tokens (the synthetic verify routes ~32)
            ids[t] = (shift + np.arange(k) + 8 * (t % 4)) % e
        elif kind == "hot":  # 11 experts: several chosen by > 8 tokens (two passes)
            ids[t] = (shift + rng.choice(11, k, replace=False)) % e
        else:
            ids[t] = rng.choice(e, k, replace=False)
    return ids


def manifest_entry(ker, cubin):
    """The runtime's manifest entry of a KernelSpec whose cubin is the file `cubin`."""
    from thorgen.runtime.manifest import KernelEntry

    return KernelEntry(
        name=ker.name,
        cubin=cubin,
        entry=ker.name,
        family=ker.family,
        grid=ker.grid,
        block=ker.block,
        smem_bytes=ker.smem_bytes,
        args=ker.args,
        params=dict(ker.params),
        template=ker.template,
    )


def run(dirs):
    from thorgen.runtime.bench.kernels import KernelRig
    from thorgen.runtime.cuda.device import Device, check, driver
    from thorgen.runtime.cuda.programs import _grid

    gpu = KernelRig(Device.open(0), Path("/tmp/sweep-rig"))
    rng = np.random.default_rng(0)
    h, ie, e, k, m = 2816, 704, 128, 8, 16
    gu_w = gpu.upload(rng.integers(0, 256, e * 2 * ie * h // 2, dtype=np.uint8))
    gu_s = gpu.upload(rng.integers(0, 0x38, e * 2 * ie * h // 16, dtype=np.uint8))  # e4m3 up to ~0.9
    gu_g = gpu.upload(rng.uniform(1e-3, 2e-3, e * 2 * ie // 8).astype(np.float32))
    dn_w = gpu.upload(rng.integers(0, 256, e * h * ie // 2, dtype=np.uint8))
    dn_s = gpu.upload(rng.integers(0, 0x38, e * h * ie // 16, dtype=np.uint8))
    dn_g = gpu.upload(rng.uniform(1e-3, 2e-3, e * h // 8).astype(np.float32))
    x = gpu.upload(rng.uniform(-1, 1, m * h).astype(np.float16))
    act = gpu.upload(rng.uniform(-1, 1, m * k * ie).astype(np.float16))
    wts = gpu.upload(rng.uniform(0, 0.3, m * k).astype(np.float32))
    out_act = gpu.alloc(m * k * ie * 2)
    out_y = gpu.alloc(m * k * h * 4)
    host = {kind: [routing(rng, kind, shift=32 * j) for j in range(4)] for kind in ("pool32", "hot", "random")}
    nexp = {kind: max(len(np.unique(r)) for r in rs) for kind, rs in host.items()}
    print("experts a routing (most of 4):", nexp, flush=True)
    routes = {kind: [gpu.upload(r) for r in rs] for kind, rs in host.items()}
    res, ref = [], {}
    for d in dirs:
        index = [
            (ent, pickle.loads(bytes.fromhex(ent["kernel"])))
            for ent in json.loads((Path(d) / "index.json").read_text())
        ]
        # old and new kernels share names: each folder's replace the previous folder's
        gpu.add([manifest_entry(ker, Path(d) / (ker.name + ".cubin")) for _, ker in index])
        for ent, ker in index:
            isgu = ker.name.startswith("moe_gateup")
            # the runtime's launch grid for m rows (the block-row kernels' ROW_GRID rule)
            grid = _grid(SimpleNamespace(grid=ker.grid, params=dict(ker.params)), m)
            exact = os.environ.get("GRID_Y") == "exact" and "ROW_GRID" in dict(ker.params)
            row = dict(label=ent["label"] + ("-exact" if exact else ""), kernel=ker.name, grid=grid)

            def args(r):
                return (
                    [gu_w, gu_s, gu_g, x, r, out_act, np.int32(m)]
                    if isgu
                    else [dn_w, dn_s, dn_g, act, r, wts, out_y, np.int32(m)]
                )

            for kind, rs in routes.items():
                # GRID_Y=exact: block rows only for the experts the routings name (what the empty rows cost)
                g = (grid[0], nexp[kind], grid[2]) if exact else grid
                try:
                    turn = iter(range(1 << 30))
                    t = gpu.graph_time_ms(lambda: gpu.launch(ker.name, args(rs[next(turn) % 4]), g), reps=64)
                    row[kind + "_us"] = round(t * 1e3, 2)
                    # bit check on the second routing against the first kernel of this kind
                    ob = out_act if isgu else out_y
                    check(driver().cuMemsetD8Async(ob.ptr, 0xFF, ob.nbytes, gpu.stream.handle), "fill output")
                    gpu.launch(ker.name, args(rs[1]), g)
                    got = gpu.download(ob, (ob.nbytes,), np.uint8)
                    first = ref.setdefault(("gu" if isgu else "dn", kind), got)
                    row[kind + "_same"] = bool(np.array_equal(got, first))
                except Exception as exc:  # one failing variant must not end the sweep
                    row[kind + "_error"] = str(exc)[:200]
            print(json.dumps(row), flush=True)
            res.append(row)
    return res


if __name__ == "__main__":
    if sys.argv[1] == "prep":
        prep(sys.argv[2], sys.argv[3])
    else:
        r = run(sys.argv[2:-1])
        Path(sys.argv[-1]).write_text(json.dumps(r, indent=1))
