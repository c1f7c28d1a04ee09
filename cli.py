"""The `thorgen` command line: one click group whose commands live beside the pipeline stage they drive."""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute"; imported only when the command runs (or `--help` lists it), so `thorgen --help`
# stays fast and a stage's optional dependencies (fastapi, cuda-python) load only for its own commands.
COMMANDS = {
    "synth-checkpoint": "thorgen.model_spec.synth.cli:synth_checkpoint",
    "build": "thorgen.codegen.cli:build",
    "repack-weights": "thorgen.runtime.convert.cli:repack_weights",
    "prepare": "thorgen.prepare:prepare",
    "generate": "thorgen.runtime.generate:generate",
    "bench": "thorgen.runtime.bench.cli:bench",
    "serve": "thorgen.serve.cli:serve",
    "chat": "thorgen.serve.tools.chat:chat",
    "cluster": "thorgen.serve.cluster.cli:cluster",
    "gate": "thorgen.serve.tools.gate:gate",
}

# Subcommands that live in a later stage than their group (`bench serve` and `bench soak` are HTTP clients: the serve
# stage).
SUBCOMMANDS = {
    "bench": {
        "kernels": "thorgen.runtime.bench.kernels:kernels_bench",
        "serve": "thorgen.runtime.bench.serve_cli:bench_serve",
        "soak": "thorgen.runtime.bench.soak:bench_soak",
        "sweep": "thorgen.runtime.bench.sweep:sweep",
        "report": "thorgen.runtime.bench.report:report",
    }
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        try:
            command = getattr(importlib.import_module(module), attr)
            for sub_name, sub_target in SUBCOMMANDS.get(name, {}).items():
                sub_module, sub_attr = sub_target.split(":")
                try:
                    command.add_command(getattr(importlib.import_module(sub_module), sub_attr), sub_name)
                except ImportError:  # its stage's optional dependencies are missing: the parent still works
                    pass
            return command
        except (ImportError, AttributeError) as exc:  # a stage not built yet, or a missing optional dependency
            reason = str(exc)  # `exc` itself is unbound once the except block ends

            @click.command(name=name, help=f"(unavailable: {reason})")
            def unavailable() -> None:
                raise click.ClickException(f"`thorgen {name}` is unavailable: {reason}")

            return unavailable


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="thorgen")
def main() -> None:
    """thorgen: compiled Gemma-4-26B-A4B-it inference (NVFP4 + DFlash) and an OpenAI-compatible server."""


if __name__ == "__main__":
    main()
