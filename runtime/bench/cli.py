"""Runtime stage: `thorgen bench` — TTFT, decode tok/s, weight bandwidth vs a copy probe, memory and load time.

Method: load the backend (timed), warm up once, then `--runs` back-to-back greedy generations of exactly `--gen`
tokens for one synthetic `--prompt-len` prompt (no stop ids, prefix cache off). TTFT = start of the call to the
first token; decode tok/s = (tokens - 1) / (last token - first token); medians are reported. Weight bytes per
decode step come from the spec (every non-expert weight + top_k of the experts + the lm_head), so achieved GB/s =
bytes x tok/s; the copy probe (device-to-device on the cuda backend, host memcpy on the reference backend) is
measured in the same process so the fraction compares like with like. `--roofline` turns these step times
into fractions of the copy and tensor-core ceilings (runtime/bench/roofline.py); `--suite FILE` runs a prompt suite
instead (runtime/bench/suite.py).
"""

from __future__ import annotations

import datetime as _dt
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import click

from ..api import EngineOptions, engine_option_flags
from ..backend import BackendError
from ..options import DEFAULT_CTX
from .bench_text import bench_text
from .timing import host_copy_gb_s, open_for_bench, synthetic_prompt, timed_run, timed_stream
from .image import BENCH_BUDGETS, parse_budgets
from .roofline import COPY_GBS_SEEN, roofline_entry, step_cost, target_weight_bytes, tc_ceiling


def measure_roofline(backend: Any, facts: dict, report: dict, prompt: list[int], gen: int, runs: int) -> None:
    """Add `roofline` ({step: {bytes, flops, ms, copy_gbs, frac_copy, frac_tc}}) and `roofline_ceilings` to a
    `run_bench` report. decode: the median plain step (B 1) at the mean context of the timed steps; prefill: the
    event-timed chunk of the kernel breakdown where there is one, else the whole prompt's TTFT; verify: the
    median speculative step (draft + verify) of `runs` greedy generations, where the model has a drafter."""
    spec, lm, kv, copy = backend.spec, facts["lm_head"], report["kv_dtype"], report["copy_gb_s"]
    tc = tc_ceiling(facts["gpu"])
    mid = report["prompt_len"] + gen // 2
    rl = {"decode": roofline_entry(step_cost(spec, "decode", mid, 1, kv, lm), report["step_ms"], copy, tc)}
    if report.get("prefill_chunk_kernels"):
        rows, ms = report["prefill_chunk_rows"], sum(k["us"] for k in report["prefill_chunk_kernels"]) / 1e3
    else:
        rows, ms = report["prompt_len"], report["ttft_ms"]
    rl["prefill"] = roofline_entry(step_cost(spec, "prefill", rows, rows, kv, lm), ms, copy, tc)
    if backend.features.speculative:
        step_ms, taus = [], []
        for _ in range(runs):
            r = timed_stream(backend, prompt, gen, speculative=True)
            if r["steps"]:
                step_ms.append(1e3 * r["decode_s"] / r["steps"])
                taus.append(statistics.mean(r["accepted_lengths"]))
        if step_ms:
            tau = statistics.median(taus)
            block = spec.drafter.block_size
            cost = step_cost(spec, "verify", mid + block, block, kv, lm, accepted=tau)
            rl["verify"] = roofline_entry(cost, statistics.median(step_ms), copy, tc)
            report["speculative_tau"] = round(tau, 4)
            engine = getattr(backend, "engine", None)
            if engine is not None:  # the cuda backend: what one draft and one verify forward spend per kernel
                from ..cuda.profile import per_kernel, profile_speculative

                draft, verify = profile_speculative(engine, mid)
                report["draft_step_kernels"], report["verify_step_kernels"] = per_kernel(draft), per_kernel(verify)
    report["roofline"] = rl
    report["roofline_ceilings"] = {
        "copy_gbs": copy,
        "copy_probe": report["copy_probe"],
        "copy_gbs_seen": next((v for k, v in COPY_GBS_SEEN.items() if k in facts["gpu"]), None),
        "tc_tflops": tc,
        "tc_source": "dense bf16 matmul measured on this GPU kind (runtime/bench/roofline.py)" if tc else None,
        "decode_ctx": mid,
        "prefill_rows": rows,
    }


