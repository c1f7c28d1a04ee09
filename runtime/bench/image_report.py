"""Runtime stage (benchmark report): the image entries of `thorgen bench --image` runs, one per soft-token budget
(`images`; runs from before budgets were listed hold one `image`), as the bench's text lines and as the `image`
view's markdown table."""

from __future__ import annotations

from pathlib import Path

from .tables import fmt, run_line, table


def image_entries(run: dict) -> list[dict]:
    """The run's image entries in budget order: `images`, or the one `image` of an older run."""
    entries = run.get("images") or ([run["image"]] if run.get("image") else [])
    return sorted(entries, key=lambda e: e["budget"])


def has_images(run: dict) -> bool:
    return bool(run.get("images") or run.get("image"))


def _encode(entry: dict) -> str:
    return "n/a (no tower exposed)" if entry.get("encode_ms") is None else f"{entry['encode_ms']:.1f} ms"


def image_text(run: dict) -> str:
    """The bench's text lines: the image once, then a line per budget."""
    entries = image_entries(run)
    first = entries[0]
    lines = [
        f"  image           {first['file']} {first['width']}x{first['height']} ahead of the "
        f"{run.get('prompt_len', '?')}-token text prompt (medians; TTFT includes the encode)"
    ]
    for e in entries:
        lines.append(
            f"    budget {e['budget']:>4}     {e['soft_tokens']} soft tokens ({e['patches']} patches, "
            f"{e['prompt_tokens']} prompt tokens): preprocess {e['preprocess_ms']:.1f} ms, encode {_encode(e)}, "
            f"TTFT {e['ttft_ms']:.1f} ms, decode {e['decode_tok_s']:.2f} tok/s"
        )
        ks = e.get("encode_kernels") or []
        if ks:
            total = sum(k["us"] for k in ks)
            lines.append(f"      vision tower, per kernel (eager launches, event-timed); sum {total:.0f} us:")
        lines += [f"        {k['kernel']:<52} {k['us']:9.1f} us x{k.get('count', 1)}" for k in ks]
    return "\n".join(lines)


def image_view(names: list[str], runs: dict, ctx: object) -> str:
    """One row per run and budget: soft tokens (patches), preprocess, encode, TTFT of image + text, decode."""
    rows = []
    for name in names:
        run = runs[name]
        entries = image_entries(run)
        if not entries:
            raise KeyError("images")
        for e in entries:
            rows.append(
                [
                    f"`{Path(name).stem}`",
                    f"{e['file']} {e['width']}x{e['height']}",
                    str(e["budget"]),
                    f"{e['soft_tokens']:,} ({e['patches']:,})",
                    f"{fmt(e['preprocess_ms'])} ms",
                    "n/a" if e.get("encode_ms") is None else f"{fmt(e['encode_ms'])} ms",
                    f"{fmt(e['ttft_ms'])} ms",
                    f"{fmt(e.get('decode_tok_s'))} tok/s",
                ]
            )
    header = [
        "run",
        "image",
        "budget",
        "soft tokens (patches)",
        "preprocess (CPU)",
        "encode",
        "TTFT, image + text",
        "decode after the image",
    ]
    prompts = {runs[n].get("prompt_len") for n in names}
    text = f"a {prompts.pop()}-token text prompt" if len(prompts) == 1 else "each run's text prompt"
    note = f"The image ahead of {text}; encode is the tower alone (the encoder cache off), TTFT covers encode and "
    note += "prefill; medians."
    return "\n\n".join([table(header, rows), note, "\n".join(f"- {run_line(n, runs[n])}" for n in names)])


def serve_image_note(run: dict) -> str | None:
    """What a `thorgen bench serve --image` run sent, for the serve view; None for a text-only run."""
    image = run.get("image")
    if not image:
        return None
    budget = f"budget {image['budget']}" if image.get("budget") else "the server's budget"
    what = "the same bytes every time (the cache-hit path)" if image.get("same_image") else "a fresh variant each"
    if image.get("arrivals"):
        return (
            f"Image arrivals: beside each level's text streams, one client sent one-token chats of {image['file']} "
            f"{image['width']}x{image['height']} ({budget}, {what}) back to back; the level also ran without them."
        )
    return f"Every request a chat of {image['file']} {image['width']}x{image['height']} ({budget}, {what}) + text."


def serve_image_columns(levels: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The serve view's extra columns for image arrivals (none without): the streams' inter-token latency without
    images, and the image requests' count and TTFT."""
    if not any("without_images" in lv for lv in levels):
        return [], [[] for _ in levels]
    cells = []
    for lv in levels:
        alone = lv.get("without_images") or {}
        cells.append(
            [
                f"{fmt(alone.get('itl_ms_p50'), 2)} / {fmt(alone.get('itl_ms_p99'), 2)} ms" if alone else "",
                f"{lv.get('image_requests', '')}: {fmt(lv.get('image_ttft_ms_p50'))} / "
                f"{fmt(lv.get('image_ttft_ms_p99'))} ms"
                if "image_requests" in lv
                else "",
            ]
        )
    return ["inter-token p50 / p99 without images", "image arrivals: TTFT p50 / p99"], cells
