"""GPU debugging script (not a test): the CUDA engine on the tiny synthetic model, layer by layer, next to the
reference backend and next to the CPU-emulated engine (tests/engine_emulator.py), in one run.

    python3 tests/debug_engine_gpu.py [--kv bf16|fp8] [--tokens 41] [--decode 4] [--kernels DIR]

Prints, for the prefill and for each greedy decode step (run eagerly, then checked against the graphed step):
  free   : rel L2 of the GPU residual stream after layer l vs the free-running reference (all rows / last row)
  local  : teacher-forced: the reference layer l fed the GPU's own layer input and KV cache (read back through
           the ring-slot arithmetic), rel L2 over the rows whose top-k experts agree, the worst such row, and the
           rows whose routing flipped (with the smallest reference router gap k-th vs k+1-th among them)
  emu    : rel L2 vs the CPU-emulated engine (same wiring, NumPy kernels) after layer l (prefill only)
then the logits: vs the reference (bf16 tied lm_head), vs the GPU's own final hidden row through the artifact's
NVFP4 lm_head (kernel-level check), and the reference's final hidden row through that same NVFP4 lm_head.
Kernels: --kernels DIR / $THORGEN_KERNELS (a manifest.json folder), else only the kernels this forward needs are
built with codegen (parallel nvcc) into a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def needed_kernels(spec, arch, kv: str, tmp: Path) -> list:
    """The planned KernelSpecs the engine's forwards launch (decode, verify-sized, prefill; greedy and sampled)."""
    import engine_emulator as EE
    from thorgen.codegen.plan import plan
    from thorgen.runtime.forward import Copy2D, Forward
    from thorgen.runtime.modules import load_manifest

    man = load_manifest(EE.write_fake_manifest(spec, tmp / "planned", arch.name))
    fwd = Forward(spec, man, "bf16" if kv == "bf16" else "fp8e4m3", int(man.conventions["max_step_tokens"]))
    names = set()
    for rows in (1, 2, 17, fwd.max_rows):
        for greedy in (True, False):
            names |= {op.entry.name for op in fwd.ops(rows, decode=rows == 1, last=True, greedy=greedy)
                      if not isinstance(op, Copy2D)}
    return [k for k in plan(spec, arch) if k.name in names]


