"""Renders docs/cli.md from the `thorgen` click group: `python tests/cli_docs.py > docs/cli.md` rewrites it.

Test support, not a test module: tests/test_docs_cli.py compares docs/cli.md with `render()`. Everything comes from
the click commands (usage, help text, options with click's own default and range notes, in their declared order),
so nothing depends on the terminal's width; the few hand-written lines are the intro and ENVIRONMENT.
"""

from __future__ import annotations

import inspect
import re

import click

# THORGEN_* variables the package reads; tests/test_docs_cli.py checks that the source names exactly these.
ENVIRONMENT = {
    "THORGEN_API_KEY": "API key of `thorgen serve` and `thorgen cluster` (as `--api-key`), sent by `thorgen chat`, "
    "`thorgen bench serve` and `thorgen bench soak`",
    "THORGEN_CACHE_DIR": "cubin cache, repacked weights of read-only model folders, the demo model (default "
    "`~/.cache/thorgen`)",
    "THORGEN_KERNELS": "built kernels folder the cuda backend loads when `--kernel-dir` is not given (default "
    "`./thorgen-build/<model>/<arch>`, then `MODEL/thorgen-build/<arch>` after `thorgen prepare`)",
    "THORGEN_NVCC": "the nvcc `thorgen build` runs (default: `nvcc` on PATH, then `$CUDA_HOME`, `/usr/local/cuda`, "
    "the nvidia-cuda-nvcc wheel)",
}

INTRO = """\
# Command line

<!-- Generated from the click commands by tests/cli_docs.py; edit their help, then run
     `python tests/cli_docs.py > docs/cli.md` (tests/test_docs_cli.py fails while this file is stale). -->

Every `thorgen` command with its options, as `thorgen COMMAND --help` (or `-h`) prints them.
[serving.md](serving.md) explains the server's and the cluster's options; the README has a quickstart."""

CODE_SPAN = re.compile(r"(`[^`]*`)")


def markdown(text: str, cell: bool = False) -> str:
    """Help text as markdown: `<` and `*` escaped outside code spans (so `<arch>` is not read as HTML), and in a
    table cell every `|` escaped (GitHub splits cells on a bare `|`, even inside a code span)."""
    parts = CODE_SPAN.split(" ".join(text.split()))
    text = "".join(p if CODE_SPAN.fullmatch(p) else re.sub(r"([\\<*])", r"\\\1", p) for p in parts)
    return text.replace("|", r"\|") if cell else text


def paragraphs(help_text: str | None) -> list[str]:
    """A command's help as click reads it (indentation removed, cut at a form feed), one string per paragraph."""
    text = inspect.cleandoc(help_text or "").split("\f", 1)[0]
    return [markdown(p) for p in re.split(r"\n\s*\n", text) if p.strip()]


def option_rows(command: click.Command, ctx: click.Context) -> list[str]:
    rows = []
    for param in command.params:  # (the help option is not among them: it is the same everywhere)
        record = param.get_help_record(ctx)
        if record is not None:
            names, help_text = record
            names = names.replace("|", r"\|")  # a code span: nothing else to escape
            if isinstance(param, click.Option) and param.envvar and not param.show_envvar:
                help_text += f" [env var: {param.envvar}]"
            rows.append(f"| `{names}` | {markdown(help_text, cell=True)} |")
    return rows


def command_section(command: click.Command, ctx: click.Context) -> list[str]:
    usage = " ".join([ctx.command_path, *command.collect_usage_pieces(ctx)])
    lines = [f"## `{ctx.command_path}`", "", "```", usage, "```", ""]
    for paragraph in paragraphs(command.help):
        lines += [paragraph, ""]
    rows = option_rows(command, ctx)
    if rows:
        lines += ["| option | meaning |", "|---|---|", *rows, ""]
    if isinstance(command, click.Group):
        lines += ["| command | what it does |", "|---|---|"]
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            anchor = f"{ctx.command_path} {name}".replace(" ", "-")
            short = markdown(sub.get_short_help_str(limit=1000), cell=True)
            lines.append(f"| [`{ctx.command_path} {name}`](#{anchor}) | {short} |")
        lines.append("")
    return lines


def walk(command: click.Command, ctx: click.Context) -> list[str]:
    """This command's section, then each subcommand's in the group's order, depth first."""
    lines = command_section(command, ctx)
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            lines += walk(sub, click.Context(sub, info_name=name, parent=ctx))
    return lines


def environment_section() -> list[str]:
    lines = [
        "## Environment variables",
        "",
        "Where the build and the tools find things; none changes what the engine computes.",
        "",
        "| variable | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {markdown(meaning, cell=True)} |" for name, meaning in sorted(ENVIRONMENT.items())]
    return lines + [""]


def render() -> str:
    from thorgen.cli import main

    lines = [INTRO, "", *walk(main, click.Context(main, info_name="thorgen")), *environment_section()]
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
