"""Serve stage: Prometheus text-format metrics (requests, tokens, TTFT, decode speed, speculative acceptance)."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from pathlib import Path

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600)
_ACCEPT_BUCKETS = tuple(range(1, 17))


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class _Histogram:
    def __init__(self, buckets: tuple) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{le="+Inf"}} {self.total}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return out


class Metrics:
    """Thread-safe: the engine worker thread and the event loop both record into it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.aborts: dict[str, int] = defaultdict(int)
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0
        self.generation_tokens = 0
        self.running = 0
        self.queued = 0
        self.ttft = _Histogram(_TTFT_BUCKETS)
        self.tokens_per_s = _Histogram(_TPS_BUCKETS)
        self.accepted_per_step = _Histogram(_ACCEPT_BUCKETS)

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def aborted(self, endpoint: str) -> None:
        with self._lock:
            self.aborts[endpoint] += 1

    def add(self, **fields: float) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(self, name, getattr(self, name) + value)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            getattr(self, name).observe(value)

    def render(self, steps: dict | None = None, kv: dict | None = None, gpu_memory: int | None = None) -> str:
        """The exposition text; `steps`: the engine thread's step counters (EngineClient.health()["steps"]); `kv`:
        its KV blocks (health()["kv"]: total, charged to running sequences, tokens a block); `gpu_memory`: bytes
        of device memory in use (health()["gpu_memory_used"]; None on the reference backend)."""
        with self._lock:
            lines = [
                "# HELP thorgen_requests_total HTTP requests by endpoint and status.",
                "# TYPE thorgen_requests_total counter",
            ]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'thorgen_requests_total{{endpoint="{endpoint}",status="{status}"}} {n}')
            lines += [
                "# HELP thorgen_requests_aborted_total Generations whose client disconnected before the end "
                "(also counted as status 499 above).",
                "# TYPE thorgen_requests_aborted_total counter",
            ]
            for endpoint, n in sorted(self.aborts.items()):
                lines.append(f'thorgen_requests_aborted_total{{endpoint="{endpoint}"}} {n}')
            for name, value, kind, text in (
                ("thorgen_prompt_tokens_total", self.prompt_tokens, "counter", "Prompt tokens processed."),
                (
                    "thorgen_cached_prompt_tokens_total",
                    self.cached_prompt_tokens,
                    "counter",
                    "Prompt tokens served from the prefix cache.",
                ),
                ("thorgen_generation_tokens_total", self.generation_tokens, "counter", "Tokens generated."),
                ("thorgen_requests_running", self.running, "gauge", "Generations on the engine now."),
                ("thorgen_requests_queued", self.queued, "gauge", "Generations waiting for the engine."),
            ):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {value}"]
            for name, hist, text in (
                ("thorgen_time_to_first_token_seconds", self.ttft, "Time from arrival to the first token."),
                ("thorgen_decode_tokens_per_second", self.tokens_per_s, "Decode speed per request."),
                (
                    "thorgen_accepted_tokens_per_step",
                    self.accepted_per_step,
                    "Tokens committed per speculative verify step (accepted drafts + 1).",
                ),
            ):
                lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"] + hist.lines(name)
            if steps:  # where the engine thread's time goes (a load test diffs two scrapes: per-step means)
                lines += [
                    "# HELP thorgen_engine_steps_total Engine steps run.",
                    "# TYPE thorgen_engine_steps_total counter",
                    f"thorgen_engine_steps_total {steps['steps']}",
                    "# HELP thorgen_engine_running_sequences_total Sequences running after each step, summed "
                    "(over steps_total: the mean batch).",
                    "# TYPE thorgen_engine_running_sequences_total counter",
                    f"thorgen_engine_running_sequences_total {steps['running']}",
                    "# HELP thorgen_engine_step_seconds_total Engine thread time by phase: prepare (step "
                    "start to device work enqueued), flush (streaming the previous step's outputs), finish "
                    "(the device wait and postprocessing).",
                    "# TYPE thorgen_engine_step_seconds_total counter",
                ]
                lines += [
                    f'thorgen_engine_step_seconds_total{{phase="{p}"}} {steps[p]:.6f}'
                    for p in ("prepare", "flush", "finish")
                ]
                lines += [
                    "# HELP thorgen_drafter_catch_up_tokens_total Positions a speculative sequence's drafter "
                    "context was brought up to date over (a tap prefill once it decodes alone after batched "
                    "steps).",
                    "# TYPE thorgen_drafter_catch_up_tokens_total counter",
                    f"thorgen_drafter_catch_up_tokens_total {steps.get('catch_up_tokens', 0)}",
                ]
            if kv:  # vLLM's kv_cache_usage_perc, and the numbers behind it
                usage = kv["used"] / kv["blocks"] if kv["blocks"] else 0.0
                for name, value, text in (
                    ("thorgen_kv_cache_blocks", kv["blocks"], f"KV blocks of {kv['block_tokens']} tokens in all."),
                    ("thorgen_kv_cache_blocks_used", kv["used"], "KV blocks charged to running sequences."),
                    ("thorgen_kv_cache_usage", round(usage, 6), "Fraction of the KV blocks in use (0..1)."),
                ):
                    lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", f"{name} {value}"]
            if gpu_memory is not None:
                lines += [
                    "# HELP thorgen_gpu_memory_used_bytes Device memory in use when the engine last sampled it (at "
                    "each request's end; the driver's view, other processes included).",
                    "# TYPE thorgen_gpu_memory_used_bytes gauge",
                    f"thorgen_gpu_memory_used_bytes {gpu_memory}",
                ]
            rss = resident_bytes()
            if rss is not None:  # the name Prometheus' own client libraries give it
                lines += [
                    "# HELP process_resident_memory_bytes Resident memory of the server process.",
                    "# TYPE process_resident_memory_bytes gauge",
                    f"process_resident_memory_bytes {rss}",
                ]
            return "\n".join(lines) + "\n"
