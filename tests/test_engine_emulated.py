"""CPU tests of the CUDA engine's wiring: the real engine (open_backend, Engine, Forward, graphs, staging) runs on an
emulated GPU (tests/engine_emulator.py: fake driver + NumPy kernel references) against the reference backend.

Each forward the engine runs (prefill chunk or decode step) is checked layer by layer with teacher forcing: the
engine's own layer input and its own KV cache (read back from emulated device memory through the ring-slot
arithmetic) go through the reference layer, so a wiring error shows up in the layer where it is made, while the
expected precision loss (fp16 GEMM inputs, bf16 Q/KV) stays local. A row may only differ by more than the row
tolerance where the engine's top-k experts differ from the reference's AND the reference's k-th / (k+1)-th router
logits are a near-tie (the tiny synthetic model's near-uniform routers make such flips common; they are
numerics, not wiring). Then the lm_head (against the artifact's own NVFP4 lm_head), argmax and the seeded sampler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_emulator as EE  # noqa: E402

pytest.importorskip("thorgen.codegen.plan")  # the fake manifest comes from codegen's real plan

import reference_kernels as RK  # noqa: E402
from thorgen.model_spec.nvfp4 import dequantize_nvfp4_mul  # noqa: E402
from thorgen.runtime.backend import SamplingParams  # noqa: E402
from thorgen.runtime.reference import sampling as S  # noqa: E402
from thorgen.runtime.reference.ops import mm, rms_norm, softcap  # noqa: E402

ROW_TOL = {"bf16": 2e-2, "fp8": 1e-1}  # per-row relative L2 of one layer's output (measured ~3e-3 with bf16)
LAYER_TOL = {"bf16": 1e-2, "fp8": 5e-2}  # whole layer, flipped rows excluded
ROUTER_TIE = 0.1  # router logit gap (k-th vs k+1-th) below which a top-k flip is numerics


@pytest.fixture(scope="module")
def emulated(tiny_checkpoint, tmp_path_factory):
    from thorgen.model_spec.checkpoint import Checkpoint
    from thorgen.runtime.cuda import device as dev
    from thorgen.runtime.reference.backend import ReferenceBackend
    from thorgen.runtime.convert.repack import repack

    ck = Checkpoint.open(tiny_checkpoint)
    root = tmp_path_factory.mktemp("emulated")
    weights = repack(tiny_checkpoint, root / "weights")
    kernels = EE.write_fake_manifest(ck.spec, root / "kernels")
    made = {}

    def open_(kv: str, ctx: int = 1024):
        from thorgen.runtime.cuda.backend import open_backend

        if (kv, ctx) not in made:
            drv = EE.install(kernels)
            made[kv, ctx] = (
                open_backend(tiny_checkpoint, ctx=ctx, kv_dtype=kv, weights_dir=weights, kernels_dir=kernels),
                drv,
            )
        dev.set_driver(made[kv, ctx][1])
        return made[kv, ctx]

    yield open_, ReferenceBackend(ck, max_context=4096, prefix_cache=False).target
    for b, drv in made.values():
        dev.set_driver(drv)
        b.close()
    dev.set_driver(None)


class Probe:
    """Records, per forward the engine runs: start position, rows, the residual stream entering every layer and
    leaving the last, each layer's top-k ids, and each layer's KV cache contents before the forward."""

    def __init__(self, backend, drv) -> None:
        self.e, self.d = backend.engine, drv
        self.t = backend.spec.target
        self.forwards: list[dict] = []
        drv.emu.after = self.after

    def after(self, name: str, entry: dict, a: dict) -> None:
        t, H = entry["template"], self.t.hidden_size
        if t.startswith("embed"):
            start = int(self.d.view(self.e.buffers.A("positions").address, np.int32, 1)[0])
            self.forwards.append(
                dict(
                    start=start,
                    n=a["T"],
                    xs=[self.d.view(a["out"], np.float32, (a["T"], H)).copy()],
                    idx=[],
                    kv=[self._kv(l, start) for l in range(self.t.num_hidden_layers)],
                )
            )
        elif t.startswith(("router_topk", "router_fused")):
            self.forwards[-1]["idx"].append(self.d.view(a["topk_idx"], np.int32, (a["T"], entry["params"]["K"])).copy())
        elif t.startswith("ffn_tail"):
            self.forwards[-1]["xs"].append(self.d.view(a["x"], np.float32, (a["T"], H)).copy())

    def _kv(self, layer: int, start: int) -> tuple[np.ndarray, np.ndarray]:
        """float32 K, V [start, Hkv, D] of positions 0..start-1 as the engine's cache holds them (slots that a
        ring has already overwritten, i.e. keys outside the window, are left zero: attention never reads them)."""
        info = self.e.kv.plan.layers[layer]
        k = np.zeros((start, info.kv_heads, info.head_dim), np.float32)
        v = np.zeros_like(k)
        lo = max(0, start - info.slots) if info.ring else 0
        dt = "bf16" if info.dtype == "bf16" else "fp8e4m3"
        for which, dst in (("k", k), ("v", v)):
            buf = self.e.kv.k(layer) if which == "k" else self.e.kv.v(layer)
            rows = self.d.view(buf.ptr, RK.np_dtype(dt), (info.slots, info.kv_heads, info.head_dim))
            for pos in range(lo, start):
                dst[pos] = RK.load(rows[info.slot(pos)], dt)
        return k, v


def _reference_layer(m, l: int, x: np.ndarray, kv: tuple[np.ndarray, np.ndarray], start: int):
    """(layer output, top-k ids, router logit gap k-th vs k+1-th) of reference layer l on the engine's input."""
    cache = m.new_cache()
    if start:
        cache.write(l, 0, *kv)
        cache.set_length(start)
    h = m._attention(l, m._norm(l, "input_layernorm", x), cache, start)
    xa = x + m._norm(l, "post_attention_layernorm", h)
    s, p = m.spec, f"layers.{l}.router."
    hn = rms_norm(xa, None, s.rms_norm_eps) * m.w.plain(p + "scale") * np.float32(s.hidden_size**-0.5)
    srt = -np.sort(-mm(hn, m.w.plain(p + "proj.weight")).astype(np.float64), axis=-1)
    gap = srt[:, s.top_k_experts - 1] - srt[:, s.top_k_experts]
    _, idx = m.route(l, xa)
    out = (xa + m._feed_forward(l, xa)) * m.w.plain(f"layers.{l}.layer_scalar")
    return out, idx, gap


