"""Runtime stage (benchmark report): the PNG plots of `thorgen bench report`, drawn with matplotlib's Agg backend.

Every figure carries the machine in its title and the run's date and command in a footer, so that a plot copied
out of the report still says where it came from. Inputs are the JSON runs as `bench_report` loaded them.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the report runs in CI and over ssh
import matplotlib.pyplot as plt  # after use(): the backend must be chosen before pyplot loads
from matplotlib.patches import Patch

DPI = 100  # the committed PNGs stay small (tens of KB)


def machine(run: dict) -> str:
    return str(run.get("gpu") or run.get("device") or "unknown machine")


def _ticks(ax, values: list[int]) -> None:
    """A log-2 axis labelled with the measured points themselves (128, 2K, 64K), not with powers of two."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values, [f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
    ax.minorticks_off()


def _finish(fig, run: dict, title: str, path: Path) -> Path:
    fig.suptitle(f"{title} — {machine(run)}", fontsize=10)
    footer = f"{str(run.get('date') or 'date not recorded')[:10]}  ·  {run.get('command') or 'command not recorded'}"
    fig.text(0.01, 0.01, "\n".join(textwrap.wrap(footer, 150)), fontsize=6, va="bottom", family="monospace")
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    # No "Software" stamp: the same JSON and matplotlib give the same bytes, so regenerating leaves git clean.
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return path


def plot_sweep(run: dict, path: Path) -> Path:
    """Decode and prefill tok/s against prompt length, one line per KV dtype."""
    fig, (dec, pre) = plt.subplots(1, 2, figsize=(9, 3.6))
    for kv in sorted({r["kv_dtype"] for r in run["rows"]}):
        rows = sorted((r for r in run["rows"] if r["kv_dtype"] == kv), key=lambda r: r["prompt_len"])
        lens = [r["prompt_len"] for r in rows]
        dec.plot(lens, [r["decode_tok_s"] for r in rows], marker="o", label=f"KV {kv}")
        pre.plot(lens, [r["prefill_tok_s"] for r in rows], marker="o", label=f"KV {kv}")
    for ax, what in ((dec, "decode tok/s after the prompt"), (pre, "prefill tok/s (prompt / TTFT)")):
        _ticks(ax, sorted({r["prompt_len"] for r in run["rows"]}))
        ax.set_xlabel("context length (prompt tokens)")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _finish(fig, run, "tok/s against context length", path)


def plot_kernels(run: dict, key: str, label: str, path: Path) -> Path:
    """Horizontal bars: GPU time per kernel in one step (all launches of that kernel summed)."""
    rows = sorted(run[key], key=lambda r: r["us"])
    fig, ax = plt.subplots(figsize=(9, 0.22 * len(rows) + 1.4))
    ax.barh([f"{r['kernel']} x{r['count']}" for r in rows], [r["us"] for r in rows], color="tab:blue")
    ax.set_xlabel(f"us per {label} (sum {sum(r['us'] for r in rows):.0f} us)")
    ax.tick_params(axis="y", labelsize=6)
    ax.grid(axis="x", alpha=0.3)
    return _finish(fig, run, f"time per kernel, one {label}", path)


def plot_roofline(run: dict, path: Path) -> Path:
    """Grouped bars: achieved fraction of copy bandwidth and of tensor-core throughput per step type."""
    steps = list(run["roofline"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.38
    for i, (key, name) in enumerate((("frac_copy", "of copy bandwidth"), ("frac_tc", "of tensor-core peak"))):
        xs = [j + (i - 0.5) * width for j in range(len(steps))]
        values = [100 * (run["roofline"][s].get(key) or 0.0) for s in steps]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(steps)), steps)
    ax.set_ylabel("% of the roofline measured in the same run")
    ax.set_ylim(0, 100)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _finish(fig, run, "fraction of roofline per step type", path)


