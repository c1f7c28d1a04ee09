"""Test support (not a test module): the 18-prompt suite (`../shared/seed_data/prompt_suite.json`) as token ids,
rendered through a checkpoint's own chat template and tokenizer.

The template is rendered with jinja2 directly (the same sandboxed environment as serve/chat_template.py), not
through serve/chat_template.py, whose imports need pydantic (not on every GPU box). Entries without "messages"
are built by serve/prompt_suite.py's build_messages (MODEL_FACTS §5.3's needle recipe). The suite's
filler_repeats (400: ~55k tokens with the tiny checkpoint's tokenizer, 137 tokens a repeat) exceeds the tiny
preset's context, so callers pass a smaller count (`filler_repeats=`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from thorgen.serve.prompt_suite import build_messages


def render(model_dir: Path, messages: list[dict]) -> str:
    """The checkpoint's chat template (chat_template.jinja, else tokenizer_config.json) with a generation prompt."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    bos = cfg.get("bos_token") or "<bos>"
    bos = bos.get("content", "<bos>") if isinstance(bos, dict) else bos
    jinja_path = model_dir / "chat_template.jinja"
    source = jinja_path.read_text() if jinja_path.is_file() else cfg.get("chat_template")
    if not isinstance(source, str):
        raise FileNotFoundError(f"{model_dir}: no chat template")

    def _raise(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source).render(messages=messages, tools=None, add_generation_prompt=True, bos_token=bos)


def suite_prompts(model_dir: Path, shared_dir: Path, filler_repeats: int) -> list[tuple[str, list[int]]]:
    """[(prompt id, token ids)] for every suite entry, in file order."""
    from thorgen.runtime.tokenizer import Tokenizer

    suite = json.loads((shared_dir / "seed_data" / "prompt_suite.json").read_text())["prompts"]
    tok = Tokenizer.from_file(model_dir / "tokenizer.json")
    return [(p["id"], tok.encode(render(model_dir, build_messages(p, filler_repeats)))) for p in suite]
