"""Serve stage: `thorgen bench serve`, a closed-loop load generator against a running OpenAI-compatible server.

Each concurrency level runs C clients that each send requests back to back (streamed /v1/completions with a
token-id prompt of --prompt-len ids, shuffled per request so that no prefix cache helps, --gen tokens), and
reports TTFT and inter-token latency percentiles, per-request decode tok/s and aggregate tok/s (completion
tokens of the level / its wall time). Inter-token
latency is the gap between streamed chunks that carry text, divided by the tokens between them as counted by
the final usage (a chunk may carry several tokens, and a token may carry no text).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import math
import random
import statistics
import time
from pathlib import Path

import click


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def _one(http, url: str, body: dict, headers: dict, endpoint: str = "/v1/completions") -> dict:
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with http.stream("POST", url + endpoint, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise click.ClickException(f"the server answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise click.ClickException(f"the server reported an error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            if any(
                c.get("text")
                or (c.get("delta") or {}).get("content")
                or (c.get("delta") or {}).get("reasoning_content")
                for c in event.get("choices", [])
            ):
                arrivals.append(time.perf_counter())
    tokens = (usage or {}).get("completion_tokens", len(arrivals))
    return {"sent": sent, "arrivals": arrivals, "tokens": tokens, "prompt_tokens": (usage or {}).get("prompt_tokens")}


_served = 0  # requests sent so far by this process


def unique_prompt(prompt: list[int], i: int) -> list[int]:
    """`prompt` with all but its first token shuffled by a seed unique to this request (the same tokens, the same
    length), so that no two requests share a prefix beyond that first token: TTFT then measures a full prefill,
    never a prefix-cache hit."""
    global _served
    _served += 1
    rest = list(prompt[1:])
    random.Random(_served * 100003 + i).shuffle(rest)
    return prompt[:1] + rest


async def run_level(
    url: str, concurrency: int, requests: int, prompt: list[int], gen: int, api_key: str | None, timeout: float
) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[dict] = []
    todo = list(range(requests))

    async def client(http) -> None:
        while todo:  # (no `model`: the server answers under its own name; it refuses one it does not serve)
            body = {
                "prompt": unique_prompt(prompt, todo.pop()),
                "max_tokens": gen,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            results.append(await _one(http, url, body, headers))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = [t for _, t in sorted((r["sent"], r["arrivals"][0] - r["sent"]) for r in results if r["arrivals"])]
    itl, rates = [], []
    for r in results:
        a = r["arrivals"]
        if len(a) > 1 and r["tokens"] > 1:
            per_token = (r["tokens"] - 1) / (len(a) - 1)  # tokens per text-carrying chunk after the first
            itl += [(b - x) / per_token for x, b in zip(a, a[1:])]
            rates.append((r["tokens"] - 1) / (a[-1] - a[0]))
    total = sum(r["tokens"] for r in results)

    def ms(v: float | None) -> float | None:
        return None if v is None else round(v * 1e3, 3)

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completion_tokens": total,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "ttft_ms_by_send": [round(t * 1e3, 1) for t in ttft],  # in send order: the waves' shape
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "request_decode_tok_s_median": round(statistics.median(rates), 2) if rates else None,
    }


async def run_suite(
    url: str, entries: list[dict], api_key: str | None, timeout: float, filler_repeats: int | None
) -> list[dict]:
    """Each suite prompt alone (chat, streamed, greedy, the entry's max_tokens): TTFT and decode tok/s."""
    import httpx

    from ..text.prompts import build_messages

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rows = []
    async with httpx.AsyncClient(timeout=timeout) as http:
        for entry in entries:
            body = {
                "messages": build_messages(entry, filler_repeats),
                "temperature": 0,
                "max_tokens": int(entry.get("max_tokens", 128)),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if entry.get("tools"):
                body["tools"] = entry["tools"]
            try:
                r = await _one(http, url, body, headers, "/v1/chat/completions")
            except click.ClickException as exc:  # e.g. a needle prompt over the server's context: keep going
                rows.append({"id": entry["id"], "category": entry.get("category"), "error": exc.message})
                continue
            a = r["arrivals"]
            rows.append(
                {
                    "id": entry["id"],
                    "category": entry.get("category"),
                    "prompt_tokens": r["prompt_tokens"],
                    "completion_tokens": r["tokens"],
                    "ttft_ms": round((a[0] - r["sent"]) * 1e3, 3) if a else None,
                    "decode_tok_s": round((r["tokens"] - 1) / (a[-1] - a[0]), 2)
                    if len(a) > 1 and r["tokens"] > 1 and a[-1] > a[0]
                    else None,
                }
            )
    return rows


def _engine_steps(url: str) -> dict | None:
    """The engine thread's step counters from /health (a thorgen server's; None from another server)."""
    import httpx

    try:
        steps = httpx.get(url + "/health", timeout=10).json().get("steps")
    except (httpx.HTTPError, ValueError):
        return None
    return steps if isinstance(steps, dict) else None


def _step_means(before: dict | None, after: dict | None) -> dict | None:
    """Per-step means over a level: steps, mean sequences running, and ms per phase (runtime/client.py)."""
    if not before or not after or after["steps"] <= before["steps"]:
        return None
    n = after["steps"] - before["steps"]
    out = {"steps": n, "mean_running": round((after["running"] - before["running"]) / n, 2)}
    for phase in ("prepare", "flush", "finish"):
        out[f"{phase}_ms"] = round(1e3 * (after[phase] - before[phase]) / n, 3)
    return out


def bench_prompt(url: str, prompt_len: int, api_key: str | None) -> list[int]:
    """`prompt_len` token ids of plain text, tokenized by the server itself (so any tokenizer works)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = "The quick brown fox jumps over the lazy dog while the engine streams tokens. "
    ids: list[int] = []
    while len(ids) < prompt_len:
        text *= 2
        r = httpx.post(url + "/tokenize", json={"prompt": text}, headers=headers, timeout=60)
        if r.status_code != 200:
            raise click.ClickException(f"/tokenize answered {r.status_code}: {r.text[:300]}")
        ids = r.json()["tokens"]
    return ids[:prompt_len]


@click.command("serve")
@click.option("--url", default="http://127.0.0.1:8080", show_default=True, help="The running server.")
@click.option(
    "--concurrency", default="1,2,4,8,16,32,64", show_default=True, help="Comma-separated concurrency levels."
)
@click.option("--prompt-len", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--gen", type=click.IntRange(min=2), default=256, show_default=True, help="max_tokens per request.")
@click.option(
    "--requests",
    "per_client",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Requests per client at each level (level total = concurrency x this).",
)
@click.option("--timeout", type=click.FloatRange(min=1), default=600.0, show_default=True)
@click.option("--api-key", default=None, envvar="THORGEN_API_KEY")
@click.option(
    "--engine-tok-s",
    type=float,
    default=None,
    help="The engine's own batch-1 decode tok/s (thorgen bench), reported beside the server's.",
)
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here (e.g. docs/benchmarks/<name>.json).",
)
@click.option(
    "--suite",
    "suite_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Also run each prompt of this suite alone (the JSON shape of seed_data/prompt_suite.json).",
)
@click.option(
    "--filler-repeats",
    type=click.IntRange(min=1),
    default=None,
    help="Filler lines of the suite's needle prompts (default: the suite's own; smaller for short --ctx).",
)
def bench_serve(
    url: str,
    concurrency: str,
    prompt_len: int,
    gen: int,
    per_client: int,
    timeout: float,
    api_key: str | None,
    engine_tok_s: float | None,
    out_file: Path | None,
    suite_file: Path | None,
    filler_repeats: int | None,
) -> None:
    """Load-test a running `thorgen serve` (or any OpenAI-compatible server with /tokenize)."""
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"{concurrency!r} is not a comma-separated list of integers") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("give concurrency levels >= 1", param_hint="--concurrency")
    import httpx

    url = url.rstrip("/")
    try:
        health = httpx.get(url + "/health", timeout=10)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"no server at {url}: {exc}") from None
    if health.status_code != 200:
        raise click.ClickException(f"{url}/health answered {health.status_code}: {health.text[:200]}")
    from ..text.prompts import load_suite

    try:
        suite = load_suite(suite_file) if suite_file is not None else None
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    prompt = bench_prompt(url, prompt_len, api_key)
    asyncio.run(run_level(url, 1, 1, prompt, min(gen, 8), api_key, timeout))  # warm-up
    rows = []
    for c in levels:
        before = _engine_steps(url)
        row = asyncio.run(run_level(url, c, c * per_client, prompt, gen, api_key, timeout))
        steps = _step_means(before, _engine_steps(url))
        if steps:
            row["engine_steps"] = steps
        rows.append(row)
        click.echo(
            f"c={c:<3} {row['aggregate_tok_s']:>9.1f} tok/s  TTFT p50 {row['ttft_ms_p50']} ms "
            f"p99 {row['ttft_ms_p99']} ms  ITL p50 {row['itl_ms_p50']} ms p99 {row['itl_ms_p99']} ms  "
            f"per-request {row['request_decode_tok_s_median']} tok/s"
            + (
                f"  engine: {steps['steps']} steps, {steps['mean_running']} running, prepare "
                f"{steps['prepare_ms']} / flush {steps['flush_ms']} / finish {steps['finish_ms']} ms a step"
                if steps
                else ""
            )
        )
    report = {
        "url": url,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": (httpx.get(url + "/v1/models", timeout=10).json().get("data") or [{}])[0].get("id"),
        "prompt_len": prompt_len,
        "gen": gen,
        "requests_per_client": per_client,
        "levels": rows,
        "command": f"thorgen bench serve --url {url} --concurrency {concurrency} --prompt-len {prompt_len} "
        f"--gen {gen} --requests {per_client}",
    }
    if suite is not None:
        report["suite_file"] = str(suite_file)
        report["suite"] = asyncio.run(run_suite(url, suite, api_key, timeout, filler_repeats))
        for row in report["suite"]:
            head = f"{row['id']:<16} {row['category'] or '':<16}"
            click.echo(
                f"{head} error: {row['error']}"
                if "error" in row
                else f"{head} prompt {row['prompt_tokens']:>6}  out {row['completion_tokens']:>4}  "
                f"TTFT {row['ttft_ms']} ms  decode {row['decode_tok_s']} tok/s"
            )
    if engine_tok_s:
        one = next((r for r in rows if r["concurrency"] == 1), None)
        if one and one["request_decode_tok_s_median"]:
            report["engine_tok_s"] = engine_tok_s
            report["server_over_engine"] = round(one["request_decode_tok_s_median"] / engine_tok_s, 4)
            click.echo(
                f"batch 1 through HTTP: {one['request_decode_tok_s_median']} tok/s = "
                f"{100 * report['server_over_engine']:.1f}% of the engine's {engine_tok_s} tok/s"
            )
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(report, indent=1) + "\n")
