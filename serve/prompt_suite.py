"""Serve stage: prompt-suite files (the JSON shape of ../shared/seed_data/prompt_suite.json) as chat messages.

An entry has "id", "category", "max_tokens" and either "messages" or a build recipe. The one recipe,
"_build": "needle" (MODEL_FACTS §5.3), hides a needle sentence in the middle of `filler_repeats` filler lines
and asks a question about it; callers with a small context pass fewer repeats.
"""

from __future__ import annotations

import json
from pathlib import Path

FILLER_LINE = "This is filler context line for retrieval testing. " * 4 + "\n"


def load_suite(path: str | Path) -> list[dict]:
    """The entries of a suite file; ValueError naming the file and entry when one is malformed."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the prompt suite ({exc})") from None
    entries = doc.get("prompts") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: no prompts (expected {{\"prompts\": [...]}})")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "id" not in entry or ("messages" not in entry and "_build" not in entry):
            raise ValueError(f"{path}: entry {i} needs an id and messages (or a _build recipe)")
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
