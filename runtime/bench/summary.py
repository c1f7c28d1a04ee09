"""Runtime stage (benchmark report): the headline table at the top of docs/BENCHMARKS.md, one row per measure.

`<!-- report summary FILE.json ... -->` names the runs the headlines come from; each run's role follows from its
shape: a `thorgen bench --speculative --emulate-acceptance K` run gives batch-1 decode, the speculative rate and
the draft + verify step; a run with a prompt of 2,048 tokens or more gives TTFT and peak memory; a `thorgen bench
serve` run gives the aggregate throughput by concurrency; a `thorgen bench --peer hf` run gives the peer measured in
the same run. Every row points at its run, listed below the table with its machine, date, commit and command.
"""

from __future__ import annotations

from .tables import fmt, load_plots, ms, pct, provenance, table

ROLES = ("speculative", "ttft", "serve", "peer")


def role_of(run: dict) -> str | None:
    if "levels" in run:
        return "serve"
    if run.get("peer"):
        return "peer"
    if (run.get("speculative") or {}).get("emulated_acceptance") is not None:
        return "speculative"
    if "ttft_ms" in run and (run.get("prompt_len") or 0) >= 2048:
        return "ttft"
    return None


def _speculative_rows(run: dict, ref: str) -> list[list[str]]:
    s = run["speculative"]
    return [
        [
            "batch-1 decode",
            f"**{run['decode_tok_s']:.1f} tok/s** ({fmt(run.get('step_ms'), 3)} ms a step, "
            f"{pct(run.get('fraction_of_copy'))} of the copy bandwidth)",
            "",
            ref,
        ],
        [
            f"speculative decode (DFlash), **emulated** {s['emulated_acceptance']} drafts accepted a step",
            f"**{s['spec_tok_s']:,.1f} tok/s** (tau {s['tau']:.2f})",
            "",
            ref,
        ],
        [
            "draft + verify step",
            f"**{s['draft_step_ms'] + s['verify_step_ms']:.2f} ms** "
            f"({s['draft_step_ms']:.3f} + {s['verify_step_ms']:.3f})",
            "",
            ref,
        ],
    ]


def _ttft_rows(run: dict, ref: str) -> list[list[str]]:
    return [
        [f"TTFT, {run['prompt_len']:,}-token prompt", f"**{run['ttft_ms']:.1f} ms**", "", ref],
        [
            "peak GPU memory",
            f"**{run['peak_gpu_mem_gib']:.1f} GiB** (context {run.get('ctx'):,}, KV {run.get('kv_dtype')})",
            "",
            ref,
        ],
    ]


def _serve_rows(run: dict, ref: str) -> list[list[str]]:
    levels = sorted(run["levels"], key=lambda r: r["concurrency"])
    rates = ", ".join(f"{r['concurrency']}: {r['aggregate_tok_s']:,.0f}" for r in levels)
    top = next((r for r in levels if r["concurrency"] == 32), levels[-1])  # 32: the batch bucket's full width
    return [
        [f"aggregate tok/s through HTTP by concurrency ({run['prompt_len']} in, {run['gen']} out)", rates, "", ref],
        [
            f"TTFT p50 / p99 at concurrency {top['concurrency']}",
            f"{ms(top['ttft_ms_p50'])} / {ms(top['ttft_ms_p99'])} ms",
            "",
            ref,
        ],
    ]


def _peer_rows(run: dict, ref: str) -> list[list[str]]:
    p = run["peer"]
    ours = f"{run['decode_tok_s']:.1f} tok/s, TTFT {run['ttft_ms']:.1f} ms"
    theirs = (
        f"{p['decode_tok_s']:.1f} tok/s, TTFT {p['ttft_ms']:.1f} ms: {p['peer']} ({p['dtype']}, "
        f"{'torch.compile, ' if p.get('compiled') else ''}{p['cache']} cache), same GPU and prompt"
    )
    return [[f"batch-1 decode and TTFT ({run['prompt_len']}-token prompt) against a peer", ours, theirs, ref]]


ROWS = {"speculative": _speculative_rows, "ttft": _ttft_rows, "serve": _serve_rows, "peer": _peer_rows}


def summary(names: list[str], runs: dict, ctx) -> str:
    """The headline table, the runs it cites and their plots (the serve sweep, the decode step's kernels)."""
    by_role: dict[str, str] = {}
    for name in names:
        role = role_of(runs[name])
        if role is None or role in by_role:
            raise ValueError(f"{name} is not a run the summary has a row for, or a second run of its kind")
        by_role[role] = name
    refs = {name: f"[{i}]" for i, name in enumerate(names, 1)}
    rows = [row for role in ROLES if role in by_role for row in ROWS[role](runs[by_role[role]], refs[by_role[role]])]
    head = table(["measure", "thorgen", "peer measured in the same run", "run"], rows)
    cited = "\n".join(
        f"- {refs[n]} `docs/benchmarks/{n}`: {provenance(runs[n])}: `{runs[n].get('command')}`" for n in names
    )
    images = []
    if "serve" in by_role:
        images.append(ctx.plot(load_plots().plot_serve, by_role["serve"], "serve", runs[by_role["serve"]]))
    if "decode_step_kernels" in runs.get(by_role.get("speculative", ""), {}):
        run = runs[by_role["speculative"]]
        images.append(
            ctx.plot(
                load_plots().plot_kernels,
                by_role["speculative"],
                "decode-kernels",
                run,
                "decode_step_kernels",
                "decode step",
            )
        )
    return "\n\n".join([head, cited] + images)