def _check_forward(m, f: dict, kv: str) -> int:
    """Teacher-forced per-layer comparison of one recorded forward; returns the number of routing-flip rows."""
    flips = 0
    for l in range(m.spec.num_hidden_layers):
        want, idx, gap = _reference_layer(m, l, f["xs"][l], f["kv"][l], f["start"])
        got = f["xs"][l + 1]
        err = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
        flipped = (np.sort(f["idx"][l], axis=1) != np.sort(idx, axis=1)).any(axis=1)
        bad = np.flatnonzero(err > ROW_TOL[kv])
        where = f"forward at {f['start']} (+{f['n']} rows), layer {l}"
        for r in bad:
            assert flipped[r] and gap[r] < ROUTER_TIE, (
                f"{where}, row {r}: rel error {err[r]:.3g} (routing flip: {bool(flipped[r])}, router gap {gap[r]:.3g})"
            )
        keep = ~flipped
        if keep.any():
            e = np.linalg.norm(got[keep] - want[keep]) / np.linalg.norm(want[keep])
            assert e <= LAYER_TOL[kv], f"{where}: rel error {e:.3g} over the unflipped rows"
        flips += int(flipped.sum())
    return flips


def _lm_head(backend) -> np.ndarray:
    """float64 [V, H] NVFP4 lm_head exactly as repacked (what the engine multiplies with)."""
    from artifact_readback import unpack_linear

    packed, scale, multiplier = unpack_linear(backend.engine.art, "embed_tokens")
    return dequantize_nvfp4_mul(packed, scale, multiplier).astype(np.float64)


