"""Serve stage: the closed-loop load generator of `thorgen bench serve` (runtime/bench/serve_cli.py) against a
running OpenAI-compatible server.

Each concurrency level runs C clients that each send requests back to back (streamed /v1/completions with a
token-id prompt of --prompt-len ids, shuffled per request so that no prefix cache helps, --gen tokens), and
reports TTFT and inter-token latency percentiles, per-request decode tok/s and aggregate tok/s (completion
tokens of the level / its wall time). Inter-token latency is the gap between streamed chunks that carry text (or
token ids), divided by the tokens between them as counted by the final usage (a chunk may carry several tokens,
and a token may carry no text).

With --image the clients send chats of the image then about --prompt-len tokens of text instead; with
--image-arrivals they send the text requests, and each level runs twice: alone, then with one more client sending
one-token image chats back to back beside them (runtime/bench/serve_images.py), so that the inter-token latency
of the running streams can be compared with and without images arriving.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import random
import statistics
import time
from typing import Any, Awaitable, Callable

import click

from .serve_images import ImageRequests, arrival_stats

Request = Callable[[int], tuple[str, dict]]  # request number -> (endpoint, body)
Beside = Callable[[Callable[[Any, dict], Awaitable[dict]], Any, asyncio.Event], Awaitable[list[dict]]]


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def _one(http, url: str, body: dict, headers: dict, endpoint: str = "/v1/completions") -> dict:
    # serialized before the clock starts: a megabyte-sized image chat takes milliseconds of the client's own
    # JSON encoding, which is no part of the server's latency
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = {**headers, "content-type": "application/json"}
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    async with http.stream("POST", url + endpoint, content=data, headers=headers) as r:
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
                or c.get("token_ids")
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


def streamed(gen: int, ignore_eos: bool = False) -> dict:
    """The fields every request shares: `gen` tokens at most (exactly, with `ignore_eos`), greedy, streamed with
    the usage, and each token's ids (vLLM's return_token_ids), so that a token without text still arrives."""
    # (no `model`: the server answers under its own name; it refuses one it does not serve)
    fields = {
        "max_tokens": gen,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    return fields | ({"ignore_eos": True} if ignore_eos else {})


def text_requests(prompt: list[int], fields: dict) -> Request:
    """Streamed completions of `prompt`, shuffled per request (unique_prompt)."""
    return lambda i: ("/v1/completions", {"prompt": unique_prompt(prompt, i), **fields})


def image_chats(images: ImageRequests, fields: dict) -> Request:
    """Streamed chats of the image and the text (serve_images.py), one prepared variant each."""
    return lambda i: ("/v1/chat/completions", images.body(fields))


LARGEST_GAPS = 24  # the slowest inter-token gaps a level's row lists (a p99 of ~2,000 gaps is the 20th)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 3)


def level_stats(concurrency: int, results: list[dict], wall: float) -> dict:
    """A level's row: TTFT and inter-token percentiles, aggregate and per-request tok/s."""
    ttft = [t for _, t in sorted((r["sent"], r["arrivals"][0] - r["sent"]) for r in results if r["arrivals"])]
    itl, rates = [], []
    for r in results:
        a = r["arrivals"]
        if len(a) > 1 and r["tokens"] > 1:
            per_token = (r["tokens"] - 1) / (len(a) - 1)  # tokens per text-carrying chunk after the first
            itl += [(b - x) / per_token for x, b in zip(a, a[1:])]
            rates.append((r["tokens"] - 1) / (a[-1] - a[0]))
    total = sum(r["tokens"] for r in results)
    prompts = [r["prompt_tokens"] for r in results if r.get("prompt_tokens")]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completion_tokens": total,
        "prompt_tokens_mean": round(statistics.mean(prompts), 1) if prompts else None,
        "wall_s": round(wall, 3),
        "aggregate_tok_s": round(total / wall, 2),
        "ttft_ms_p50": _ms(percentile(ttft, 50)),
        "ttft_ms_p99": _ms(percentile(ttft, 99)),
        "ttft_ms_by_send": [round(t * 1e3, 1) for t in ttft],  # in send order: the waves' shape
        "itl_ms_p50": _ms(percentile(itl, 50)),
        "itl_ms_p99": _ms(percentile(itl, 99)),
        "itl_ms_largest": [_ms(g) for g in heapq.nlargest(LARGEST_GAPS, itl)],  # what p99 sits among
        "request_decode_tok_s_median": round(statistics.median(rates), 2) if rates else None,
    }


