"""Serve stage (`thorgen bench soak`): what a soak's outcomes add up to: status counts per request kind, TTFT and
inter-token gaps per time window, memory at the start and the end, the failures, and the short text summary."""

from __future__ import annotations

from collections import Counter
from typing import Any

from .serve_load import percentile
from .soak_requests import Outcome

# what fails a soak (a nonzero exit), and how the summary names each
FAILURES = {
    "5xx": "answers with a 5xx status",
    "truncated": "streams that ended without their final event ([DONE], message_stop, response.completed)",
    "stream_errors": "streams that ended with an error event",
    "transport_errors": "requests without a whole HTTP answer (connection refused or reset, a timeout)",
    "hostile_accepted": "hostile bodies answered 2xx instead of 4xx",
    "valid_refused": "valid requests answered 4xx",
    "invalid_outputs": "answers without what was asked for (a forced tool call, a JSON schema)",
    # the drift limits a soak was given (none by default): 1 when over, or when it could not be measured
    "rss_growth": "server RSS less its caches' bytes grew more than --max-rss-growth percent",
    "gpu_memory_change": "GPU memory changed more than --max-gpu-memory-change percent",
    "ttft_drift": "p99 TTFT of the last window over the first's above --max-ttft-p99-ratio",
}


def status_class(o: Outcome) -> str:
    return "none" if o.status is None else f"{o.status // 100}xx"


def failures_of(o: Outcome) -> list[str]:
    """The FAILURES keys one outcome counts towards."""
    out = []
    if o.status is not None and o.status >= 500:
        out.append("5xx")
    if o.truncated:
        out.append("truncated")
    if o.stream_error:
        out.append("stream_errors")
    if o.error and not o.stream_error and not o.truncated and (o.status is None or o.status < 300):
        out.append("transport_errors")
    if o.hostile and o.status is not None and o.status < 400:
        out.append("hostile_accepted")
    if not o.hostile and o.status is not None and 400 <= o.status < 500:
        out.append("valid_refused")
    if o.invalid:
        out.append("invalid_outputs")
    return out


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def _p(values: list[float], q: float) -> float | None:
    return _ms(percentile(values, q))