def run_bench(
    backend_name: str,
    model: Path,
    prompt_len: int,
    gen: int,
    runs: int,
    ctx: int | None,
    kv_dtype: str,
    command: str = "",
    weights: Path | None = None,
    kernel_dir: Path | None = None,
    roofline: bool = False,
    batch_sizes: list[int] | None = None,
    peer: str | None = None,
    speculative: bool = False,
    accept: int | None = None,
    options: EngineOptions = EngineOptions(),
    image: Path | None = None,
    image_budgets: Sequence[int] = BENCH_BUDGETS,
    sms: int | None = None,
    video: Path | None = None,
    video_frames: int | None = None,
) -> dict:
    t0 = time.perf_counter()
    backend, facts = open_for_bench(
        backend_name, model, ctx, kv_dtype, weights, kernel_dir, max(batch_sizes or [1]), options, sms
    )
    load_s = time.perf_counter() - t0
    ctx = backend.max_context
    if prompt_len + gen > ctx:
        raise BackendError(f"--prompt-len + --gen ({prompt_len + gen}) exceed the context of {ctx} (--ctx)")
    spec = backend.spec
    prompt = synthetic_prompt(spec, prompt_len)
    timed_run(backend, prompt, min(gen, 4))  # warm-up: graph capture, lazy weights, caches
    ready_s = time.perf_counter() - t0  # repacked weights on disk -> first tokens out (load + warm-up)
    ttfts, rates = [], []
    for _ in range(runs):
        ttft, dec, n = timed_run(backend, prompt, gen)
        ttfts.append(ttft)
        rates.append((n - 1) / dec if n > 1 and dec > 0 else float("nan"))
    tok_s = statistics.median(rates)
    wbytes = int(target_weight_bytes(spec, 1, facts["lm_head"]))
    if backend_name == "cuda":
        copy, copy_kind = backend.copy_bandwidth_gb_s(), "device-to-device copy"
        peak = backend.peak_gpu_mem_bytes() / 2**30
    else:
        copy, copy_kind, peak = host_copy_gb_s(), "host memcpy", None
    achieved = wbytes * tok_s / 1e9
    report = {
        "gpu": facts["gpu"],
        "command": command,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend_name,
        "model": spec.name,
        "spec_hash": spec.spec_hash,
        "prompt_len": prompt_len,
        "gen": gen,
        "runs": runs,
        "ctx": ctx,
        "kv_dtype": kv_dtype,
        "ttft_ms": round(statistics.median(ttfts) * 1e3, 3),
        "ttft_ms_runs": [round(t * 1e3, 3) for t in ttfts],
        "decode_tok_s": round(tok_s, 3),
        "decode_tok_s_runs": [round(r, 3) for r in rates],
        "step_ms": round(1e3 / tok_s, 4) if tok_s else None,
        "weight_bytes_per_step": wbytes,
        "lm_head": facts["lm_head"],
        "weights_format": facts["weights_format"],
        "achieved_gb_s": round(achieved, 3),
        "copy_gb_s": round(copy, 3),
        "copy_probe": copy_kind,
        "fraction_of_copy": round(achieved / copy, 4),
        "peak_gpu_mem_gib": None if peak is None else round(peak, 3),
        "load_s": round(load_s, 3),
        "ready_s": round(ready_s, 3),
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
    }
    if sms is not None:  # decode and the copy probe both ran on the green context's multiprocessors
        report.update(sms_requested=sms, sms=facts["sms"], device_sms=facts["device_sms"])
    if backend_name == "cuda" and hasattr(backend, "kernel_breakdown"):
        # decode: each kernel's launches replayed as a graph; prefill chunk: eager launches timed with events.
        report["decode_step_kernels"] = backend.kernel_breakdown()
        chunk = min(prompt_len, backend.engine.max_rows)
        if chunk > 1:
            report["prefill_chunk_rows"] = chunk
            report["prefill_chunk_kernels"] = backend.kernel_breakdown(rows=chunk)
    if roofline:
        measure_roofline(backend, facts, report, prompt, gen, runs)
    if speculative:
        from .speculative import measure_speculative

        measure_speculative(backend, report, prompt, gen, runs, accept)
    if batch_sizes:
        if backend_name != "cuda":
            raise BackendError("--batch-sizes times the cuda backend's batched decode graphs (use --backend cuda)")
        from .batched import measure_batched

        measure_batched(backend, report, batch_sizes, prompt_len + gen // 2)
    if image is not None:
        from .image import measure_image

        measure_image(backend, report, image, image_budgets, prompt, gen, runs)
    if video is not None:
        from ..text.tokenizer import Tokenizer
        from .video import measure_video

        tokenizer = Tokenizer.from_checkpoint(model)
        measure_video(backend, report, video, tokenizer, prompt, gen, runs, num_frames=video_frames)
    if peer == "hf":  # the same prompt and length on the same device, in the same run (runtime/bench/peer.py)
        from .peer import bench_peer

        p = bench_peer(model, prompt, gen, runs)
        p["decode_ratio"] = round(report["decode_tok_s"] / p["decode_tok_s"], 3) if p["decode_tok_s"] else None
        p["ttft_ratio"] = round(p["ttft_ms"] / report["ttft_ms"], 3) if report["ttft_ms"] else None
        report["peer"] = p
    return report


def _bench_suite(
    model: Path,
    backend: str,
    suite_file: Path,
    runs: int,
    ctx: int | None,
    kv_dtype: str,
    ignore_eos: bool,
    as_json: bool,
    out_file: Path | None,
    weights: Path | None,
    kernel_dir: Path | None,
) -> None:
    from .suite import row_text, run_suite

    command = (
        f"thorgen bench --model {model} --backend {backend} --suite {suite_file} --runs {runs}"
        + (f" --ctx {ctx}" if ctx else "")
        + f" --kv-dtype {kv_dtype}"
        + (" --ignore-eos" if ignore_eos else "")
        + (f" --weights {weights}" if weights else "")
        + (f" --kernel-dir {kernel_dir}" if kernel_dir else "")
    )
    try:
        report = run_suite(
            backend,
            model,
            suite_file,
            runs,
            ctx,
            kv_dtype,
            ignore_eos,
            command=command,
            weights=weights,
            kernel_dir=kernel_dir,
            progress=None if as_json else lambda row: click.echo(row_text(row)),
        )
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(report, indent=1) + "\n")
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(f"summary: {report['summary']}")


