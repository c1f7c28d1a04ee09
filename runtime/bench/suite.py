"""Runtime stage: `thorgen bench --suite FILE`, each prompt of a suite file run in-process through the engine,
with plain and (where the model has a drafter) speculative greedy decoding.

Prompts are rendered with the checkpoint's own chat template and tokenizer (runtime/text/prompts.py); needle entries
with "prompt_tokens" are sized to that many tokens. After one warm-up, every prompt gets `runs` timed
generations per mode, up to the entry's max_tokens, stopping at the model's stop ids unless `ignore_eos`.
Per prompt and mode: TTFT (call -> first token), decode tok/s ((tokens - 1) / (last - first token)) and
tau, the tokens committed per step after the first (1 for plain decoding; the mean accepted length of a
speculative step), medians over the runs. A prompt that does not fit the context is reported as skipped.
"""

from __future__ import annotations

import datetime as _dt
import statistics
from pathlib import Path
from typing import Any

from ..backend import BackendError
from .timing import open_model_for_bench, timed_stream
from ..generate import _stop_ids
from ..text.prompts import PromptRenderer, load_suite


def _mode(
    backend: Any, ids: list[int], max_tokens: int, runs: int, speculative: bool, stop_ids: frozenset[int]
) -> tuple[dict, list[int]]:
    """(medians of one mode over `runs`, the last run's tokens)."""
    ttft, rates, taus = [], [], []
    r: dict = {}
    for _ in range(runs):
        r = timed_stream(backend, ids, max_tokens, speculative, stop_ids)
        n = len(r["token_ids"])
        ttft.append(r["ttft_s"])
        if n > 1 and r["decode_s"] > 0:
            rates.append((n - 1) / r["decode_s"])
        if r["steps"]:
            taus.append((n - 1) / r["steps"])
    row = {
        "ttft_ms": round(statistics.median(ttft) * 1e3, 3),
        "decode_tok_s": round(statistics.median(rates), 3) if rates else None,
        "tau": round(statistics.median(taus), 4) if taus else None,
        "tokens": len(r["token_ids"]),
        "steps": r["steps"],
    }
    return row, r["token_ids"]


def run_entries(
    backend: Any,
    renderer: PromptRenderer,
    entries: list[dict],
    runs: int,
    stop_ids: frozenset[int],
    spec_on: bool,
    progress: Any = None,
) -> list[dict]:
    """One row per entry, in order, on an opened backend."""
    ctx = backend.max_context
    rows, warm = [], False
    for entry in entries:
        max_tokens = int(entry.get("max_tokens", 128))
        row: dict = {"id": entry["id"], "category": entry.get("category"), "max_tokens": max_tokens}
        rows.append(row)
        try:
            ids = renderer.entry_ids(entry)
        except ValueError as exc:
            row["skipped"] = str(exc)
        else:
            row["prompt_tokens"] = len(ids)
            if len(ids) + max_tokens > ctx:
                row["skipped"] = f"{len(ids)} prompt + {max_tokens} new tokens exceed the context of {ctx} (--ctx)"
        if "skipped" not in row:
            if not warm:  # graph capture, lazy weights and caches land here, not in the first prompt's numbers
                timed_stream(backend, ids, min(max_tokens, 4), False, stop_ids)
                if spec_on:
                    timed_stream(backend, ids, min(max_tokens, 4), True, stop_ids)
                warm = True
            row["plain"], plain_ids = _mode(backend, ids, max_tokens, runs, False, stop_ids)
            if spec_on:
                row["speculative"], spec_ids = _mode(backend, ids, max_tokens, runs, True, stop_ids)
                row["same_tokens"] = spec_ids == plain_ids  # greedy: speculation must not change the output
        if progress is not None:
            progress(row)
    return rows


def run_suite(
    backend_name: str,
    model: Path,
    suite_file: Path,
    runs: int,
    ctx: int | None,
    kv_dtype: str,
    ignore_eos: bool = False,
    speculative: bool = True,
    command: str = "",
    weights: Path | None = None,
    kernel_dir: Path | None = None,
    progress: Any = None,
) -> dict:
    """The suite report: one row per prompt (see the module docstring); `progress(row)` sees each row."""
    try:
        entries = load_suite(suite_file)
    except ValueError as exc:
        raise BackendError(str(exc)) from None
    opened, facts = open_model_for_bench(backend_name, model, ctx, kv_dtype, weights, kernel_dir)
    backend = opened.backend
    try:
        try:
            renderer = PromptRenderer(opened.model_dir, opened.chat_template, opened.tokenizer_path)
        except (FileNotFoundError, ValueError) as exc:
            raise BackendError(f"{model}: {exc}") from None
        stop_ids = frozenset() if ignore_eos else _stop_ids(opened.generation_config, backend.spec)
        spec_on = speculative and backend.features.speculative
        rows = run_entries(backend, renderer, entries, runs, stop_ids, spec_on, progress)
    finally:
        backend.close()  # frees the device
    ran = [r for r in rows if "plain" in r]

    def median_of(mode: str, key: str) -> float | None:
        vals = [r[mode][key] for r in ran if mode in r and r[mode][key] is not None]
        return round(statistics.median(vals), 4) if vals else None

    return {
        "gpu": facts["gpu"],
        "command": command,
        "backend": backend_name,
        "model": backend.spec.name,
        "spec_hash": backend.spec.spec_hash,
        "suite_file": str(suite_file),
        "ctx": backend.max_context,
        "kv_dtype": kv_dtype,
        "runs": runs,
        "ignore_eos": ignore_eos,
        "speculative": spec_on,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "summary": {
            "prompts": len(rows),
            "ran": len(ran),
            "plain_decode_tok_s_median": median_of("plain", "decode_tok_s"),
            "speculative_decode_tok_s_median": median_of("speculative", "decode_tok_s"),
            "speculative_tau_median": median_of("speculative", "tau"),
        },
        "prompts": rows,
    }


def row_text(row: dict) -> str:
    head = f"{row['id']:<18} {row.get('category') or '':<16}"
    if "skipped" in row:
        return f"{head} skipped: {row['skipped']}"
    text = f"{head} prompt {row['prompt_tokens']:>6}"
    for mode in ("plain", "speculative"):
        m = row.get(mode)
        if m:
            text += (
                f"  {'spec' if mode == 'speculative' else mode}: TTFT {m['ttft_ms']:.1f} ms, "
                f"{m['decode_tok_s']} tok/s, tau {m['tau']}, {m['tokens']} tok"
            )
    return text