def kind_rows(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(o.kind for o in outcomes):
        mine = [o for o in outcomes if o.kind == kind]
        counts = Counter(status_class(o) for o in mine)
        ttft = [o.ttft for o in mine if o.ttft is not None]
        rows[kind] = {
            "sent": len(mine),
            **{c: counts.get(c, 0) for c in ("2xx", "4xx", "5xx", "none")},
            "truncated": sum(o.truncated for o in mine),
            "stream_errors": sum(o.stream_error for o in mine),
            "aborted": sum(o.aborted for o in mine),
            "invalid_outputs": sum(o.invalid is not None for o in mine),
            "latency_ms_p50": _p([o.latency for o in mine if o.latency is not None], 50),
            "latency_ms_p99": _p([o.latency for o in mine if o.latency is not None], 99),
            "ttft_ms_p50": _p(ttft, 50),
            "ttft_ms_p99": _p(ttft, 99),
        }
    return rows


def hostile_rows(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    rows: dict[str, Counter[str]] = {}
    for o in outcomes:
        if o.hostile:
            rows.setdefault(o.hostile, Counter())[status_class(o)] += 1
    return {case: dict(sorted(c.items())) for case, c in sorted(rows.items())}


def window_rows(outcomes: list[Outcome], start: float, end: float, n: int, samples: list[dict]) -> list[dict]:
    """`n` equal windows of [start, end) by send time (the last one also takes what was sent later): requests,
    TTFT and gap percentiles of the streams sent in it, and the memory sampled at its end."""
    width = (end - start) / n
    rows = []
    for i in range(n):
        lo, hi = start + i * width, start + (i + 1) * width
        mine = [o for o in outcomes if not o.warmup and lo <= o.sent and (o.sent < hi or i == n - 1)]
        ttft = [o.ttft for o in mine if o.ttft is not None]
        gaps = [g for o in mine for g in o.gaps]
        at = min(samples, key=lambda s: abs(s["t"] - hi)) if samples else {}
        rows.append(
            {
                "start_s": round(lo - start, 1),
                "end_s": round(hi - start, 1),
                "requests": len(mine),
                "ttft_ms_p50": _p(ttft, 50),
                "ttft_ms_p99": _p(ttft, 99),
                "itl_ms_p50": _p(gaps, 50),
                "itl_ms_p99": _p(gaps, 99),
                "rss_bytes": at.get("rss_bytes"),
                "server_rss_bytes": at.get("server_rss_bytes"),
                "engine_rss_bytes": at.get("engine_rss_bytes"),
                "cache_bytes": at.get("cache_bytes"),
                "gpu_memory_bytes": at.get("gpu_memory_bytes"),
            }
        )
    return rows


# what memory_row reports at the start and the end of a soak (each as <name>_start, <name>_end, <name>_change_pct)
MEMORY_KEYS = (
    "rss_bytes",
    "server_rss_bytes",
    "engine_rss_bytes",
    "cache_bytes",
    "rss_less_caches_bytes",
    "gpu_memory_bytes",
)


def _change(first: int | None, last: int | None) -> float | None:
    return None if not first or last is None else round(100 * (last - first) / first, 3)


def _less_caches(sample: dict) -> int | None:
    """RSS less the bytes the server's bounded caches hold (RSS where it reports none)."""
    rss, caches = sample.get("rss_bytes"), sample.get("cache_bytes")
    return None if rss is None else rss - (caches or 0)


def memory_row(samples: list[dict]) -> dict[str, Any]:
    """Memory at the first and the last sample (after the warm-up; after the drain), and the change in percent:
    RSS, the server's and its engine process's apart (None where not measured), the caches' bytes (/health's
    caches), RSS less them (what a leak grows) and GPU memory."""
    ends = (samples[0], samples[-1]) if samples else ({}, {})
    first, last = (end | {"rss_less_caches_bytes": _less_caches(end)} for end in ends)
    out: dict[str, Any] = {"rss_source": first.get("rss_source", "n/a")}
    for key in MEMORY_KEYS:
        out[key.replace("_bytes", "_start")] = first.get(key)
        out[key.replace("_bytes", "_end")] = last.get(key)
        out[key.replace("_bytes", "_change_pct")] = _change(first.get(key), last.get(key))
    return out


def drift_failures(memory: dict[str, Any], ttft_ratio: float | None, limits: dict[str, float]) -> list[str]:
    """The drift limits (FAILURES' last three keys -> the largest value allowed) a soak is over, or could not
    measure (no GPU memory on the reference backend, no stream in the first or the last window)."""
    seen = {
        "rss_growth": memory.get("rss_less_caches_change_pct", memory["rss_change_pct"]),
        "gpu_memory_change": None if memory["gpu_memory_change_pct"] is None else abs(memory["gpu_memory_change_pct"]),
        "ttft_drift": ttft_ratio,
    }
    return [key for key, limit in limits.items() if seen[key] is None or seen[key] > limit]


def summarize(
    outcomes: list[Outcome],
    start: float,
    end: float,
    windows: int,
    samples: list[dict],
    limits: dict[str, float] | None = None,
) -> dict:
    """The report's figures (the caller adds where and how the soak ran); `limits`: see drift_failures."""
    failures = Counter(f for o in outcomes for f in failures_of(o))
    rows = window_rows(outcomes, start, end, windows, samples)
    first, last = rows[0]["ttft_ms_p99"], rows[-1]["ttft_ms_p99"]
    ratio = round(last / first, 3) if first and last else None
    memory = memory_row(samples)
    failures.update(drift_failures(memory, ratio, limits or {}))
    examples = [
        f"{o.kind}{' (' + o.hostile + ')' if o.hostile else ''} at {o.sent:.1f} s: {', '.join(failures_of(o))}: "
        f"status {o.status}; {(o.error or o.invalid or '')[:240]}"
        for o in outcomes
        if failures_of(o)
    ]
    return {
        "requests": len(outcomes),
        "warmup_requests": sum(o.warmup for o in outcomes),
        "kinds": kind_rows(outcomes),
        "hostile_cases": hostile_rows(outcomes),
        "windows": rows,
        "ttft_p99_end_over_start": ratio,
        "memory": memory,
        "limits": limits or {},
        "memory_samples": samples,
        "failures": {key: failures.get(key, 0) for key in FAILURES},
        "failure_examples": examples[:20],
        "passed": not failures,
    }


def _pair(row: dict, name: str) -> str:
    """'p50 / p99' of `name` in `row` ('-' for none)."""
    return " / ".join("-" if row[f"{name}_{q}"] is None else f"{row[f'{name}_{q}']:.0f}" for q in ("p50", "p99"))


def _mib(v: int | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:,.1f} MiB"


def _apart(server: int | None, engine: int | None) -> str:
    """' (server X + engine Y)' where the engine process's RSS was measured apart, else ''."""
    return "" if engine is None else f" (server {_mib(server)} + engine {_mib(engine)})"


def text(report: dict) -> str:
    """The short summary a person reads."""
    head = (
        f"soak: {report['requests']} requests ({report['warmup_requests']} warm-up) over {report['duration_s']} s, "
        f"{report['concurrency']} clients, {report['url']}: {'passed' if report['passed'] else 'FAILED'}"
    )
    cols = {"sent": "sent", "2xx": "2xx", "4xx": "4xx", "5xx": "5xx", "none": "none", "truncated": "cut"}
    cols |= {"stream_errors": "err", "aborted": "abort", "invalid_outputs": "invalid"}
    titles = "".join(f"{c:>8}" for c in cols.values())
    lines = [head, f"{'kind':<17}{titles}  TTFT p50/p99 ms  latency p50/p99 ms"]
    for kind, row in report["kinds"].items():
        lines.append(
            f"{kind:<17}"
            + "".join(f"{row[c]:>8}" for c in cols)
            + f"  {_pair(row, 'ttft_ms'):>15}  {_pair(row, 'latency_ms'):>17}"
        )
    for w in report["windows"]:
        lines.append(
            f"{w['start_s']:>7.1f}-{w['end_s']:<7.1f} s {w['requests']:>5} requests  TTFT p50/p99 "
            f"{_pair(w, 'ttft_ms')} ms  ITL p50/p99 {_pair(w, 'itl_ms')} ms  RSS {_mib(w['rss_bytes'])}"
            f"{_apart(w.get('server_rss_bytes'), w.get('engine_rss_bytes'))} (caches {_mib(w.get('cache_bytes'))})  "
            f"GPU {_mib(w['gpu_memory_bytes'])}"
        )
    m = report["memory"]
    lines.append(
        f"memory: RSS {_mib(m['rss_start'])} -> {_mib(m['rss_end'])} ({m['rss_change_pct']} %, {m['rss_source']}"
        + (
            f"; server {_mib(m['server_rss_start'])} -> {_mib(m['server_rss_end'])}, engine process "
            f"{_mib(m['engine_rss_start'])} -> {_mib(m['engine_rss_end'])}"
            if m.get("engine_rss_start") is not None
            else ""
        )
        + "); "
        f"caches {_mib(m.get('cache_start'))} -> {_mib(m.get('cache_end'))}; RSS less caches "
        f"{_mib(m.get('rss_less_caches_start'))} -> {_mib(m.get('rss_less_caches_end'))} "
        f"({m.get('rss_less_caches_change_pct')} %); "
        f"GPU {_mib(m['gpu_memory_start'])} -> {_mib(m['gpu_memory_end'])} ({m['gpu_memory_change_pct']} %); "
        f"p99 TTFT end / start {report['ttft_p99_end_over_start']}"
    )
    bad = {k: v for k, v in report["failures"].items() if v}
    lines.append("failures: " + (", ".join(f"{v} {FAILURES[k]}" for k, v in bad.items()) if bad else "none"))
    lines += [f"  {e}" for e in report["failure_examples"][:10]]
    return "\n".join(lines)
