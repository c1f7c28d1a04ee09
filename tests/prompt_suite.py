"""Test support (not a test module): the 18-prompt suite (`../shared/seed_data/prompt_suite.json`) as token ids,
rendered through a checkpoint's own chat template and tokenizer.

Rendering goes through runtime/text/prompts.py (jinja2 and the tokenizer only: serve's imports need pydantic, which
is not on every GPU box); entries without "messages" are built by its needle recipe (MODEL_FACTS §5.3). The
suite's filler_repeats (400: ~55k tokens with the tiny checkpoint's tokenizer, 137 tokens a repeat) exceeds the
tiny preset's context, so callers pass a smaller count (`filler_repeats=`).
"""

from __future__ import annotations

from pathlib import Path

from thorgen.runtime.text.prompts import PromptRenderer, load_suite


def suite_prompts(model_dir: Path, shared_dir: Path, filler_repeats: int) -> list[tuple[str, list[int]]]:
    """[(prompt id, token ids)] for every suite entry, in file order."""
    renderer = PromptRenderer(model_dir)
    suite = load_suite(shared_dir / "seed_data" / "prompt_suite.json")
    return [(p["id"], renderer.entry_ids(p, filler_repeats)) for p in suite]