def kv_snapshot(engine, start: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer float32 K, V [start, Hkv, D] of positions < start from the GPU cache (overwritten ring slots 0)."""
    from thorgen.codegen import reference_kernels as RK

    out = []
    for l, info in enumerate(engine.kv.plan.target()):
        dt = "bf16" if info.dtype == "bf16" else "fp8e4m3"
        shape = (info.slots, info.kv_heads, info.head_dim)
        kk, vv = (RK.load(b.download(RK.np_dtype(dt), shape), dt) for b in (engine.kv.k(l), engine.kv.v(l)))
        k = np.zeros((start,) + shape[1:], np.float32)
        v = np.zeros_like(k)
        for pos in range(max(0, start - info.slots) if info.ring else 0, start):
            k[pos], v[pos] = kk[info.slot(pos)], vv[info.slot(pos)]
        out.append((k, v))
    return out


# Layer-0 stages: (op label suffix, what, [(activation buffer, storage dtype, columns or None = all)]) downloaded after
# that launch of layer 0 (the last MoE slice for moe_down), so the emulator-vs-GPU error is seen stage by stage.
STAGES = (
    ("qkv", "q|k|v GEMM (f32)", [("qkv", "f32", "qkv")]),
    ("rope_kv", "q norm+rope (bf16)", [("q", "bf16", "q")]),
    ("attention", "attention out (f16)", [("attn", "f16", "q")]),
    ("attn_combine", "split-K combine (f16)", [("attn", "f16", "q")]),
    ("o_proj", "o_proj (f32)", [("o", "f32", None)]),
    ("attn_tail", "attn_tail x|a1|a2", [("x", "f32", None), ("a1", "f16", None), ("a2", "f16", None)]),
    ("o_proj_tail", "o_proj + attn_tail (1 row)", [("o", "f32", None), ("x", "f32", None), ("a1", "f16", None),
                                                   ("a2", "f16", None)]),
    ("router", "router logits (f32)", [("rlogits", "f32", None)]),
    ("topk", "top-k weights (f32)", [("topk_w", "f32", None)]),
    ("mlp_gate_up", "dense gelu*up (f16)", [("mlp_act", "f16", None)]),
    ("mlp_down", "dense down (f32)", [("mlp", "f32", None)]),
    ("moe_down", "MoE out (f32)", [("moe", "f32", None)]),
    ("ffn_tail", "ffn_tail x|a", [("x", "f32", None), ("a", "f16", None)]),
)


def _download(engine, name: str, dt: str, n: int, width: str | None) -> np.ndarray:
    """Rows 0..n-1 of an activation buffer as float64, cut to layer 0's width ("q": Hq*D, "qkv": q|k|v)."""
    from thorgen.codegen import reference_kernels as RK

    t = engine.spec.target
    r = engine.act.plan.regions[name]
    cols = int(np.prod(r.shape[1:]))
    raw = engine.act[name].download(RK.np_dtype(dt), (r.shape[0], cols))[:n]
    nq, nk = t.num_attention_heads * t.layer_head_dim(0), t.layer_kv_heads(0) * t.layer_head_dim(0)
    keep = {None: cols, "q": nq, "qkv": nq + nk * (2 if t.layer_has_v_proj(0) else 1)}[width]
    return RK.load(raw[:, :keep], dt).astype(np.float64)


def probed_forward(engine, ids: list[int], start: int, decode_token: int | None = None) -> dict:
    """Run one forward eagerly (prefill of `ids` from 0, or a decode step of `decode_token` at `start`), downloading
    the residual stream at the embedding and after every layer, every layer's top-k ids, and layer 0's stage
    outputs (STAGES) and KV cache rows."""
    t = engine.spec.target
    H, K = t.hidden_size, t.top_k_experts
    n = 1 if decode_token is not None else len(ids)
    engine.stream.synchronize()
    f = dict(start=start, n=n, xs=[], idx=[], kv=kv_snapshot(engine, start), stages={})
    if decode_token is None:
        engine.act["ids"].view(0, 4 * n).upload(np.asarray(ids, np.int32))
        engine.act["positions"].view(0, 4 * n).upload(np.arange(start, start + n, dtype=np.int32))
        engine.act["positions"].view(4 * engine.max_rows, 4).upload(np.array([start + n], np.int32))
    else:
        engine._stage(0, start, decode_token)
    launches = engine.bind(engine.fwd.ops(n, decode=decode_token is not None, last=True, greedy=True))
    for label, launch in launches:
        launch(engine.stream)
        if label.startswith("layers.0."):
            for suffix, what, bufs in STAGES:
                if label == "layers.0." + suffix:
                    engine.stream.synchronize()
                    f["stages"][suffix] = [_download(engine, b, dt, n, w) for b, dt, w in bufs]
                    if suffix == "rope_kv":  # the K/V rows this forward wrote into layer 0's cache
                        f["stages"]["kv0"] = kv_snapshot(engine, start + n)[0]
        if label == "embed" or label.endswith("ffn_tail"):
            engine.stream.synchronize()
            f["xs"].append(engine.act["x"].download(np.float32, (n, H)))
        elif label.endswith(".topk"):
            engine.stream.synchronize()
            f["idx"].append(engine.act["topk_idx"].download(np.int32, (n, K)))
    engine.stream.synchronize()
    f["token"] = int(engine.act["out_ids"].download(np.int32, (1,))[0])
    f["logits"] = engine.logits()
    return f


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def stage_report(gpu: dict, emu: dict) -> None:
    """Layer 0: emulator-vs-GPU rel L2 after each stage (the first stage with a large error holds the mismatch)."""
    print("  layer 0 stages, GPU vs emulated engine (rel L2; max |diff| / max |emu|; exact-equal fraction):")
    for suffix, what, bufs in STAGES + (("kv0", "K|V cache rows", [("k", "", None), ("v", "", None)]),):
        if suffix not in gpu["stages"] or suffix not in emu["stages"]:
            continue
        parts = []
        for (b, _, _), g, e in zip(bufs, gpu["stages"][suffix], emu["stages"][suffix]):
            g, e = np.asarray(g, np.float64), np.asarray(e, np.float64)
            if suffix == "kv0":
                g, e = g[gpu["start"]:], e[emu["start"]:]
            mx = float(np.abs(g - e).max() / max(np.abs(e).max(), 1e-30))
            parts.append(f"{b} {rel(g, e):.2e} {mx:.1e} {float((g == e).mean()):.3f}")
        print(f"    {what:24s} | " + " | ".join(parts))


def report(m, f: dict, seq: list[int], emu: dict | None = None) -> None:
    from test_engine_emulated import _reference_layer

    cache = m.new_cache()
    x = m.embed(np.asarray(seq[:f["start"] + f["n"]]))
    print(f"  forward at position {f['start']} (+{f['n']} rows): embed rel {rel(f['xs'][0], x[f['start']:]):.2e}")
    print("  layer | free all  last   | local unflipped worst-row flips(min gap) | emu")
    for l in range(m.spec.num_hidden_layers):
        x = m.layer(l, x, cache, 0)
        ref_rows = x[f["start"]:]
        got = f["xs"][l + 1]
        want, idx, gap = _reference_layer(m, l, f["xs"][l], f["kv"][l], f["start"])
        flipped = (np.sort(f["idx"][l], 1) != np.sort(idx, 1)).any(1)
        err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        keep = ~flipped
        local = rel(got[keep], want[keep]) if keep.any() else float("nan")
        worst = float(err[keep].max()) if keep.any() else float("nan")
        fl = f"{int(flipped.sum())}" + (f"({gap[flipped].min():.3f})" if flipped.any() else "")
        e = f"{rel(got, emu['xs'][l + 1]):.2e}" if emu is not None else "-"
        print(f"  {l:5d} | {rel(got, ref_rows):.2e} {rel(got[-1], ref_rows[-1]):.2e} | {local:.2e} {worst:.2e} "
              f"{fl:>14s} | {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--tokens", type=int, default=41, help="prompt length (<= 512: one prefill chunk)")
    ap.add_argument("--decode", type=int, default=4, help="greedy decode steps to check")
    ap.add_argument("--kernels", default=os.environ.get("THORGEN_KERNELS"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    from thorgen.codegen.arch import get_arch
    from thorgen.codegen.builder import build
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.model_spec.synth import write_synthetic_checkpoint
    from thorgen.runtime.backend import SamplingParams
    from thorgen.runtime.cuda_backend import open_backend
    from thorgen.runtime.device import Device
    from thorgen.runtime.reference.model import TargetModel
    from thorgen.runtime.reference.ops import rms_norm, softcap
    from thorgen.runtime.repack import repack

    from test_engine_emulated import _lm_head

    tmp = Path(tempfile.mkdtemp(prefix="thorgen-debug-"))
    ckpt = tmp / "tiny"
    write_synthetic_checkpoint("tiny", ckpt, seed=0)
    ck = Checkpoint.open(ckpt)
    dev = Device.open(0)
    arch = get_arch(dev.info.arch)
    weights = repack(ckpt, tmp / "weights", arch=dev.info.arch)
    kdir = Path(args.kernels) if args.kernels else None
    if kdir is None or not (kdir / "manifest.json").is_file():
        kdir = tmp / "kernels"
        ks = needed_kernels(ck.spec, arch, args.kv, tmp)
        rep = build(ck.spec, arch, kdir, kernels=ks)
        print(f"built {len(ks)} kernels ({rep.compiled} compiled) in {time.perf_counter() - t0:.1f} s")
    backend = open_backend(ckpt, ctx=1024, kv_dtype=args.kv, weights_dir=weights, kernels_dir=kdir)
    e, t = backend.engine, backend.spec.target
    m = TargetModel(ck)
    lm_q = _lm_head(backend)
    ids = [2] + np.random.default_rng(2).integers(256, 512, args.tokens - 1).tolist()
    print(f"GPU {dev.info.name} ({dev.info.arch}), kv {args.kv}, prompt {len(ids)} tokens, ready at "
          f"{time.perf_counter() - t0:.1f} s")

    forwards = [probed_forward(e, ids, 0)]
    seq = ids + [forwards[0]["token"]]
    for _ in range(args.decode):
        forwards.append(probed_forward(e, seq, len(seq) - 1, decode_token=seq[-1]))
        seq.append(forwards[-1]["token"])
    graphed = backend.generate(ids, args.decode + 1, SamplingParams()).token_ids
    backend.close()

    emu = None
    try:  # the same prefill on the CPU-emulated engine (same code, NumPy kernels)
        import engine_emulator as EE
        from thorgen.runtime import device as devmod
        man = EE.write_fake_manifest(ck.spec, tmp / "emu-kernels", arch.name)
        EE.install(man)
        eb = open_backend(ckpt, ctx=1024, kv_dtype=args.kv, weights_dir=repack(ckpt, tmp / "emu-weights"),
                          kernels_dir=man)
        emu = probed_forward(eb.engine, ids, 0)
        eb.close()
        devmod.set_driver(None)
    except Exception as exc:  # the GPU part is what matters; report and go on
        print(f"(emulated engine skipped: {type(exc).__name__}: {exc})")

    cap = t.final_logit_softcapping
    for i, f in enumerate(forwards):
        print(f"\n== {'prefill' if i == 0 else f'decode step {i}'} ==")
        report(m, f, seq, emu if i == 0 else None)
        if i == 0 and emu is not None:
            stage_report(f, emu)
        want = m.forward(seq[:f["start"] + f["n"]], m.new_cache(), last_only=True)
        h_gpu = rms_norm(f["xs"][-1][-1:], m.w.plain("norm.weight"), t.rms_norm_eps).astype(np.float16)
        got = softcap(f["logits"], cap)
        print(f"  logits: vs reference {rel(got, want.logits[-1]):.3e} | vs GPU hidden x NVFP4 lm_head "
              f"{rel(f['logits'], (h_gpu.astype(np.float64) @ lm_q.T)[0]):.3e} | token {f['token']} "
              f"(reference argmax {int(np.argmax(want.logits[-1]))})")
    # the reference's own final hidden row through the NVFP4 lm_head: how far the lm_head quantisation alone moves it
    last = t.num_hidden_layers - 1
    hx = m.forward(ids, m.new_cache(), taps=(last,), last_only=True)
    x_last = hx.taps[last][-1:]
    h_ref = rms_norm(x_last, m.w.plain("norm.weight"), t.rms_norm_eps).astype(np.float64)
    lq = softcap((h_ref @ lm_q.T)[0].astype(np.float32), cap)
    print(f"\nreference hidden x NVFP4 lm_head vs reference (bf16 lm_head): rel {rel(lq, hx.logits[-1]):.3e}, "
          f"argmax {int(np.argmax(lq))} vs {int(np.argmax(hx.logits[-1]))}  (the lm_head quantisation alone)")

    print(f"eager tokens {seq[len(ids):]} | graphed generate {graphed}")
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
