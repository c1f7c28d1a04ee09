"""Serve stage: `thorgen gate`, greedy continuations of a checkpoint checked against reference traces.

A trace is one JSON file of a reference engine's greedy answer (e.g. vLLM's on the real weights):
messages, max_tokens, per-token {token, logprob, top: [{token, logprob}]} and usage, with DFlash counters under
"dflash". Traces this command writes (`--write-traces`) add each token's id and may carry "expect", a list of
answer substrings. Messages a trace omits are rebuilt from `--suite`. Per trace the gate checks:

- prompt: the chat template gives as many prompt tokens as the trace's usage (else the prompts differ and the
  token comparison means nothing);
- top-1: at each position where the reference was confident (top-1 logprob at least `--margin` above the
  runner-up), our greedy token equals the reference's. After a disagreement (confident or not) the engine is
  resynchronised: the reference's tokens so far become the prompt, so later positions are compared on the
  reference's own context, not after our divergence;
- expect: every expected substring is in our answer (special tokens removed);
- dflash: our mean accepted drafts per verify step is at least `--min-acceptance` of the trace's
  (accepted_tokens / drafts; both exclude the bonus token), when decoding speculatively.

It goes through the engine client (runtime/client.py) and the server's chat template, as a chat request would.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import click

from ...runtime.api import EngineConfig
from ...runtime.backend import BackendError, SamplingParams
from ...runtime.options import DraftOptions
from ...runtime.text.prompts import build_messages, load_suite

MAX_RESYNCS = 32  # per trace: bounds the work when an engine disagrees everywhere (a broken one)


class GateError(ValueError):
    """A trace or option the gate cannot use: the message names the file."""


@dataclass
class Check:
    trace: str
    name: str
    status: str  # "pass", "FAIL", "skip"
    detail: str


def load_traces(folder: Path, suite: list[dict] | None = None) -> list[dict]:
    """Every *.json trace in the folder (files holding a list, such as summary.json, are not traces). A trace
    whose messages were omitted (the seed's long-context one) gets them rebuilt from its suite entry."""
    recipes = {e["id"]: e for e in suite or []}
    traces = []
    for path in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GateError(f"{path}: not a readable JSON file ({exc})") from None
        if isinstance(doc, list):
            continue
        if not isinstance(doc, dict) or "messages" not in doc or "max_tokens" not in doc:
            raise GateError(f"{path}: a trace needs messages and max_tokens")
        if not isinstance(doc["messages"], list):
            if doc.get("id") not in recipes:
                raise GateError(
                    f"{path}: its messages were omitted ({str(doc['messages'])[:40]!r}): pass --suite "
                    "with the prompt suite that built them"
                )
            doc["messages"] = build_messages(recipes[doc["id"]])
        for i, entry in enumerate(doc.get("tokens") or []):
            if not isinstance(entry, dict) or "token" not in entry or "logprob" not in entry:
                raise GateError(f"{path}: token {i} needs token and logprob")
        traces.append({**doc, "id": doc.get("id", path.stem)})
    if not traces:
        raise GateError(f"{folder}: no trace files (*.json)")
    return traces


def margin(entry: dict) -> float:
    """Reference top-1 logprob minus the runner-up's (bounded by log(1 - p1) when the trace lists no runner-up)."""
    top = entry.get("top") or [{"logprob": entry["logprob"]}]
    first = top[0]["logprob"]
    rest = math.log1p(-math.exp(first)) if first < 0 else -math.inf
    second = min(top[1]["logprob"], rest) if len(top) > 1 else rest
    return first - second


class Engine:
    """The engine client with the pieces of a chat request: template, tokenizer, stop ids."""

    def __init__(self, config: EngineConfig) -> None:
        from ..cli import open_model

        self.client, self.tokenizer, self.template, gen_cfg = open_model(config)
        eos = gen_cfg.get("eos_token_id", self.client.backend.spec.target.eos_token_id)
        self.stop_ids = frozenset([eos] if isinstance(eos, int) else eos)
        self.speculative_available = self.client.capabilities.speculative
        self._by_text: dict[str, int | None] | None = None

    def prompt(self, messages: list[dict]) -> list[int]:
        text = self.template.render(messages, add_generation_prompt=True, enable_thinking=False)
        return self.tokenizer.encode(text)

    def run(
        self,
        ids: list[int],
        max_tokens: int,
        speculative: bool = False,
        logprobs: int | None = None,
        until: Callable[[list[int]], bool] | None = None,
    ):
        """(token ids, GenerationResult, per-token logprobs or None) of one greedy request; `until(tokens)` true
        aborts it (a resync run stops at its first disagreement instead of generating the rest)."""

        async def go():
            stream = self.client.submit(
                ids, max_tokens, SamplingParams(logprobs=logprobs), self.stop_ids, speculative=speculative
            )
            tokens, lps, result, stopping = [], [], None, False
            async for out in stream:  # drained after an abort too, so the next request finds the engine idle
                if not stopping:
                    tokens += out.token_ids
                    lps += out.logprobs or ()
                    if until is not None and until(tokens):
                        stream.abort()
                        stopping = True
                result = out.result if out.finished else result
            return tokens, result, (lps if logprobs is not None else None)

        return asyncio.run(go())

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def id_of(self, entry: dict) -> int | None:
        """The id of a reference token: its "id", else the one vocabulary entry whose text is the token's."""
        if "id" in entry:
            return int(entry["id"])
        if self._by_text is None:  # built once, on the first resync of a trace without ids
            self._by_text = {}
            for i in range(self.tokenizer.vocab_size):
                s = self.text(i)
                self._by_text[s] = None if s in self._by_text else i  # ambiguous text: no id
        return self._by_text.get(entry["token"])

    def same(self, token_id: int, entry: dict) -> bool:
        return token_id == entry["id"] if "id" in entry else self.text(token_id) == entry["token"]

    def close(self) -> None:
        self.client.close()


def _mismatch(engine: Engine, ref: list[dict], start: int) -> Callable[[list[int]], bool]:
    """until() of a resync run from reference position `start`: true at the first token that differs from the
    reference, or once the reference is used up."""
    seen = 0

    def until(tokens: list[int]) -> bool:
        nonlocal seen
        for j in range(seen, len(tokens)):
            if start + j >= len(ref) or not engine.same(tokens[j], ref[start + j]):
                return True
        seen = len(tokens)
        return start + seen >= len(ref)

    return until


def check_top1(
    engine: Engine, trace: dict, prompt: list[int], first: list[int], min_margin: float, min_agreement: float
) -> Check:
    ref = trace.get("tokens") or []
    if not ref:
        return Check(trace["id"], "top-1", "skip", "the trace has no per-token logprobs")
    # more confident disagreements than this fail whatever follows: stop there (a broken engine is quick to gate)
    allowed = int((1 - min_agreement) * sum(margin(e) >= min_margin for e in ref) + 1e-9)
    prefix, ours, pos, i = [], first, 0, 0
    agree, disagreements, resyncs, stopped = 0, [], 0, None
    while pos < len(ref):
        if i < len(ours) and engine.same(ours[i], ref[pos]):
            agree += margin(ref[pos]) >= min_margin
            prefix.append(ours[i])
            pos, i = pos + 1, i + 1
            continue
        if i >= len(ours):  # we stopped where the reference went on
            stopped = f"ours ended at token {pos} of {len(ref)}"
            break
        if margin(ref[pos]) >= min_margin:
            disagreements.append(
                f"token {pos}: ours {engine.text(ours[i])!r}, reference {ref[pos]['token']!r} "
                f"(margin {margin(ref[pos]):.1f})"
            )
        if len(disagreements) > allowed:
            stopped = f"stopped at token {pos + 1} of {len(ref)}: too many disagreements to pass"
            break
        ref_id = engine.id_of(ref[pos])
        if ref_id is None or resyncs == MAX_RESYNCS:
            stopped = f"compared {pos + 1} of {len(ref)} tokens (" + (
                f"no unique id for {ref[pos]['token']!r})" if ref_id is None else f"{MAX_RESYNCS} resyncs)"
            )
            break
        prefix.append(ref_id)
        pos, resyncs = pos + 1, resyncs + 1
        if pos < len(ref):
            ours, _, _ = engine.run(prompt + prefix, trace["max_tokens"] - pos, until=_mismatch(engine, ref, pos))
            i = 0
    confident = agree + len(disagreements)
    if confident == 0:
        return Check(trace["id"], "top-1", "skip", f"no position with margin >= {min_margin}")
    rate = agree / confident
    detail = f"{agree}/{confident} confident positions agree ({rate:.0%}, {resyncs} resyncs)"
    detail += "".join(f"; {d}" for d in disagreements[:3]) + (f"; {stopped}" if stopped else "")
    return Check(trace["id"], "top-1", "pass" if rate >= min_agreement else "FAIL", detail)


def check_expect(trace: dict, answer: str, extra: list[str]) -> Check:
    wanted = list(trace.get("expect") or []) + extra
    if not wanted:
        return Check(trace["id"], "expect", "skip", "no expected substrings")
    missing = [w for w in wanted if w not in answer]
    if missing:
        return Check(trace["id"], "expect", "FAIL", f"missing {missing} in {answer[:80]!r}")
    return Check(trace["id"], "expect", "pass", f"found {wanted}")


def check_dflash(trace: dict, result, speculative: bool, min_ratio: float) -> Check:
    counters = trace.get("dflash") or {}
    if not speculative:
        return Check(trace["id"], "dflash", "skip", "not decoding speculatively (no drafter, or --no-speculative)")
    if not counters.get("drafts"):
        return Check(trace["id"], "dflash", "skip", "the trace has no DFlash counters")
    steps = result.accepted_lengths
    ours = (sum(steps) - len(steps)) / len(steps) if steps else 0.0  # accepted_lengths count the bonus token
    ref = counters["accepted_tokens"] / counters["drafts"]
    status = "pass" if ours >= min_ratio * ref - 1e-9 else "FAIL"
    return Check(
        trace["id"],
        "dflash",
        status,
        f"accepted per draft {ours:.2f} vs the trace's {ref:.2f} "
        f"({len(steps)} verify steps; needs >= {min_ratio:.0%} of it)",
    )


def gate_trace(
    engine: Engine,
    trace: dict,
    speculative: bool,
    extra: list[str],
    min_margin: float,
    min_agreement: float,
    min_ratio: float,
) -> list[Check]:
    prompt = engine.prompt(trace["messages"])
    checks = []
    usage = (trace.get("usage") or {}).get("prompt_tokens")
    if usage is None:
        checks.append(Check(trace["id"], "prompt", "skip", f"{len(prompt)} tokens; the trace has no usage"))
    else:
        checks.append(
            Check(
                trace["id"],
                "prompt",
                "pass" if usage == len(prompt) else "FAIL",
                f"{len(prompt)} tokens, the trace's {usage}",
            )
        )
    try:
        first, result, _ = engine.run(prompt, trace["max_tokens"], speculative)
    except BackendError as exc:  # e.g. a prompt over --ctx: this trace fails, the others still run
        return checks + [Check(trace["id"], "run", "FAIL", str(exc))]
    checks.append(check_top1(engine, trace, prompt, first, min_margin, min_agreement))
    answer = engine.tokenizer.decode(first, skip_special_tokens=True)
    checks.append(check_expect(trace, answer, extra))
    checks.append(check_dflash(trace, result, speculative, min_ratio))
    return checks


def write_traces(engine: Engine, suite: list[dict], out: Path, filler_repeats: int | None) -> list[Path]:
    """Reference traces of this engine for a suite (greedy, top-5 logprobs, DFlash counters when it has a
    drafter), in the shared traces' shape plus token ids; a suite entry's "expect" is carried over."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for entry in suite:
        messages = build_messages(entry, filler_repeats)
        prompt = engine.prompt(messages)
        ids, _, lps = engine.run(prompt, entry["max_tokens"], logprobs=5)
        tokens = [
            {
                "token": engine.text(t),
                "id": t,
                "logprob": lp,
                "top": [{"token": engine.text(k), "id": k, "logprob": v} for k, v in top],
            }
            for t, (lp, top) in zip(ids, lps)
        ]
        trace = {
            "id": entry["id"],
            "category": entry.get("category"),
            "messages": messages,
            "max_tokens": entry["max_tokens"],
            "content": engine.tokenizer.decode(ids, skip_special_tokens=True),
            "n_completion_tokens": len(ids),
            "tokens": tokens,
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(ids),
                "total_tokens": len(prompt) + len(ids),
            },
        }
        if entry.get("expect"):
            trace["expect"] = entry["expect"]
        if engine.speculative_available:
            _, result, _ = engine.run(prompt, entry["max_tokens"], speculative=True)
            steps = result.accepted_lengths
            per_step = engine.client.backend.spec.drafter.block_size - 1
            accepted = sum(steps) - len(steps)
            trace["dflash"] = {
                "drafts": len(steps),
                "draft_tokens": per_step * len(steps),
                "accepted_tokens": accepted,
                "mean_accepted_per_draft": accepted / len(steps) if steps else 0.0,
                "draft_acceptance_rate": accepted / (per_step * len(steps)) if steps else 0.0,
            }
        path = out / f"{entry['id']}.json"
        path.write_text(json.dumps(trace, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        written.append(path)
    return written


def _table(checks: list[Check]) -> str:
    rows = [("trace", "check", "result", "detail")] + [(c.trace, c.name, c.status, c.detail) for c in checks]
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    return "\n".join("  ".join(r[k].ljust(widths[k]) for k in range(3)) + "  " + r[3] for r in rows)


@click.command("gate")
@click.option(
    "--model",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Checkpoint folder (the drafter in MODEL/dflash unless --draft).",
)
@click.option(
    "--traces",
    "traces_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder of reference traces, one JSON file each.",
)
@click.option("--backend", type=click.Choice(["reference", "cuda"]), default="cuda", show_default=True)
@click.option("--draft", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None)
@click.option("--ctx", type=click.IntRange(min=2), default=None, help="Context (default: the model's, <= 65536).")
@click.option("--kv-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True)
@click.option(
    "--speculative/--no-speculative",
    default=None,
    help="Decode with DFlash and check acceptance (default: when the engine has a drafter).",
)
@click.option(
    "--expect",
    "expect_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='JSON {"trace id": ["substring", ...]}: expected answer substrings beyond the traces\' own.',
)
@click.option(
    "--margin",
    "min_margin",
    type=click.FloatRange(min=0),
    default=2.0,
    show_default=True,
    help="A reference position is confident when its top-1 logprob leads the runner-up by this much.",
)
@click.option(
    "--min-agreement",
    type=click.FloatRange(0, 1),
    default=0.9,
    show_default=True,
    help="Share of confident positions whose greedy token must agree.",
)
@click.option(
    "--min-acceptance",
    "min_ratio",
    type=click.FloatRange(min=0),
    default=0.8,
    show_default=True,
    help="Accepted drafts per verify step, as a share of the trace's.",
)
@click.option(
    "--suite",
    "suite_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Prompt suite (the JSON shape of docs/prompt_suite.json): rebuilds the messages a trace omits.",
)
@click.option(
    "--write-traces",
    "write_traces_",
    is_flag=True,
    help="Instead of gating: write this engine's traces of --suite's prompts into --traces.",
)
@click.option(
    "--filler-repeats",
    type=click.IntRange(min=1),
    default=None,
    help="With --write-traces: filler lines of the suite's needle prompts (smaller for a short --ctx).",
)
def gate(
    model: Path,
    traces_dir: Path,
    backend: str,
    draft: Path | None,
    ctx: int | None,
    kv_dtype: str,
    speculative: bool | None,
    expect_file: Path | None,
    min_margin: float,
    min_agreement: float,
    min_ratio: float,
    suite_file: Path | None,
    write_traces_: bool,
    filler_repeats: int | None,
) -> None:
    """Check greedy continuations against reference traces; a pass/fail table, exit code 1 on any failure."""
    if write_traces_ and suite_file is None:
        raise click.UsageError("--write-traces needs --suite FILE")
    try:
        suite = load_suite(suite_file) if suite_file else None
        traces = None if write_traces_ else load_traces(traces_dir, suite)
        extra = json.loads(expect_file.read_text()) if expect_file else {}
        if not isinstance(extra, dict):
            raise GateError(f'{expect_file}: expected {{"trace id": [substrings]}}')
    except (ValueError, OSError) as exc:  # GateError, the suite's ValueError, a bad --expect file
        raise click.ClickException(str(exc)) from None
    try:
        # every verify step drafts the whole block: the acceptance is the drafter's, as the traces count it
        engine = Engine(EngineConfig(model, backend, ctx, kv_dtype, draft, drafts=DraftOptions(adaptive=False)))
    except (BackendError, OSError, ValueError) as exc:
        raise click.ClickException(f"{model}: {exc}") from None
    try:
        if speculative and not engine.speculative_available:
            raise click.ClickException(f"{model}: no drafter (pass --draft DIR or --no-speculative)")
        if write_traces_:
            written = write_traces(engine, suite, traces_dir, filler_repeats)
            click.echo(f"wrote {len(written)} traces to {traces_dir}")
            return
        spec = engine.speculative_available if speculative is None else speculative
        checks = []
        for n, trace in enumerate(traces, 1):
            click.echo(f"[{n}/{len(traces)}] {trace['id']}", err=True)  # a real-weights run takes minutes
            checks += gate_trace(
                engine, trace, spec, list(extra.get(trace["id"], [])), min_margin, min_agreement, min_ratio
            )
    except BackendError as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        engine.close()
    click.echo(_table(checks))
    failed = [c for c in checks if c.status == "FAIL"]
    skipped = sum(c.status == "skip" for c in checks)
    click.echo(
        f"\n{len(traces)} traces, {len(checks)} checks: {len(checks) - len(failed) - skipped} passed, "
        f"{len(failed)} failed, {skipped} skipped"
    )
    if failed:
        raise SystemExit(1)
