"""Runtime stage: `thorgen bench sweep`, decode and prefill speed against context length and KV dtype.

For each KV dtype the backend is opened once with a context that fits the longest prompt; each prompt length
then gets a warm-up and `--runs` timed greedy generations: TTFT (prefill of the whole prompt plus the first
token), prefill tok/s (prompt tokens / TTFT) and decode tok/s after that prompt (attention reads more context).
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
from pathlib import Path

import click

from ..backend import BackendError
from .timing import open_for_bench, synthetic_prompt, timed_run


def run_sweep(
    backend_name: str,
    model: Path,
    lengths: list[int],
    kv_dtypes: list[str],
    gen: int,
    runs: int,
    weights: Path | None = None,
    kernel_dir: Path | None = None,
) -> dict:
    rows, gpu = [], None
    for kv in kv_dtypes:
        backend, facts = open_for_bench(backend_name, model, max(lengths) + gen, kv, weights, kernel_dir)
        gpu = facts["gpu"]
        try:
            for n in lengths:
                prompt = synthetic_prompt(backend.spec, n)
                timed_run(backend, prompt, 2)  # warm-up: graphs, ragged prefill chunks of this length
                ttfts, rates = [], []
                for _ in range(runs):
                    ttft, dec, k = timed_run(backend, prompt, gen)
                    ttfts.append(ttft)
                    if k > 1 and dec > 0:
                        rates.append((k - 1) / dec)
                ttft = statistics.median(ttfts)
                rows.append(
                    {
                        "kv_dtype": kv,
                        "prompt_len": n,
                        "ttft_ms": round(ttft * 1e3, 3),
                        "prefill_tok_s": round(n / ttft, 1),
                        "decode_tok_s": round(statistics.median(rates), 2) if rates else None,
                        "ttft_ms_runs": [round(t * 1e3, 3) for t in ttfts],
                    }
                )
        finally:
            backend.close()  # frees the device before the next KV dtype's cache
    return {
        "gpu": gpu,
        "backend": backend_name,
        "model": str(model),
        "gen": gen,
        "runs": runs,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of integers", param_hint=what) from None
    if not values or min(values) < 1:
        raise click.BadParameter("give lengths >= 1", param_hint=what)
    return values


@click.command("sweep")
@click.option("--model", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--backend", type=click.Choice(["cuda", "reference"]), default="cuda", show_default=True)
@click.option("--prompt-lens", default="128,2048,16384,65536", show_default=True, help="Comma-separated lengths.")
@click.option("--kv-dtypes", default="bf16,fp8", show_default=True, help="Comma-separated: bf16, fp8.")
@click.option("--gen", type=click.IntRange(min=2), default=64, show_default=True, help="Tokens per run.")
@click.option("--runs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--weights", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--kernel-dir", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here (e.g. docs/benchmarks/<name>.json).",
)
def sweep(
    model: Path,
    backend: str,
    prompt_lens: str,
    kv_dtypes: str,
    gen: int,
    runs: int,
    weights: Path | None,
    kernel_dir: Path | None,
    out_file: Path | None,
) -> None:
    """TTFT, prefill tok/s and decode tok/s for each prompt length and KV dtype."""
    lengths = _ints(prompt_lens, "--prompt-lens")
    kvs = [k.strip() for k in kv_dtypes.split(",") if k.strip()]
    bad = [k for k in kvs if k not in ("bf16", "fp8")]
    if bad or not kvs:
        raise click.BadParameter(f"{kv_dtypes!r}: choose from bf16, fp8", param_hint="--kv-dtypes")
    try:
        report = run_sweep(backend, model, lengths, kvs, gen, runs, weights, kernel_dir)
    except BackendError as exc:
        raise click.ClickException(str(exc)) from exc
    report["command"] = (
        f"thorgen bench sweep --model {model} --backend {backend} --prompt-lens {prompt_lens} "
        f"--kv-dtypes {kv_dtypes} --gen {gen} --runs {runs}"
    )
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(report, indent=1) + "\n")
    click.echo(f"{report['backend']} on {report['gpu']}: {model}, {gen} tokens x{runs}")
    for r in report["rows"]:
        click.echo(
            f"  {r['kv_dtype']:<5} prompt {r['prompt_len']:>6}  TTFT {r['ttft_ms']:>9.1f} ms  "
            f"prefill {r['prefill_tok_s']:>9.1f} tok/s  decode {r['decode_tok_s']} tok/s"
        )
