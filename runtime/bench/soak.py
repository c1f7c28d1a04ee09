"""Serve stage: `thorgen bench soak`, a long run of mixed traffic against a server (a running one, or a `thorgen
serve` it starts) that watches status codes, streams' final events, latency over time and memory, and exits
nonzero on any 5xx, cut stream or other failure (runtime/bench/soak_report.py's FAILURES).

A bounded number of clients each send one request after another until --duration passes, each request's kind
drawn from --mix by weight (runtime/bench/soak_requests.py). Every distinct payload is sent once first (the
warm-up: each kind, each of the soak's images, each hostile body), so that the server's caches hold what the soak
will ask for before memory is first sampled; memory is sampled after it, at the end of each time window and once
every request has finished: the server's RSS (psutil on the process it started, plus its engine process's where
/health names one, each also apart; else /metrics' process_resident_memory_bytes), the bytes its caches hold
(/health's caches) and GPU memory (/health's gpu_memory_used; n/a on the reference backend).
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from .soak_report import summarize, text
from .soak_requests import DEFAULT_MIX, IMAGE_POOL, KINDS, Outcome, Settings, build, send, warmup


def parse_mix(mix: str) -> dict[str, float]:
    """'chat=3,stream=4,...' -> {kind: weight}; kinds left out get no requests."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in mix.split(","))):
        kind, _, weight = part.partition("=")
        if kind not in KINDS:
            raise click.BadParameter(f"unknown kind {kind!r}; the kinds: {', '.join(KINDS)}", param_hint="--mix")
        try:
            weights[kind] = float(weight or 1)
        except ValueError:
            raise click.BadParameter(f"{part!r}: the weight is not a number", param_hint="--mix") from None
    if not weights or min(weights.values()) < 0 or not sum(weights.values()):
        raise click.BadParameter("give kinds with weights >= 0, at least one above 0", param_hint="--mix")
    return {k: w for k, w in weights.items() if w > 0}


