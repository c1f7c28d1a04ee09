"""Serve stage: the `thorgen bench serve` command: its options, the concurrency levels run in turn against the
server (runtime/bench/serve_load.py generates the load; runtime/bench/serve_images.py the image requests), each
level's line, and the JSON report."""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
from functools import partial
from pathlib import Path

import click

from .serve_images import ImageRequests, send_beside
from .serve_tools import tool_chats
from .serve_load import (
    engine_steps,
    server_means,
    server_times,
    step_means,
    bench_prompt,
    chat_text,
    image_chats,
    run_level,
    run_suite,
    streamed,
    text_requests,
)


def _level_line(row: dict) -> str:
    steps = row.get("engine_steps")
    line = (
        f"c={row['concurrency']:<3} {row['aggregate_tok_s']:>9.1f} tok/s  TTFT p50 {row['ttft_ms_p50']} ms "
        f"p99 {row['ttft_ms_p99']} ms  ITL p50 {row['itl_ms_p50']} ms p99 {row['itl_ms_p99']} ms  "
        f"per-request {row['request_decode_tok_s_median']} tok/s"
    )
    if "image_requests" in row:
        alone = row["without_images"]
        line += (
            f"  | {row['image_requests']} image arrivals, their TTFT p50 {row['image_ttft_ms_p50']} ms p99 "
            f"{row['image_ttft_ms_p99']} ms; without them ITL p50 {alone['itl_ms_p50']} ms p99 {alone['itl_ms_p99']} ms"
        )
    server = row.get("server")
    if server:
        line += f"  server: to the engine {server['to_engine_ms']} ms, then first token {server['ttft_ms']} ms"
    if steps:
        line += (
            f"  engine: {steps['steps']} steps, {steps['mean_running']} running, prepare "
            f"{steps['prepare_ms']} / flush {steps['flush_ms']} / finish {steps['finish_ms']} ms a step"
        )
        if steps.get("speculative_steps"):
            line += (
                f"; speculative: {steps['speculative_steps']} verify steps, {steps['accepted_tokens']} of "
                f"{steps['draft_tokens']} drafts accepted ({steps['acceptance_rate']})"
            )
            if steps.get("emulated_acceptance") is not None:
                line += f" EMULATED: each verify step committed {steps['emulated_acceptance']} drafts + 1"
    return line


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
@click.option(
    "--image",
    "image_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Send chats of this image then about --prompt-len tokens of text instead (a data URL; each request its "
    "own variant of the image unless --same-image): TTFT p50 / p99 of image requests through HTTP.",
)
@click.option(
    "--image-max-tokens",
    "image_budget",
    type=click.Choice(["70", "140", "280", "560", "1120"]),
    default=None,
    help="--image: the soft-token budget the requests ask for (mm_processor_kwargs; default: the server's).",
)
@click.option(
    "--same-image",
    is_flag=True,
    help="--image: every request sends the file's own bytes (after the first, the server's image caches answer: "
    "the cache-hit path).",
)
@click.option(
    "--image-arrivals",
    is_flag=True,
    help="--image: the clients send the text requests, and each level runs twice, alone and then with one more "
    "client sending one-token image chats back to back: inter-token latency with and without images arriving.",
)
@click.option(
    "--tools",
    is_flag=True,
    help="Send chats the way a coding agent does instead: its system prompt, three tools with tool_choice auto, "
    "and about --prompt-len tokens of text as the user's turn.",
)
@click.option(
    "--ignore-eos",
    is_flag=True,
    help="Every request decodes exactly --gen tokens, past stop ids (vLLM's ignore_eos).",
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
    image_file: Path | None,
    image_budget: str | None,
    same_image: bool,
    image_arrivals: bool,
    tools: bool,
    ignore_eos: bool,
) -> None:
    """Load-test a running `thorgen serve` (or any OpenAI-compatible server with /tokenize)."""
    try:
        levels = [int(c) for c in concurrency.split(",") if c.strip()]
    except ValueError:
        raise click.BadParameter(f"{concurrency!r} is not a comma-separated list of integers") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter("give concurrency levels >= 1", param_hint="--concurrency")
    if image_file is None and (image_budget or same_image or image_arrivals):
        raise click.UsageError("--image-max-tokens, --same-image and --image-arrivals go with --image FILE")
    if tools and image_file is not None:
        raise click.UsageError("--tools sends text chats: it does not go with --image")
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
    images = None
    if image_file is not None:
        try:
            images = ImageRequests(image_file, int(image_budget) if image_budget else None, same_image)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        images.text = chat_text(url, prompt_len, api_key)
    fields = streamed(gen, ignore_eos)
    agent = tool_chats(chat_text(url, prompt_len, api_key), fields) if tools else None
    if agent is not None:  # (the tool grammar's first use builds its tokenizer: outside the levels' clocks)
        asyncio.run(run_level(url, 1, 1, tool_chats("Say hello.", streamed(min(gen, 8))), api_key, timeout))
    asyncio.run(run_level(url, 1, 1, text_requests(prompt, streamed(min(gen, 8))), api_key, timeout))  # warm-up
    if images is not None:  # ... and the image path at this image's size
        images.prepare(1)
        asyncio.run(run_level(url, 1, 1, image_chats(images, streamed(2)), api_key, timeout))
    if images is not None and image_arrivals:  # ... and beside a decoding stream: its chunk's pieces cut and bound
        images.prepare(2)
        beside = partial(send_beside, images, fields)
        asyncio.run(run_level(url, 1, 1, text_requests(prompt, streamed(256, True)), api_key, timeout, beside))
    rows = []
    for c in levels:
        n = c * per_client
        if images is not None and not image_arrivals:
            images.prepare(n)
            make = image_chats(images, fields)
        else:
            make = agent or text_requests(prompt, fields)
        alone = None
        if image_arrivals and images is not None:
            alone = asyncio.run(run_level(url, c, n, make, api_key, timeout))
            images.prepare(16)  # the first arrivals' variants, made before the clock starts
        before, times = engine_steps(url), server_times(url)
        beside = partial(send_beside, images, fields) if alone is not None else None
        row = asyncio.run(run_level(url, c, n, make, api_key, timeout, beside))
        steps = step_means(before, engine_steps(url))
        if steps:
            row["engine_steps"] = steps
        server = server_means(times, server_times(url))
        if server:
            row["server"] = server
        if alone is not None:
            row["without_images"] = {k: v for k, v in alone.items() if k != "ttft_ms_by_send"}
        rows.append(row)
        click.echo(_level_line(row))
    report = {
        "url": url,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": (httpx.get(url + "/v1/models", timeout=10).json().get("data") or [{}])[0].get("id"),
        "prompt_len": prompt_len,
        "gen": gen,
        "requests_per_client": per_client,
        "levels": rows,
        "command": f"thorgen bench serve --url {url} --concurrency {concurrency} --prompt-len {prompt_len} "
        f"--gen {gen} --requests {per_client}"
        + (" --ignore-eos" if ignore_eos else "")
        + (" --tools" if tools else "")
        + (f" --image {image_file}" if image_file else "")
        + (f" --image-max-tokens {image_budget}" if image_file and image_budget else "")
        + (" --same-image" if image_file and same_image else "")
        + (" --image-arrivals" if image_file and image_arrivals else ""),
    }
    if images is not None:
        report["image"] = images.describe() | {"arrivals": image_arrivals}
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