async def run_level(
    url: str,
    concurrency: int,
    requests: int,
    make: Request,
    api_key: str | None,
    timeout: float,
    beside: Beside | None = None,
) -> dict:
    """C clients sending `requests` requests back to back; `beside`, where given, runs alongside them until they
    are done (the image arrivals), and its requests' numbers join the row."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[dict] = []
    todo = list(range(requests))

    async def client(http) -> None:
        while todo:
            endpoint, body = make(todo.pop())
            results.append(await _one(http, url, body, headers, endpoint))

    async def chat(http, body: dict) -> dict:
        return await _one(http, url, body, headers, "/v1/chat/completions")

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        stop = asyncio.Event()
        side = asyncio.ensure_future(beside(chat, http, stop)) if beside is not None else None
        start = time.perf_counter()
        try:
            await asyncio.gather(*(client(http) for _ in range(concurrency)))
        finally:
            wall = time.perf_counter() - start
            stop.set()
            side_results = await side if side is not None else None
    row = level_stats(concurrency, results, wall)
    if side_results is not None:
        row.update(arrival_stats(side_results, percentile))
    return row


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


def engine_steps(url: str) -> dict | None:
    """The engine thread's step counters from /health (a thorgen server's; None from another server)."""
    import httpx

    try:
        steps = httpx.get(url + "/health", timeout=10).json().get("steps")
    except (httpx.HTTPError, ValueError):
        return None
    return steps if isinstance(steps, dict) else None


SERVER_TIMES = {"to_engine": "thorgen_request_prepare_seconds", "ttft": "thorgen_time_to_first_token_seconds"}


def server_times(url: str) -> dict[str, float] | None:
    """The sums and counts of a thorgen server's request histograms (SERVER_TIMES) from its /metrics; None from
    another server."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    wanted = {f"{name}_{part}": f"{key}_{part}" for key, name in SERVER_TIMES.items() for part in ("sum", "count")}
    out: dict[str, float] = {}
    for line in r.text.splitlines() if r.status_code == 200 else ():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[wanted[name]] = float(value)
    return out if len(out) == len(wanted) else None


def server_means(before: dict[str, float] | None, after: dict[str, float] | None) -> dict | None:
    """Per-request means over a level, as the server measured them: to_engine_ms (its handler to the engine: the
    prompt rendered and tokenized, images decoded and preprocessed) and ttft_ms (from then to the first token)."""
    if not before or not after:
        return None
    out = {}
    for key in SERVER_TIMES:
        n = after[f"{key}_count"] - before[f"{key}_count"]
        if n <= 0:
            return None
        out[f"{key}_ms"] = round(1e3 * (after[f"{key}_sum"] - before[f"{key}_sum"]) / n, 3)
    return out


def step_means(before: dict | None, after: dict | None) -> dict | None:
    """Per-step means over a level: steps, mean sequences running, and ms per phase (runtime/client.py); with a
    thorgen server's speculation counters, the level's verify steps, drafted and accepted tokens too."""
    if not before or not after or after["steps"] <= before["steps"]:
        return None
    n = after["steps"] - before["steps"]
    out = {"steps": n, "mean_running": round((after["running"] - before["running"]) / n, 2)}
    for phase in ("prepare", "flush", "finish"):
        out[f"{phase}_ms"] = round(1e3 * (after[phase] - before[phase]) / n, 3)
    if "draft_tokens" in after and "draft_tokens" in before:  # speculative decoding over the level
        for key in ("speculative_steps", "draft_tokens", "accepted_tokens"):
            out[key] = after[key] - before[key]
        drafted = out["draft_tokens"]
        out["acceptance_rate"] = round(out["accepted_tokens"] / drafted, 4) if drafted else None
        if after.get("emulated_acceptance") is not None:  # `serve --emulate-acceptance K`: not the model's drafts
            out["emulated_acceptance"] = after["emulated_acceptance"]
    return out


SENTENCE = "The quick brown fox jumps over the lazy dog while the engine streams tokens. "


def _tokenize(url: str, text: str, api_key: str | None) -> list[int]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.post(url + "/tokenize", json={"prompt": text}, headers=headers, timeout=60)
    if r.status_code != 200:
        raise click.ClickException(f"/tokenize answered {r.status_code}: {r.text[:300]}")
    tokens: list[int] = r.json()["tokens"]
    return tokens


def bench_prompt(url: str, prompt_len: int, api_key: str | None) -> list[int]:
    """`prompt_len` token ids of plain text, tokenized by the server itself (so any tokenizer works)."""
    text, ids = SENTENCE, []
    while len(ids) < prompt_len:
        text *= 2
        ids = _tokenize(url, text, api_key)
    return ids[:prompt_len]


def chat_text(url: str, prompt_len: int, api_key: str | None) -> str:
    """About `prompt_len` tokens of plain text in whole sentences, counted by the server's tokenizer."""
    per_sentence = len(_tokenize(url, SENTENCE * 16, api_key)) / 16
    return SENTENCE * max(1, round(prompt_len / per_sentence))