def process_rss(pid: int) -> int | None:
    """Resident bytes of process `pid` now (psutil where installed, else Linux /proc); None when unknown."""
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        pass
    except Exception:  # (psutil's NoSuchProcess, AccessDenied)
        return None
    try:
        import os

        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ServerProcess:
    """`thorgen serve` in a child process on a free port, its output in `log`."""

    def __init__(self, backend: str, model: Path | None, serve_args: list[str], log: Path, api_key: str | None):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url, self.log = f"http://127.0.0.1:{self.port}", log
        self.args = ["serve", "--backend", backend, "--port", str(self.port)]
        self.args += (["--model", str(model)] if model else []) + (["--api-key", api_key] if api_key else [])
        self.args += serve_args
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        import httpx

        with open(self.log, "w") as out:
            cmd = [sys.executable, "-m", "thorgen.cli", *self.args]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        why = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else f"not ready in {timeout:g} s"
        self.stop()
        raise click.ClickException(f"`thorgen {' '.join(self.args)}` {why}:\n{self.tail()}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


async def _sample(http: Any, url: str, t: float, pid: int | None) -> dict[str, Any]:
    """Memory now: the server's RSS, the bytes its caches hold and GPU memory (None where not known)."""
    import httpx

    sample: dict[str, Any] = {"t": round(t, 2), "rss_bytes": None, "rss_source": "n/a", "gpu_memory_bytes": None}
    sample["cache_bytes"] = None
    engine_pid = None  # the server's engine process (serve --engine-process), whose memory counts too
    try:
        health = (await http.get(url + "/health")).json()
        sample["gpu_memory_bytes"], engine_pid = health.get("gpu_memory_used"), health.get("engine_pid")
        if isinstance(health.get("caches"), dict):
            sample["caches"] = health["caches"]
            sample["cache_bytes"] = sum(health["caches"].values())
    except (httpx.HTTPError, ValueError, TypeError):
        pass
    if pid is not None:
        sample["rss_bytes"], sample["rss_source"] = process_rss(pid), f"pid {pid}"
        sample["server_rss_bytes"] = sample["rss_bytes"]  # (each process apart too: which one grows)
        engine_rss = process_rss(engine_pid) if engine_pid is not None else None
        if sample["rss_bytes"] is not None and engine_rss is not None:
            sample["engine_rss_bytes"] = engine_rss
            sample["rss_bytes"] += engine_rss
            sample["rss_source"] += f" + engine process {engine_pid}"
    else:
        try:
            for line in (await http.get(url + "/metrics")).text.splitlines():
                if line.startswith("process_resident_memory_bytes "):
                    sample["rss_bytes"], sample["rss_source"] = int(float(line.split()[1])), "/metrics"
        except (httpx.HTTPError, ValueError):
            pass
    return sample


async def soak(
    url: str,
    settings: Settings,
    mix: dict[str, float],
    duration: float,
    concurrency: int,
    windows: int,
    seed: int = 0,
    timeout: float = 300.0,
    headers: dict[str, str] | None = None,
    pid: int | None = None,
    limits: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run the soak; returns soak_report.summarize's figures (`limits`: its drift limits)."""
    import httpx

    headers = headers or {}
    kinds, weights = list(mix), list(mix.values())
    outcomes: list[Outcome] = []
    pool = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=pool) as http:
        t0 = time.perf_counter()

        def now() -> float:
            return time.perf_counter() - t0

        # every distinct payload once first (soak_requests.warmup), `concurrency` at a time: grammars compiled,
        # the vision tower loaded, every image cached, so that memory after it has no cache left to fill
        slots = asyncio.Semaphore(concurrency)

        async def warm(request: Any) -> Outcome:
            async with slots:
                return await send(http, url, request, t0, headers)

        for outcome in await asyncio.gather(*(warm(r) for r in warmup(kinds, random.Random(seed), settings))):
            outcome.warmup = True
            outcomes.append(outcome)
        start = now()
        end = start + duration
        samples = [await _sample(http, url, now(), pid)]

        async def client(i: int) -> None:
            rng = random.Random(seed * 1_000_003 + i + 1)
            while now() < end:
                kind = rng.choices(kinds, weights)[0]
                outcomes.append(await send(http, url, build(kind, rng, settings), t0, headers))

        async def sampler() -> None:
            for i in range(1, windows + 1):
                await asyncio.sleep(max(0.0, start + i * duration / windows - now()))
                samples.append(await _sample(http, url, now(), pid))

        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(client(i) for i in range(concurrency)))
        await sampling
        samples.append(await _sample(http, url, now(), pid) | {"drained": True})
    return summarize(outcomes, start, end, windows, samples, limits)


def _model_facts(url: str, headers: dict[str, str]) -> tuple[str, int]:
    """(the first served model name, its context) from /v1/models."""
    import httpx

    try:
        health = httpx.get(url + "/health", timeout=10)
        card = (httpx.get(url + "/v1/models", headers=headers, timeout=10).json().get("data") or [{}])[0]
    except (httpx.HTTPError, ValueError) as exc:
        raise click.ClickException(f"no server at {url}: {exc}") from None
    if health.status_code != 200:
        raise click.ClickException(f"{url}/health answered {health.status_code}: {health.text[:200]}")
    if not card.get("id") or not card.get("max_model_len"):
        raise click.ClickException(f"{url}/v1/models names no model with its max_model_len: {card}")
    return card["id"], int(card["max_model_len"])


