"""Serve stage: the /metrics page through prometheus-client (requests, tokens, TTFT, decode speed, speculative
acceptance, the engine's steps and KV blocks), with vLLM's names beside thorgen's for vLLM's Grafana dashboards.

Labels are bounded: a request counts under its route's template (`/v1/models/{model_id:path}`), or `unmatched`
when no route took it, never under the raw path a client sent; prometheus-client escapes every label value.
"""

from __future__ import annotations

import threading
from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

UNMATCHED = "unmatched"  # the endpoint of a request no route took (a 404 / 405 on an unknown path)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 200, 400, 800, 1600)
_ACCEPT_BUCKETS = tuple(range(1, 17))
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


def endpoint_of(scope: Mapping[str, Any]) -> str:
    """The `endpoint` label of a request: the path template of the route that took it, else UNMATCHED."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else UNMATCHED


class _EngineCollector(Collector):
    """The engine's state as of the last scrape (Metrics.render sets it): running and queued generations, the
    engine thread's step counters and its KV blocks, under thorgen's names and vLLM's."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        steps, kv, model = m.steps, m.kv, [m.model_name]
        yield GaugeMetricFamily("thorgen_requests_running", "Generations on the engine now.", value=m.running)
        if m.gpu_memory is not None:
            yield GaugeMetricFamily(
                "thorgen_gpu_memory_used_bytes",
                "Device memory in use when the engine last sampled it (at each request's end; the driver's view, "
                "other processes included).",
                value=m.gpu_memory,
            )
        yield GaugeMetricFamily("thorgen_requests_queued", "Generations waiting for the engine.", value=m.queued)
        if m.caches:
            family = GaugeMetricFamily(
                "thorgen_cache_bytes",
                "Host bytes a bounded cache holds (preprocessed images' patches, encoded images' rows).",
                labels=["cache"],
            )
            for key, value in sorted(m.caches.items()):
                family.add_metric([key.removesuffix("_bytes")], value)
            yield family
        for name, value, text in (
            ("vllm:num_requests_running", m.running, "Requests on the engine now (vLLM's name)."),
            ("vllm:num_requests_waiting", m.queued, "Requests waiting for the engine (vLLM's name)."),
        ):
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric(model, value)
            yield family
        if steps:  # where the engine thread's time goes (a load test diffs two scrapes: per-step means)
            yield CounterMetricFamily("thorgen_engine_steps", "Engine steps run.", value=steps["steps"])
            yield CounterMetricFamily(
                "thorgen_engine_running_sequences",
                "Sequences running after each step, summed (over steps_total: the mean batch).",
                value=steps["running"],
            )
            phases = CounterMetricFamily(
                "thorgen_engine_step_seconds",
                "Engine thread time by phase: prepare (step start to device work enqueued), flush (streaming the "
                "previous step's outputs), finish (the device wait and postprocessing).",
                labels=["phase"],
            )
            for phase in ("prepare", "flush", "finish"):
                phases.add_metric([phase], steps[phase])
            yield phases
            yield CounterMetricFamily(
                "thorgen_drafter_catch_up_tokens",
                "Positions a speculative sequence's drafter context was brought up to date over (a tap prefill "
                "once it decodes alone after batched steps).",
                value=steps.get("catch_up_tokens", 0),
            )
            yield from _speculation(steps, model)
        if kv:  # vLLM's kv_cache_usage_perc, and the numbers behind it
            usage = kv["used"] / kv["blocks"] if kv["blocks"] else 0.0
            for name, value, text in (
                ("thorgen_kv_cache_blocks", kv["blocks"], f"KV blocks of {kv['block_tokens']} tokens in all."),
                ("thorgen_kv_cache_blocks_used", kv["used"], "KV blocks charged to running sequences."),
                ("thorgen_kv_cache_usage", round(usage, 6), "Fraction of the KV blocks in use (0..1)."),
            ):
                yield GaugeMetricFamily(name, text, value=value)
            family = GaugeMetricFamily(
                "vllm:kv_cache_usage_perc",
                "Fraction of the KV blocks in use, 0..1 (vLLM's name).",
                labels=["model_name"],
            )
            family.add_metric(model, round(usage, 6))
            yield family


def _speculation(steps: dict, model: list[str]) -> Iterable[Metric]:
    """Speculative decoding's totals: verify steps, the drafts they checked and the drafts accepted, under
    thorgen's names and vLLM's (acceptance rate = accepted / draft tokens)."""
    for key, ours, vllm, text in (
        ("speculative_steps", "thorgen_speculative_steps", "vllm:spec_decode_num_drafts", "Draft + verify steps"),
        (
            "draft_tokens",
            "thorgen_draft_tokens",
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens those steps verified",
        ),
        (
            "accepted_tokens",
            "thorgen_accepted_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted",
        ),
    ):
        value = steps.get(key, 0)
        yield CounterMetricFamily(ours, f"{text}.", value=value)
        family = CounterMetricFamily(vllm, f"{text} (vLLM's name).", labels=["model_name"])
        family.add_metric(model, value)
        yield family


