"""Runtime stage (benchmark report): the views of `thorgen bench report`, each drawing runs' JSON as a markdown
table (and for some a PNG plot), looked up by the name a NOTES.md report line gives."""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .image_report import has_images, image_view, serve_image_columns, serve_image_note
from .summary import summary
from .soak_report import text as soak_text
from .tables import ReportError, fmt as _f, load_plots as _plots, ms as _ms, pct as _pct, run_line as _run_line
from .tables import table as _table


@dataclass
class Context:
    """Where the views' PNGs go, and the folder their image links are relative to; `written`: the PNGs drawn."""

    plots: Path  # folder of the PNGs
    doc_dir: Path  # folder of BENCHMARKS.md: image links are relative to it
    written: list[Path] = field(default_factory=list)

    def plot(self, draw: Callable[..., Path], name: str, view: str, *args) -> str:
        path = draw(*args, self.plots / f"{Path(name).stem}-{view}.png")
        self.written.append(path)
        rel = Path(os.path.relpath(path, self.doc_dir)).as_posix()
        return f"![{view} of {name}]({rel})"


# ---- views: (does it apply to a run, render names + runs -> markdown) ----------------------------------------


def _kernels(names: list[str], runs: dict, ctx: Context) -> str:
    run = runs[names[0]]
    verdict = {True: "ok", False: "**below**", None: ""}
    rows = [
        [
            f"`{k['kernel']}`",
            k.get("note", ""),
            _f(k["single_us"]),
            _f(k["stream_us"], 2),
            _f(k["bytes"], 2, 1e-6),
            _f(k["gbps"], 0),
            _pct(k["fraction_of_copy"]),
            verdict[k.get("meets_target")],
        ]
        for k in run["kernels"]
    ]
    head = (
        f"{_run_line(names[0], run)}; copy bandwidth {run['copy_gbps']:.0f} GB/s (device-to-device, read + "
        f"write), target {_pct(run.get('target_fraction'), 0)} of it for weight-streaming kernels."
    )
    return head + "\n\n" + _table(["kernel", "case", "single us", "stream us", "MB", "GB/s", "of copy", "target"], rows)


def _bench(names: list[str], runs: dict, ctx: Context) -> str:
    """One column per `thorgen bench` run."""

    def spread(run, key, digits):
        values = run.get(key + "_runs") or []
        med = _f(run.get(key), digits)
        return f"{med} ({_f(min(values), digits)}-{_f(max(values), digits)})" if len(values) > 1 else med

    def frac(r):
        if r.get("achieved_gb_s") is None:
            return ""
        return (
            f"{r['achieved_gb_s']:.0f} / {_f(r.get('copy_gb_s'), 0)} GB/s = {_pct(r.get('fraction_of_copy'))} "
            f"({r.get('copy_probe', 'copy probe')})"
        )

    metrics = [
        ("prompt / generated tokens, runs", lambda r: f"{r.get('prompt_len')} / {r.get('gen')}, {r.get('runs')}"),
        ("decode tok/s, median (range)", lambda r: spread(r, "decode_tok_s", 1)),
        ("decode step ms", lambda r: _f(r.get("step_ms"), 3)),
        ("TTFT ms, median (range)", lambda r: spread(r, "ttft_ms", 1)),
        (
            "weight GB per decode step",
            lambda r: f"{_f(r.get('weight_bytes_per_step'), 3, 1e-9)} ({r.get('lm_head', '?')} lm_head)",
        ),
        ("achieved / copy bandwidth", frac),
        (
            "peak GPU memory GiB",
            lambda r: (
                f"{_f(r.get('peak_gpu_mem_gib'), 2)} (ctx {r.get('ctx')}, KV {r.get('kv_dtype')})"
                if r.get("peak_gpu_mem_gib")
                else ""
            ),
        ),
        ("load s / ready s (incl. warm-up)", lambda r: f"{_f(r.get('load_s'), 2)} / {_f(r.get('ready_s'), 2)}"),
        ("host peak RSS GiB", lambda r: _f(r.get("host_peak_rss_gib"), 3)),
    ]
    for name in names:
        if "decode_tok_s" not in runs[name] or "ttft_ms" not in runs[name]:
            raise KeyError("decode_tok_s and ttft_ms")
    if any(runs[n].get("peer") for n in names):  # rows only where a run compared itself with a peer
        metrics += [(m, lambda r, fn=fn: fn(r["peer"]) if r.get("peer") else "") for m, fn in PEER_METRICS]
    if any(runs[n].get("speculative") for n in names):  # `thorgen bench --speculative [--emulate-acceptance K]`
        metrics += [
            (m, lambda r, fn=fn: fn(r["speculative"]) if r.get("speculative") else "") for m, fn in SPEC_METRICS
        ]
    table = _table(
        ["metric"] + [f"`{Path(n).stem}`" for n in names], [[m] + [fn(runs[n]) for n in names] for m, fn in metrics]
    )
    lines = [f"- {_run_line(n, runs[n])}" for n in names]
    lines += [
        f"- `{Path(n).stem}` peer experts tried (tok/s of a short uncompiled decode, prefill included: a "
        f"ranking only): {_experts_tried(runs[n]['peer']['experts_tried'])}"
        for n in names
        if (runs[n].get("peer") or {}).get("experts_tried")
    ]
    return table + "\n\n" + "\n".join(lines)