def plot_serve(run: dict, path: Path) -> Path:
    """Throughput (aggregate and per request) and latency (TTFT, inter-token; p50 and p99) against concurrency."""
    levels = sorted(run["levels"], key=lambda r: r["concurrency"])
    cs = [r["concurrency"] for r in levels]
    fig, (tput, ttft, itl) = plt.subplots(1, 3, figsize=(11, 3.6))
    tput.plot(cs, [r["aggregate_tok_s"] for r in levels], marker="o", label="aggregate")
    tput.plot(cs, [r["request_decode_tok_s_median"] for r in levels], marker="o", label="per request (median)")
    if run.get("engine_tok_s"):
        tput.axhline(run["engine_tok_s"], ls="--", color="grey", label="engine alone (batch 1)")
    for ax, key, name in ((ttft, "ttft_ms", "TTFT ms"), (itl, "itl_ms", "inter-token latency ms")):
        for q in ("p50", "p99"):
            ax.plot(cs, [r[f"{key}_{q}"] for r in levels], marker="o", label=q)
        if key == "itl_ms" and all("without_images" in r for r in levels):  # `bench serve --image-arrivals`
            for q in ("p50", "p99"):
                alone = [r["without_images"][f"{key}_{q}"] for r in levels]
                ax.plot(cs, alone, marker="x", ls="--", label=f"{q} without images")
        ax.set_ylabel(name)
    tput.set_ylabel("tok/s")
    for ax in (tput, ttft, itl):
        _ticks(ax, cs)
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(0, 1.2 * ax.get_ylim()[1])  # room above the lines for the legend
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _finish(fig, run, "throughput and latency against concurrency", path)


SUITE_MODE_STYLE = {"plain": {"alpha": 1.0}, "speculative": {"alpha": 0.55, "hatch": "//"}}  # colour is category's


def _category(prompt: dict) -> str:
    return prompt.get("category") or "(none)"


def plot_suite(run: dict, path: Path) -> Path:
    """`thorgen bench --suite`: decode tok/s per prompt (plain solid, speculative hatched, coloured by category)
    and plain TTFT against prompt length, both axes log: the suite spans tens to tens of thousands of tokens."""
    ran = [p for p in run["prompts"] if "skipped" not in p]
    cats = list(dict.fromkeys(_category(p) for p in ran))
    ran.sort(key=lambda p: cats.index(_category(p)))  # stable: the suite's order within a category
    colour = {c: f"C{i % 10}" for i, c in enumerate(cats)}
    modes = [m for m in SUITE_MODE_STYLE if any(m in p for p in ran)]
    fig, (dec, ttft) = plt.subplots(
        1, 2, figsize=(min(15, 6 + 0.25 * len(ran)), 4.4), gridspec_kw={"width_ratios": (2, 1)}
    )
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(ran))]
        rates = [float("nan") if p[mode]["decode_tok_s"] is None else p[mode]["decode_tok_s"] for p in ran]
        dec.bar(
            xs, rates, width, color=[colour[_category(p)] for p in ran], edgecolor="white", **SUITE_MODE_STYLE[mode]
        )  # (a nan draws no bar: one generated token has no decode rate)
    dec.set_xticks(range(len(ran)), [p["id"] for p in ran], rotation=60, ha="right", fontsize=6)
    dec.set_ylabel("decode tok/s")
    dec.set_ylim(0, 1.15 * dec.get_ylim()[1])  # room above the bars for the legend
    dec.grid(axis="y", alpha=0.3)
    dec.legend(
        handles=[Patch(facecolor="grey", edgecolor="white", label=m, **SUITE_MODE_STYLE[m]) for m in modes],
        fontsize=7,
        ncols=len(modes),
        loc="upper left",
    )
    for cat in cats:
        group = [p for p in ran if _category(p) == cat]
        ttft.scatter(
            [p["prompt_tokens"] for p in group],
            [p["plain"]["ttft_ms"] for p in group],
            s=18,
            color=colour[cat],
            label=cat,
        )
    ttft.set_xscale("log")
    ttft.set_yscale("log")
    ttft.set_xlabel("prompt tokens")
    ttft.set_ylabel("TTFT ms (plain)")
    ttft.grid(alpha=0.3)
    ttft.legend(fontsize=6)
    return _finish(fig, run, "decode tok/s per prompt, TTFT against prompt length", path)