class Metrics:
    """The server's metrics in a registry of its own (several servers may share a process). Thread-safe: the
    engine worker thread and the event loop both record into it."""

    def __init__(self, model_name: str = "thorgen") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.running, self.queued = 0, 0
        self.steps: dict | None = None
        self.kv: dict | None = None
        self.gpu_memory: int | None = None
        self.caches: dict[str, int] | None = None
        self._scrape = threading.Lock()  # one scrape at a time sets the engine state its collector reads
        reg, model = self.registry, ("model_name",)
        ProcessCollector(registry=reg)  # process_resident_memory_bytes and friends (the soak's host RSS)

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, text, labels, registry=reg)

        def histogram(name: str, text: str, buckets: tuple, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, text, labels, registry=reg, buckets=buckets)

        self._requests = counter(
            "thorgen_requests", "HTTP requests by endpoint (route) and status.", ("endpoint", "status")
        )
        self._aborts = counter(
            "thorgen_requests_aborted",
            "Generations whose client disconnected before the end (also counted as status 499 above).",
            ("endpoint",),
        )
        self._tokens = {
            "prompt_tokens": [
                counter("thorgen_prompt_tokens", "Prompt tokens processed."),
                counter("vllm:prompt_tokens", "Prompt tokens processed (vLLM's name).", model).labels(model_name),
                counter(
                    "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (vLLM's name).", model
                ).labels(model_name),
            ],
            "cached_prompt_tokens": [
                counter("thorgen_cached_prompt_tokens", "Prompt tokens served from the prefix cache."),
                counter(
                    "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache (vLLM's name).", model
                ).labels(model_name),
            ],
            "generation_tokens": [
                counter("thorgen_generation_tokens", "Tokens generated."),
                counter("vllm:generation_tokens", "Tokens generated (vLLM's name).", model).labels(model_name),
            ],
        }
        self._histograms = {
            "ttft": [
                histogram(
                    "thorgen_time_to_first_token_seconds", "Time from arrival to the first token.", _TTFT_BUCKETS
                ),
                histogram(
                    "vllm:time_to_first_token_seconds", "Time to the first token (vLLM's name).", _TTFT_BUCKETS, model
                ).labels(model_name),
            ],
            "prepare": [
                histogram(
                    "thorgen_request_prepare_seconds",
                    "Time from a generation request's handler to its submission to the engine: the prompt rendered "
                    "and tokenized, its images and videos read, decoded and preprocessed (before the TTFT's arrival).",
                    _TTFT_BUCKETS,
                ),
            ],
            "tokens_per_s": [
                histogram("thorgen_decode_tokens_per_second", "Decode speed per request.", _TPS_BUCKETS),
            ],
            "accepted_per_step": [
                histogram(
                    "thorgen_accepted_tokens_per_step",
                    "Tokens committed per speculative verify step (accepted drafts + 1).",
                    _ACCEPT_BUCKETS,
                ),
            ],
            "e2e": [
                histogram(
                    "vllm:e2e_request_latency_seconds",
                    "Time from arrival to the last token (vLLM's name).",
                    _E2E_BUCKETS,
                    model,
                ).labels(model_name),
            ],
        }
        self.registry.register(_EngineCollector(self))

    def request_done(self, endpoint: str, status: int) -> None:
        """Count a finished request; `endpoint`: a route template or UNMATCHED (endpoint_of), never a raw path."""
        self._requests.labels(endpoint, str(int(status))).inc()

    def aborted(self, endpoint: str) -> None:
        self._aborts.labels(endpoint).inc()

    def add(self, **fields: float) -> None:
        """Add to the token counters: prompt_tokens, cached_prompt_tokens, generation_tokens."""
        for name, value in fields.items():
            for series in self._tokens[name]:
                series.inc(value)

    def observe(self, name: str, value: float) -> None:
        """Observe a value in a histogram: ttft, prepare, tokens_per_s, accepted_per_step or e2e."""
        for series in self._histograms[name]:
            series.observe(value)

    def render(
        self,
        steps: dict | None = None,
        kv: dict | None = None,
        gpu_memory: int | None = None,
        caches: dict[str, int] | None = None,
    ) -> str:
        """The exposition text; `steps`: the engine thread's step counters (EngineClient.health()["steps"]); `kv`:
        its KV blocks (health()["kv"]: total, charged to running sequences, tokens a block); `gpu_memory`: bytes
        of device memory in use (health()["gpu_memory_used"]; None on the reference backend); `caches`: host
        bytes each bounded cache holds (/health's caches: "<name>_bytes" -> bytes)."""
        with self._scrape:
            self.steps, self.kv, self.gpu_memory, self.caches = steps, kv, gpu_memory, caches
            return generate_latest(self.registry).decode()