def _check_logits(m, backend, f: dict) -> np.ndarray:
    """The engine's logits vs its final residual row through the final norm and the NVFP4 lm_head."""
    t = backend.spec.target
    h = rms_norm(f["xs"][-1][-1:], m.w.plain("norm.weight"), t.rms_norm_eps).astype(np.float16).astype(np.float64)
    want = (h @ _lm_head(backend).T)[0]
    got = backend.engine.logits()
    assert RK.norm_err(got, want) <= 1e-4, f"lm_head at {f['start'] + f['n'] - 1}: {RK.norm_err(got, want):.3g}"
    return softcap(got, t.final_logit_softcapping)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_prefill_and_greedy_decode_layer_by_layer(emulated, kv):
    """A prompt of two chunks (max_step_tokens + 88 rows, past the window + max_step_tokens-slot ring), then greedy
    decode steps."""
    open_, m = emulated
    backend, drv = open_(kv, 4096 if kv == "bf16" else 1024)  # bf16: room for a prompt of two whole chunks
    probe = Probe(backend, drv)
    chunk = backend.engine.max_rows
    ids = [2] + np.random.default_rng(5).integers(256, 512, chunk + 87 if kv == "bf16" else 40).tolist()
    tok = backend.engine.prefill(ids)
    seq = list(ids)
    for _ in range(3):
        f = probe.forwards[-1]
        assert f["start"] + f["n"] == len(seq), "the forward did not end at the last fed token"
        capped = _check_logits(m, backend, f)
        assert tok == S.greedy(capped)
        seq.append(tok)
        tok = EE.decode_step(backend.engine, len(seq) - 1)
    starts = [(f["start"], f["n"]) for f in probe.forwards]
    want_starts = [(0, chunk), (chunk, 88)] if kv == "bf16" else [(0, 41)]
    assert starts == want_starts + [(len(ids) + i, 1) for i in range(3)]
    flips = sum(_check_forward(m, f, kv) for f in probe.forwards)
    assert flips <= 0.05 * sum(f["n"] for f in probe.forwards) * m.spec.num_hidden_layers


def test_seeded_sampling_positions_and_params(emulated):
    """The sampler draws each token at its own position with the uploaded parameters, after a one-row prompt (the
    graphed step embeds the prompt token itself) and after a chunked one; then generate() streams the same."""
    open_, m = emulated
    backend, drv = open_("bf16")
    probe = Probe(backend, drv)
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=11)
    for prompt in ([2], [2] + list(range(300, 320))):
        probe.forwards.clear()
        backend.engine.set_sampling(params)
        tok = backend.engine.prefill(prompt, greedy=False)
        seq, toks = list(prompt), []
        for _ in range(4):
            f = probe.forwards[-1]
            assert f["start"] + f["n"] == len(seq)
            capped = _check_logits(m, backend, f)
            assert tok == S.sample(capped, params, len(seq)), f"sampled token at position {len(seq)}"
            seq.append(tok)
            toks.append(tok)
            tok = EE.decode_step(backend.engine, len(seq) - 1, greedy=False)
        for f in probe.forwards:
            _check_forward(m, f, "bf16")
        assert backend.generate(prompt, 4, params).token_ids == toks


def test_pdl_only_between_kernels(emulated):
    """A kernel is launched with PDL only right after a kernel of its own stream: never the first launch of a
    forward (it follows the host's staging copies), never right after a strided copy, never the first op of the
    side-stream branch (dense MLP) or the op that joins it back; the MLP runs on the side stream."""
    from thorgen.runtime.cuda.programs import Copy2D

    open_, _ = emulated
    backend, drv = open_("bf16")
    eng = backend.engine
    assert eng.launches.pdl and eng.options.fork, (
        "the manifest's conventions say every kernel is PDL-safe; fork is on by default"
    )
    for rows, decode in ((1, True), (40, False)):
        ops = eng.fwd.ops(rows, decode=decode, last=True)
        flags = [getattr(l, "pdl", None) for _, l in eng.launches.bind(ops)]
        assert flags[0] is False
        n_pdl = 0
        for i in range(1, len(ops)):
            op, prev = ops[i], ops[i - 1]
            if isinstance(op, Copy2D):
                continue
            first_side = op.branch == 1 and (isinstance(prev, Copy2D) or prev.branch == 0)
            if isinstance(prev, Copy2D) or first_side or op.join:
                assert flags[i] is False, op.label
            n_pdl += bool(flags[i])
        assert n_pdl > len(ops) // 2
        assert {o.label.split(".")[-1] for o in ops if not isinstance(o, Copy2D) and o.branch} == {
            "mlp_gate_up",
            "mlp_down",
        }
    before = drv.pdl_launches
    eng.prefill([2] + list(range(300, 339)))  # an eager 40-row chunk: its kernels reach the driver as PDL launches
    assert drv.pdl_launches > before