def _peer_config(p: dict) -> str:
    bits = [p["dtype"], p["device"], f"{p['cache']} cache"] + (["torch.compile"] if p["compiled"] else [])
    # runs before the experts were chosen by measurement did not record them
    bits += [f"experts {p['experts']}"] if p.get("experts") else []
    return f"{p['peer']} ({', '.join(bits)})"


def _peer_ratios(p: dict) -> str:
    """bench.py leaves a ratio None where the measure it divides by was zero."""
    parts = [f"{p['decode_ratio']:.1f}x its decode tok/s"] if p.get("decode_ratio") is not None else []
    parts += [f"its TTFT {p['ttft_ratio']:.1f}x ours"] if p.get("ttft_ratio") is not None else []
    return "ours: " + "; ".join(parts) if parts else ""


def _experts_tried(tried: dict) -> str:
    # an "unavailable: ..." reason is an exception message: it may span lines, which would break the list item
    return "; ".join(
        f"{name} {_f(v, 2) if isinstance(v, (int, float)) else ' '.join(str(v).split())}" for name, v in tried.items()
    )


PEER_METRICS = [  # the `peer` object of a `thorgen bench --peer hf` run
    ("peer", _peer_config),
    ("peer decode tok/s / TTFT ms", lambda p: f"{_f(p['decode_tok_s'])} / {_f(p['ttft_ms'])}"),
    ("peer load s", lambda p: _f(p.get("load_s"))),
    ("ours vs peer", _peer_ratios),
]


SPEC_METRICS = [  # the `speculative` object of a `thorgen bench --speculative` run
    (
        "speculative tok/s, tau",
        lambda s: (
            f"{_f(s['spec_tok_s'])}, {_f(s['tau'], 2)}"
            + (
                f" (**emulated**: {s['emulated_acceptance']} drafts accepted a step)"
                if s.get("emulated_acceptance") is not None
                else ""
            )
        ),
    ),
    (
        "speculative step ms (draft + verify on the GPU)",
        lambda s: f"{_f(s['step_ms'], 3)} ({_f(s.get('draft_step_ms'), 3)} + {_f(s.get('verify_step_ms'), 3)})",
    ),
]


def _step_kernels(key: str, label: str, view: str):
    def render(names: list[str], runs: dict, ctx: Context) -> str:
        run = runs[names[0]]
        rows = run[key]
        total = sum(r["us"] for r in rows)
        table = _table(
            ["kernel", "launches", f"us / {label}", "us / launch", "share"],
            [
                [f"`{r['kernel']}`", str(r["count"]), _f(r["us"]), _f(r["us"] / r["count"], 2), _pct(r["us"] / total)]
                for r in rows
            ],
        )
        tail = f"Sum of the kernels: {total:.0f} us"
        if key == "decode_step_kernels" and run.get("step_ms"):
            tail += f"; the measured decode step: {1e3 * run['step_ms']:.0f} us"
        if key == "prefill_chunk_kernels" and run.get("prefill_chunk_rows"):
            tail += f" for a chunk of {run['prefill_chunk_rows']} tokens"
        image = ctx.plot(_plots().plot_kernels, names[0], view, run, key, label)
        return f"{_run_line(names[0], run)}\n\n{table}\n\n{tail}.\n\n{image}"

    return render