@click.group("bench", invoke_without_command=True)
@click.option(
    "--model",
    default=None,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint folder (the cuda backend also finds its repacked weights and kernels from it).",
)
@click.option("--backend", type=click.Choice(["cuda", "reference"]), default="cuda", show_default=True)
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--gen", type=click.IntRange(min=2), default=128, show_default=True, help="Tokens per run.")
@click.option("--runs", type=click.IntRange(min=1), default=5, show_default=True, help="Back-to-back timed runs.")
@click.option(
    "--ctx",
    type=click.IntRange(min=2),
    default=None,
    help=f"KV cache context (default: min(the model's max_position_embeddings, {DEFAULT_CTX})).",
)
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the JSON report to this file (e.g. docs/benchmarks/<name>.json).",
)
@click.option(
    "--kernels",
    is_flag=True,
    help="Also run the per-kernel benchmark (thorgen.runtime.bench.kernels) on the built kernels the cuda "
    "backend finds (--kernel-dir, or its default folder).",
)
@click.option(
    "--weights",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="cuda: repacked weights folder (default: the one `thorgen repack-weights` wrote for MODEL).",
)
@click.option(
    "--kernel-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="cuda: built kernels folder (default: $THORGEN_KERNELS or ./thorgen-build/<model>/<arch>).",
)
@click.option(
    "--roofline",
    is_flag=True,
    help="Add bytes, FLOPs and the achieved fraction of copy bandwidth and tensor-core peak per step "
    "(decode, prefill, and verify when the model has a drafter: also times speculative runs).",
)
@click.option(
    "--suite",
    "suite_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Run each prompt of this suite file instead (docs/prompt_suite.json; the JSON shape of "
    "seed_data/prompt_suite.json): TTFT, decode tok/s and tau, plain and speculative.",
)
@click.option("--ignore-eos", is_flag=True, help="--suite: generate each prompt's max_tokens, past stop ids.")
@click.option(
    "--peer",
    type=click.Choice(["hf"]),
    default=None,
    help="Also run HF transformers' Gemma4 on the same checkpoint, prompt and device (the `peer` extra) "
    "and print our decode tok/s and TTFT as ratios of its.",
)
@click.option(
    "--speculative",
    is_flag=True,
    help="Also time DFlash speculative decoding (draft -> verify -> commit): tok/s, tau, draft and "
    "verify step ms, and one draft and one verify forward per kernel (cuda).",
)
@click.option(
    "--emulate-acceptance",
    "accept",
    type=click.IntRange(0, 15),
    default=None,
    help="--speculative: every verify step commits exactly K drafts + 1 (speed at tau = K + 1 on random "
    "weights; the tokens are not the model's, and the report says so).",
)
@click.option(
    "--batch-sizes",
    default=None,
    help="cuda: also time batched decode steps of these row counts (e.g. 1,2,4,8,16,32), one sequence "
    "per KV lane at mid-generation: step ms, tok/s, bytes and GB/s per bucket, kernels of the largest.",
)
@click.option(
    "--image",
    "image",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Also time this image ahead of the text prompt: preprocessing, the vision tower alone, TTFT "
    "(encode + prefill) and decode tok/s after it.",
)
@click.option(
    "--image-max-tokens",
    "image_budget",
    metavar="BUDGETS",
    default=",".join(map(str, BENCH_BUDGETS)),
    show_default=True,
    help="--image: the soft-token budgets to time the image at, comma-separated (each of 70, 140, 280, 560, "
    "1120); the report keeps one entry per budget.",
)
@click.option(
    "--video",
    "video",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Also time this video's frames (70 soft tokens each) ahead of the text prompt: decode and frame "
    "sampling on the CPU, preprocessing, the vision tower over every frame, TTFT (encode + prefill) and decode "
    "tok/s after it.",
)
@click.option(
    "--video-frames",
    type=click.IntRange(min=1),
    default=None,
    help="--video: frames to sample, uniformly (default: up to 32).",
)
@click.option(
    "--sms",
    type=click.IntRange(min=1),
    default=None,
    help="Run on this many multiprocessors only (a CUDA green context; e.g. 20, Jetson AGX Thor's count): "
    "decode and the copy probe both, so fraction_of_copy is against the SM-limited copy rate.",
)
@engine_option_flags
@click.pass_context
def bench(
    click_ctx: click.Context,
    model: Path | None,
    backend: str,
    prompt_len: int,
    gen: int,
    runs: int,
    ctx: int | None,
    kv_dtype: str,
    as_json: bool,
    out_file: Path | None,
    kernels: bool,
    weights: Path | None,
    kernel_dir: Path | None,
    roofline: bool,
    suite_file: Path | None,
    ignore_eos: bool,
    batch_sizes: str | None,
    peer: str | None,
    speculative: bool,
    accept: int | None,
    image: Path | None,
    image_budget: str,
    video: Path | None,
    video_frames: int | None,
    sms: int | None,
    engine_options: EngineOptions,
) -> None:
    """Benchmark plain decoding: TTFT, decode tok/s (median of --runs), step time, weight GB/s against a copy
    probe measured in the same run, peak GPU memory and load time. `thorgen bench serve` load-tests a server."""
    if click_ctx.invoked_subcommand is not None:
        return
    if model is None:
        raise click.UsageError("--model DIR is required (or run `thorgen bench serve` against a server)")
    if suite_file is not None:
        if roofline or kernels or sms is not None:
            raise click.UsageError("--suite runs on its own: drop --roofline / --kernels / --sms")
        return _bench_suite(
            model, backend, suite_file, runs, ctx, kv_dtype, ignore_eos, as_json, out_file, weights, kernel_dir
        )
    if ctx is not None and prompt_len + gen > ctx:
        raise click.BadParameter(f"--prompt-len + --gen ({prompt_len + gen}) exceed --ctx {ctx}")
    try:
        budgets = parse_budgets(image_budget)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--image-max-tokens") from None
    command = (
        f"thorgen bench --model {model} --backend {backend} --prompt-len {prompt_len} --gen {gen} "
        f"--runs {runs}"
        + (f" --ctx {ctx}" if ctx else "")
        + f" --kv-dtype {kv_dtype}"
        + (f" --weights {weights}" if weights else "")
        + (f" --kernel-dir {kernel_dir}" if kernel_dir else "")
        + (" --roofline" if roofline else "")
        + (f" --batch-sizes {batch_sizes}" if batch_sizes else "")
        + (f" --peer {peer}" if peer else "")
        + (" --speculative" if speculative else "")
        + (f" --emulate-acceptance {accept}" if accept is not None else "")
        + (f" --image {image} --image-max-tokens {','.join(map(str, budgets))}" if image else "")
        + (f" --video {video}" if video else "")
        + (f" --video-frames {video_frames}" if video and video_frames else "")
        + (f" --sms {sms}" if sms is not None else "")
        + "".join(
            f" --{'' if on else 'no-'}{flag}"
            for name, flag, _, default in EngineOptions.flags()
            if (on := getattr(engine_options, name)) != default
        )
    )
    if kernels and sms is not None:
        raise click.UsageError("--kernels times each kernel on the whole GPU: drop --sms")
    if accept is not None and not speculative:
        raise click.UsageError("--emulate-acceptance goes with --speculative")
    try:
        sizes = [int(x) for x in batch_sizes.split(",")] if batch_sizes else None
    except ValueError:
        raise click.BadParameter(f"--batch-sizes {batch_sizes!r}: comma-separated integers") from None
    if sizes and not all(1 <= n <= 32 for n in sizes):
        raise click.BadParameter(f"--batch-sizes {batch_sizes}: each in 1..32 (the largest decode bucket)")
    try:
        report = run_bench(
            backend,
            model,
            prompt_len,
            gen,
            runs,
            ctx,
            kv_dtype,
            command,
            weights,
            kernel_dir,
            roofline,
            sizes,
            peer,
            speculative,
            accept,
            engine_options,
            image,
            budgets,
            sms,
            video=video,
            video_frames=video_frames,
        )
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(report, indent=1) + "\n")
    click.echo(json.dumps(report) if as_json else bench_text(report))
    if kernels:
        from .kernels import format_report, run_bench as run_kernel_bench

        try:
            click.echo(format_report(run_kernel_bench(kernel_dir=kernel_dir, model_dir=model)))
        except BackendError as exc:  # no GPU, no cuda-python, no build, or a build for another GPU
            raise click.ClickException(f"--kernels: {exc}") from exc
