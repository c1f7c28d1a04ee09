"""Runtime stage (benchmark report): the number formats, markdown tables and run lines every report view shares."""

from __future__ import annotations


def fmt(value, digits: int = 1, scale: float = 1.0) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def ms(value) -> str:
    """Latencies: one decimal below 100 ms, whole milliseconds above (the spread is larger than the decimal)."""
    return "" if value is None else (f"{value:.1f}" if value < 100 else f"{value:.0f}")


def pct(fraction, digits: int = 1) -> str:
    return "" if fraction is None else f"{100 * fraction:.{digits}f}%"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def provenance(run: dict) -> str:
    """Machine, date and commit of a run: what NOTES.md's `<!-- run ... -->` lines add to the JSON's own fields."""
    bits = [str(run.get("gpu") or run.get("device") or "machine not recorded")]
    if run.get("arch") and run["arch"] not in bits[0]:
        bits[0] += f" ({run['arch']})"
    if run.get("date"):
        bits.append(str(run["date"])[:10])
    if run.get("commit"):
        bits.append(f"commit {run['commit']}")
    return ", ".join(bits)


def run_line(name: str, run: dict) -> str:
    line = f"Run: {provenance(run)} (`docs/benchmarks/{name}`)"
    return line + (f": `{run['command']}`" if run.get("command") else "")


class ReportError(ValueError):
    """A run or the notes cannot be rendered: the message names the file and what is wrong."""


def load_plots():
    """matplotlib loads only when a view draws (the `bench` extra); a missing one is a clear error."""
    try:
        from . import plots
    except ImportError as exc:
        raise ReportError(f'the plots need matplotlib: pip install -e ".[bench]" ({exc})') from None
    return plots
