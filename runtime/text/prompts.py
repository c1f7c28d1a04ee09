"""Prompt-suite files (docs/prompt_suite.json's JSON shape) and the checkpoint's
own jinja chat template, rendered to prompt token ids for `thorgen bench --suite`, `bench serve` and the tests.

A suite entry has "id", "category", "max_tokens", optional "tools" (OpenAI function tools, passed to the template)
and either "messages" or a build recipe. The one recipe, "_build": "needle" (MODEL_FACTS §5.3), hides a needle
sentence in the middle of `filler_repeats` filler lines and asks a question about it. An optional
"prompt_tokens" asks for the filler to be sized with the model's own tokenizer so that the rendered prompt has
at most that many tokens (`filler_for_tokens`); a client without the tokenizer uses `filler_repeats`.
The template environment is the one transformers' apply_chat_template uses, so a template renders identically.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Callable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

FILLER_LINE = "This is filler context line for retrieval testing. " * 4 + "\n"


# ---- suite files ------------------------------------------------------------------------------------------------


def load_suite(path: str | Path) -> list[dict]:
    """The entries of a suite file; ValueError naming the file and entry when one is malformed."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the prompt suite ({exc})") from None
    entries = doc.get("prompts") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'{path}: no prompts (expected {{"prompts": [...]}})')
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "id" not in entry or ("messages" not in entry and "_build" not in entry):
            raise ValueError(f"{path}: entry {i} needs an id and messages (or a _build recipe)")
        if entry.get("_build") == "needle" and not all(k in entry for k in ("needle", "question", "filler_repeats")):
            raise ValueError(f"{path}: needle entry {entry['id']!r} needs needle, question and filler_repeats")
    return entries


def build_messages(entry: dict, filler_repeats: int | None = None) -> list[dict]:
    """The chat messages of one suite entry; `filler_repeats` overrides the needle prompt's repeat count."""
    if "messages" in entry:
        return entry["messages"]
    if entry.get("_build") != "needle":
        raise ValueError(f"prompt {entry.get('id')!r}: no messages and no known _build recipe")
    filler = FILLER_LINE * (entry["filler_repeats"] if filler_repeats is None else filler_repeats)
    half = len(filler) // 2
    content = filler[:half] + "\n" + entry["needle"] + "\n" + filler[half:] + "\n\nQuestion: " + entry["question"]
    return [{"role": "user", "content": content}]


def filler_for_tokens(entry: dict, target: int, count: Callable[[int], int]) -> int:
    """The most filler repeats r with count(r) <= target, where count(r) is the prompt's token count with r
    repeats; ValueError when even the bare question is longer. Token counts grow by about the same amount per
    repeat, so a linear guess from two probes lands within a repeat or two; the loop then walks to the edge."""
    count = functools.lru_cache(maxsize=None)(count)  # each probe renders and tokenizes up to a long prompt
    base = count(0)
    if base > target:
        raise ValueError(f"prompt {entry['id']!r}: {base} tokens without filler exceed prompt_tokens {target}")
    probe = 64
    per = max(1e-9, (count(probe) - base) / probe)
    r = max(0, int((target - base) / per))
    while r > 0 and count(r) > target:
        r -= 1
    while count(r + 1) <= target:
        r += 1
    return r


# ---- chat templates ---------------------------------------------------------------------------------------------


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def template_environment() -> ImmutableSandboxedEnvironment:
    """The environment transformers' apply_chat_template uses, so a template renders identically in both."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_chat_template(model_dir: Path, embedded: str | None = None) -> tuple[str, str]:
    """(template source, bos token) from chat_template.jinja or tokenizer_config.json of a checkpoint."""
    bos = "<bos>"
    cfg_path = model_dir / "tokenizer_config.json"
    source = embedded
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        b = cfg.get("bos_token")
        bos = b.get("content", bos) if isinstance(b, dict) else (b or bos)
        if source is None and isinstance(cfg.get("chat_template"), str):
            source = cfg["chat_template"]
    jinja_path = model_dir / "chat_template.jinja"
    if source is None and jinja_path.exists():
        source = jinja_path.read_text()
    if source is None:
        raise FileNotFoundError(f"{model_dir}: no chat_template.jinja and no chat_template in tokenizer_config.json")
    return source, bos


class PromptRenderer:
    """Suite entries -> prompt token ids through one checkpoint's template and tokenizer."""

    def __init__(
        self, model_dir: Path, embedded_template: str | None = None, tokenizer_path: Path | None = None
    ) -> None:
        from .tokenizer import Tokenizer

        source, self.bos = load_chat_template(Path(model_dir), embedded_template)
        self.template = template_environment().from_string(source)
        self.tokenizer = Tokenizer.from_file(tokenizer_path or Path(model_dir) / "tokenizer.json")

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=True, bos_token=self.bos)

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.tokenizer.encode(self.render(messages, tools))

    def entry_ids(self, entry: dict, filler_repeats: int | None = None) -> list[int]:
        """The prompt ids of one entry; a needle entry with "prompt_tokens" (and no override) is sized to it."""
        tools = entry.get("tools")
        if filler_repeats is None and entry.get("_build") == "needle" and "prompt_tokens" in entry:
            filler_repeats = filler_for_tokens(
                entry, int(entry["prompt_tokens"]), lambda r: len(self.encode(build_messages(entry, r), tools))
            )
        return self.encode(build_messages(entry, filler_repeats), tools)