def _sweep(names: list[str], runs: dict, ctx: Context) -> str:
    run = runs[names[0]]
    rows = [
        [r["kv_dtype"], str(r["prompt_len"]), _f(r["ttft_ms"]), _f(r["prefill_tok_s"], 0), _f(r["decode_tok_s"])]
        for r in run["rows"]
    ]
    table = _table(["KV", "prompt tokens", "TTFT ms", "prefill tok/s", "decode tok/s after it"], rows)
    return f"{_run_line(names[0], run)}\n\n{table}\n\n{ctx.plot(_plots().plot_sweep, names[0], 'sweep', run)}"


def _serve(names: list[str], runs: dict, ctx: Context) -> str:
    run = runs[names[0]]
    engine = run.get("engine_tok_s")
    image_head, image_cells = serve_image_columns(run["levels"])
    rows = []
    for r, more in zip(run["levels"], image_cells):
        per = _f(r["request_decode_tok_s_median"])
        if engine and r["request_decode_tok_s_median"]:
            per += f" ({_pct(r['request_decode_tok_s_median'] / engine)} of the engine's {engine:.1f})"
        rows.append(
            [
                str(r["concurrency"]),
                str(r["requests"]),
                _f(r["aggregate_tok_s"]),
                per,
                f"{_ms(r['ttft_ms_p50'])} / {_ms(r['ttft_ms_p99'])} ms",
                f"{_f(r['itl_ms_p50'], 2)} / {_f(r['itl_ms_p99'], 2)} ms",
                *more,
            ]
        )
    table = _table(
        [
            "concurrency",
            "requests",
            "aggregate tok/s",
            "per-request decode tok/s (median)",
            "TTFT p50 / p99",
            "inter-token p50 / p99",
            *image_head,
        ],
        rows,
    )
    extra = [
        f"- {label}: `{run[k]}`"
        for k, label in (("server_command", "server"), ("engine_command", "engine"))
        if run.get(k)
    ]
    extra += [f"- note: {run['note']}"] if run.get("note") else []
    extra += [f"- {note}"] if (note := serve_image_note(run)) else []
    body = "\n\n".join(x for x in (_run_line(names[0], run), table, "\n".join(extra)) if x)
    return body + "\n\n" + ctx.plot(_plots().plot_serve, names[0], "serve", run)


def _roofline(names: list[str], runs: dict, ctx: Context) -> str:
    """`roofline`: {step: {bytes, flops, ms, copy_gbs, frac_copy, frac_tc}}; the fractions were measured in the
    same run (copy probe, tensor-core peak), so they are read, not recomputed."""
    run = runs[names[0]]
    rows = []
    for step, r in run["roofline"].items():
        seconds = r["ms"] * 1e-3
        rows.append(
            [
                step,
                _f(r["bytes"], 3, 1e-9),
                _f(r["flops"], 1, 1e-9),
                _f(r["ms"], 3),
                _f(r["bytes"] / seconds, 0, 1e-9),
                _f(r.get("copy_gbs"), 0),
                _pct(r.get("frac_copy")),
                _f(r["flops"] / seconds, 1, 1e-12),
                _pct(r.get("frac_tc")),
            ]
        )
    table = _table(
        ["step", "GB", "GFLOP", "ms", "GB/s", "copy GB/s", "of copy", "TFLOP/s", "of tensor-core peak"], rows
    )
    return f"{_run_line(names[0], run)}\n\n{table}\n\n{ctx.plot(_plots().plot_roofline, names[0], 'roofline', run)}"