def test_profile_step_times_every_launch(emulated):
    """`thorgen bench`'s breakdown: one row per launch of the forward (decode: per-kernel graphs; prefill chunk:
    eager), in schedule order, and the engine's fork/PDL settings are restored afterwards."""
    from thorgen.runtime.cuda.profile import profile_step

    open_, _ = emulated
    backend, _ = open_("bf16")
    eng = backend.engine
    for rows, decode in ((1, True), (40, False)):
        want = [op.label for op in eng.fwd.ops(rows, decode=decode, last=True)]
        got = profile_step(eng, 3, rows=rows)
        assert sorted(r["op"] for r in got) == sorted(want) and (rows == 1 or [r["op"] for r in got] == want)
        assert all(r["us"] >= 0 and r["kernel"] for r in got)
    assert eng.options.fork and eng.launches.pdl


def test_plain_generation_stop_length_and_cancel(emulated):
    """The shared decode loop on plain steps: a stop id ends the run (and is kept), max_tokens and the context end
    give "length", a cancel before a step gives "cancelled"; each step is one token (no accepted counts)."""
    open_, _ = emulated
    backend, _ = open_("bf16")
    ids = [2] + list(range(300, 320))
    params = SamplingParams(temperature=1.0, seed=5)  # varied tokens (greedy on the tiny model repeats one id)
    free = backend.generate(ids, 12, params)
    assert len(free.token_ids) == 12 and free.finish_reason == "length" and free.accepted_lengths == []
    k = next(i for i in range(2, 12) if free.token_ids[i] not in free.token_ids[:i])  # first produced mid-run
    got = backend.generate(ids, 12, params, stop_ids=frozenset({free.token_ids[k]}))
    assert got.token_ids == free.token_ids[: k + 1] and got.finish_reason == "stop"
    steps = list(backend.generate_stream(ids, 5, params))
    assert [s.token_ids for s in steps] == [[t] for t in free.token_ids[:5]]
    assert all(s.accepted is None for s in steps)
    room = backend.max_context - len(ids)  # tokens until the context is full
    end = backend.generate(ids, room + 10, params)
    assert len(end.token_ids) == room and end.finish_reason == "length"
    cut = backend.generate(ids, 12, params, cancelled=lambda: True)  # polled before every step: no work at all
    assert cut.token_ids == [] and cut.finish_reason == "cancelled"
    polls: list = []
    cut = backend.generate(ids, 12, params, cancelled=lambda: len(polls.append(1) or polls) > 2)
    assert cut.token_ids == free.token_ids[:2] and cut.finish_reason == "cancelled"


def test_one_sequence_steps_launched_ahead(emulated):
    """A sequence decoding alone: each plain step is launched before the step before it is read (it decodes the token
    that step leaves on the device). Tokens, stops and lengths equal those of steps launched when scheduled, across
    requests that end with a step in flight (a stop id, max_tokens) and the next request in the same lane."""
    open_, _ = emulated
    backend, _ = open_("bf16")
    hot = SamplingParams(temperature=1.0, seed=5)
    ids = [2] + list(range(300, 320))
    free = backend.generate(ids, 12, hot).token_ids
    stop = next(t for i, t in enumerate(free) if i >= 3 and t not in free[:i])
    reqs = [(ids, 12, hot), ([2, 40, 41], 9, SamplingParams()), (ids, 3, SamplingParams(temperature=0.8, seed=1))]
    ahead, used = EE.run_requests(backend, True, reqs, stop_ids=frozenset({stop}))
    plain, none = EE.run_requests(backend, False, reqs, stop_ids=frozenset({stop}))
    assert ahead == plain and none == 0, (ahead, plain)
    steps = sum(len(t) - 1 for t, _, _ in ahead)  # decode steps (a first token comes from the prefill)
    assert used == steps - len(reqs), (used, steps)  # all but each request's first
    assert ahead[0][0] == free[: free.index(stop) + 1] and ahead[0][2] == "stop"


def test_eager_forwards_create_no_events(emulated, monkeypatch):
    """Ragged prefill chunks are bound again on every call: their side-stream fork/join must reuse the engine's
    event pair instead of creating (and keeping) new CUDA events each time."""
    open_, _ = emulated
    backend, _ = open_("bf16")
    eng = backend.engine
    made: list = []
    real = eng.device.event
    monkeypatch.setattr(eng.device, "event", lambda *a, **k: made.append(1) or real(*a, **k))
    for n in (30, 31, 45):
        eng.prefill([2] + list(range(300, 300 + n)))
    assert made == []