@click.command("soak")
@click.option("--url", default=None, help="A running server (default: start `thorgen serve` for the soak).")
@click.option(
    "--backend",
    type=click.Choice(["reference", "cuda"]),
    default="reference",
    show_default=True,
    help="The started server's backend (not with --url).",
)
@click.option(
    "--model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="The started server's checkpoint (default: the tiny demo model; not with --url).",
)
@click.option(
    "--serve-args",
    default="",
    help="More options for the started `thorgen serve`, as one string, e.g. '--kernel-dir K --max-num-seqs 32'.",
)
@click.option("--duration", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Seconds of load.")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="Clients at once.")
@click.option(
    "--mix", default=DEFAULT_MIX, show_default=True, help="Request kinds and their weights (a kind left out: none)."
)
@click.option("--max-tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Per request.")
@click.option(
    "--image-tokens",
    type=click.Choice(["70", "140", "280", "560", "1120"]),
    default="70",
    show_default=True,
    help="Soft tokens each image request asks for (mm_processor_kwargs.max_soft_tokens).",
)
@click.option(
    "--images",
    type=click.IntRange(min=1),
    default=IMAGE_POOL,
    show_default=True,
    help="Distinct images the image requests draw from, each sent once in the warm-up.",
)
@click.option(
    "--windows",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Time windows TTFT, gaps and memory are reported in (the first vs the last: the drift).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the kinds drawn and the prompts.")
@click.option("--timeout", type=click.FloatRange(min=1), default=300.0, show_default=True, help="Per request, s.")
@click.option(
    "--start-timeout",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Seconds the started server may take to load.",
)
@click.option(
    "--max-rss-growth",
    type=click.FloatRange(min=0),
    default=None,
    help="Fail when the server's RSS less its caches' bytes (/health's caches) after the last request exceeds that "
    "after the warm-up by more percent.",
)
@click.option(
    "--max-gpu-memory-change",
    type=click.FloatRange(min=0),
    default=None,
    help="Fail when GPU memory changes by more percent between the same two samples (or is not reported).",
)
@click.option(
    "--max-ttft-p99-ratio",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Fail when p99 TTFT of the last window exceeds this multiple of the first window's.",
)
@click.option("--api-key", default=None, envvar="THORGEN_API_KEY")
@click.option(
    "--out",
    "out_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the JSON report here.",
)
@click.option(
    "--server-log",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The started server's output (default: a temporary file, its tail printed when the soak fails).",
)
def bench_soak(
    url: str | None,
    backend: str,
    model: Path | None,
    serve_args: str,
    duration: float,
    concurrency: int,
    mix: str,
    max_tokens: int,
    image_tokens: str,
    images: int,
    windows: int,
    seed: int,
    timeout: float,
    start_timeout: float,
    max_rss_growth: float | None,
    max_gpu_memory_change: float | None,
    max_ttft_p99_ratio: float | None,
    api_key: str | None,
    out_file: Path | None,
    server_log: Path | None,
) -> None:
    """Soak a server with mixed traffic (chat, streams, tools, JSON schemas, images, Anthropic Messages,
    Responses, aborts, hostile bodies) for --duration seconds; exits 1 on any 5xx, cut stream or other failure,
    and on memory or latency drift past the --max-* limits given."""
    weights = parse_mix(mix)
    limits = {
        key: value
        for key, value in (
            ("rss_growth", max_rss_growth),
            ("gpu_memory_change", max_gpu_memory_change),
            ("ttft_drift", max_ttft_p99_ratio),
        )
        if value is not None
    }
    if url is not None and (model is not None or serve_args):
        raise click.UsageError("--model and --serve-args are for the server the soak starts: drop them with --url")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    server = None
    if url is None:
        log = server_log or Path(tempfile.mkstemp(prefix="thorgen-soak-serve-", suffix=".log")[1])
        server = ServerProcess(backend, model, shlex.split(serve_args), log, api_key)
        click.echo(f"starting `thorgen {' '.join(server.args)}` (log: {log})")
        server.start(start_timeout)
        url = server.url
    url = url.rstrip("/")
    try:
        name, max_context = _model_facts(url, headers)
        settings = Settings(name, max_context, max_tokens, int(image_tokens), images)
        pid = server.proc.pid if server is not None and server.proc is not None else None
        figures = asyncio.run(
            soak(url, settings, weights, duration, concurrency, windows, seed, timeout, headers, pid, limits)
        )
    finally:
        exit_code = server.stop() if server is not None else None
    report = {
        "url": url,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": name,
        "max_context": max_context,
        "server": {"started": " ".join(["thorgen", *server.args]), "log": str(server.log), "exit_code": exit_code}
        if server is not None
        else None,
        "duration_s": duration,
        "concurrency": concurrency,
        "mix": weights,
        "max_tokens": max_tokens,
        "image_tokens": int(image_tokens),
        "images": images,
        "seed": seed,
        **figures,
    }
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(report, indent=1) + "\n")
    click.echo(text(report))
    if not report["passed"]:
        if server is not None:
            click.echo(f"--- the server's output (tail; all of it: {server.log}) ---\n{server.tail()}")
        raise SystemExit(1)