def _batched(names: list[str], runs: dict, ctx: Context) -> str:
    """`thorgen bench --batch-sizes`: one row per batch size, with the step's bytes and achieved bandwidth."""
    out = []
    for n in names:
        r = runs[n]
        lines = [
            _run_line(n, r),
            "",
            f"Each row a sequence at position {r['batched_decode_position']}.",
            "",
            "| rows | bucket | step ms | tok/s | MB per step | GB/s | of copy | with the taps, ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [
            f"| {b['rows']} | {b['bucket']} | {b['step_ms']} | {b['tok_s']:,} | {b['bytes'] / 1e6:,.0f} | "
            f"{b['gb_s']:,} | {100 * b['frac_copy']:.1f} % | {b.get('taps_step_ms', '-')} |"
            for b in r["batched_decode"]
        ]
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _cases(names: list[str], runs: dict, ctx: Context) -> str:
    """A run of named cases ({case: {measure: value}}) as one table."""
    out = []
    for n in names:
        cases = runs[n]["cases"]
        cols = sorted({k for v in cases.values() for k in v})
        rows = [f"| {c} | " + " | ".join(str(v.get(k, "")) for k in cols) + " |" for c, v in cases.items()]
        out.append(
            "\n".join(
                [_run_line(n, runs[n]), "", "| case | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)] + rows
            )
        )
    return "\n\n".join(out)


def _soak(names: list[str], runs: dict, ctx: Context) -> str:
    """`thorgen bench soak`: its own summary (counts per kind, the windows, memory, failures) as printed."""
    return "\n\n".join(f"{_run_line(n, runs[n])}\n\n```\n{soak_text(runs[n])}\n```" for n in names)


def _chain(names: list[str], runs: dict, ctx: Context) -> str:
    """`thorgen bench kernels --chain N`: its table as printed."""
    from .kernel_chain import format_chain  # (the runtime's cuda modules: only where such a run is drawn)

    return "\n\n".join(f"{_run_line(n, runs[n])}\n\n```\n{format_chain(runs[n])}\n```" for n in names)


# `thorgen bench --suite` measures per prompt and mode: (column, mode, key, format); speculative ones only where
# the model has a drafter
SUITE_MEASURES = [
    ("plain TTFT ms", "plain", "ttft_ms", _ms),
    ("plain decode tok/s", "plain", "decode_tok_s", _f),
    ("speculative decode tok/s", "speculative", "decode_tok_s", _f),
    ("tau", "speculative", "tau", lambda v: _f(v, 2)),
]
SAME_TOKENS = {True: "yes", False: "**no**", None: ""}  # greedy speculation must not change the output


def _median(values) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _suite_prompt_row(p: dict, measures: list[tuple], spec: bool) -> list[str]:
    # a prompt that could not be rendered was skipped before it had a length
    head = [f"`{p['id']}`", p.get("category") or "", str(p.get("prompt_tokens", ""))]
    if "skipped" in p:  # the reason goes in the first measure's cell, escaped: a "|" would end the cell
        reason = "skipped: " + str(p["skipped"]).replace("|", "\\|")
        return head + ["", reason] + [""] * (len(measures) + spec - 1)
    cells = [fmt(p[mode][key]) for _, mode, key, fmt in measures]
    return head + [str(p["plain"]["tokens"])] + cells + ([SAME_TOKENS[p.get("same_tokens")]] if spec else [])


def _suite_category_rows(prompts: list[dict], measures: list[tuple], spec: bool) -> list[list[str]]:
    """Per category, in the suite's order: the median of each measure over the prompts of it that ran."""
    rows = []
    for cat in dict.fromkeys(p.get("category") for p in prompts):
        group = [p for p in prompts if p.get("category") == cat]
        ran = [p for p in group if "skipped" not in p]
        row = [cat or "(none)", f"{len(ran)} / {len(group)}", _f(_median(p["prompt_tokens"] for p in ran), 0)]
        row += [fmt(_median(p[mode][key] for p in ran)) for _, mode, key, fmt in measures]
        same = f"{sum(p.get('same_tokens') is True for p in ran)} / {len(ran)}" if ran else ""
        rows.append(row + ([same] if spec else []))
    return rows


def _suite_summary(run: dict) -> str:
    s = run["summary"]
    plain, spec = s["plain_decode_tok_s_median"], s.get("speculative_decode_tok_s_median")
    text = f"Medians over the {s['ran']} of {s['prompts']} prompts that ran: plain decode {_f(plain)} tok/s"
    if spec is not None:
        text += f", speculative decode {_f(spec)} tok/s at tau {_f(s.get('speculative_tau_median'), 2)}"
        text += f" ({spec / plain:.2f}x plain)" if plain else ""
    return text + "."


def _suite(names: list[str], runs: dict, ctx: Context) -> str:
    """`thorgen bench --suite`: a row per prompt, the medians per category and overall, and a plot."""
    run = runs[names[0]]
    prompts = run["prompts"]
    spec = any("speculative" in p for p in prompts)  # a model without a drafter has plain rows only
    measures = [m for m in SUITE_MEASURES if spec or m[1] == "plain"]
    setup = (
        f"Suite `{run['suite_file']}`, model `{run['model']}` ({run['backend']} backend), ctx {run['ctx']}, "
        f"KV {run['kv_dtype']}, the median of {run['runs']} runs per prompt and mode"
        + (", EOS ignored (every prompt decodes its max tokens)" if run.get("ignore_eos") else "")
        + ("" if spec else "; no drafter, so plain decoding only")
        + "."
    )
    same = ["same tokens"] if spec else []
    per_prompt = _table(
        ["prompt", "category", "prompt tokens", "new tokens"] + [m[0] for m in measures] + same,
        [_suite_prompt_row(p, measures, spec) for p in prompts],
    )
    per_category = _table(
        ["category", "ran", "prompt tokens"] + [m[0] for m in measures] + same,
        _suite_category_rows(prompts, measures, spec),
    )
    image = ctx.plot(_plots().plot_suite, names[0], "suite", run)
    return "\n\n".join(
        [
            _run_line(names[0], run),
            setup,
            per_prompt,
            "Per category (medians):",
            per_category,
            _suite_summary(run),
            image,
        ]
    )


VIEWS: dict[str, tuple[Callable[[dict], bool], Callable[[list[str], dict, Context], str]]] = {
    "summary": (lambda r: False, summary),  # only where NOTES.md asks for it: a run alone is no summary
    "kernels": (lambda r: "kernels" in r, _kernels),
    "bench": (lambda r: "decode_tok_s" in r and "ttft_ms" in r, _bench),
    "roofline": (lambda r: "roofline" in r, _roofline),
    "image": (has_images, image_view),
    "decode-kernels": (
        lambda r: "decode_step_kernels" in r,
        _step_kernels("decode_step_kernels", "decode step", "decode-kernels"),
    ),
    "draft-kernels": (
        lambda r: "draft_step_kernels" in r,
        _step_kernels("draft_step_kernels", "draft step", "draft-kernels"),
    ),
    "verify-kernels": (
        lambda r: "verify_step_kernels" in r,
        _step_kernels("verify_step_kernels", "verify step", "verify-kernels"),
    ),
    "prefill-kernels": (
        lambda r: "prefill_chunk_kernels" in r,
        _step_kernels("prefill_chunk_kernels", "prefill chunk", "prefill-kernels"),
    ),
    "sweep": (lambda r: isinstance(r.get("rows"), list) and all("kv_dtype" in x for x in r["rows"]), _sweep),
    "serve": (lambda r: "levels" in r, _serve),
    "cases": (lambda r: isinstance(r.get("cases"), dict), _cases),
    "soak": (lambda r: "kinds" in r and "windows" in r, _soak),
    "chain": (lambda r: isinstance(r.get("chain"), dict), _chain),
    "batched": (lambda r: "batched_decode" in r, _batched),
    "suite": (lambda r: isinstance(r.get("prompts"), list), _suite),
    "batched-kernels": (
        lambda r: "batched_step_kernels" in r,
        _step_kernels("batched_step_kernels", "batched decode step", "batched-kernels"),
    ),
}


def render_view(view: str, names: list[str], runs: dict, ctx: Context, where: str) -> str:
    if view not in VIEWS:
        raise ReportError(f"{where}: unknown view {view!r} (views: {', '.join(VIEWS)})")
    missing = [n for n in names if n not in runs]
    if missing:
        raise ReportError(f"{where}: no such run {', '.join(missing)} in the benchmarks folder")
    try:
        return VIEWS[view][1](names, runs, ctx)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ReportError(f"{', '.join(names)}: cannot draw the {view} view ({what})") from None
