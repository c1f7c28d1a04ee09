"""Runtime stage: the text view of a `thorgen bench` report: what it prints without --json, from the report's JSON
(so a saved report prints the same)."""

from __future__ import annotations

from .image_report import has_images, image_text
from .video import video_text


def bench_text(r: dict) -> str:
    """The text view of a `thorgen bench` report (what it prints without --json)."""
    lines = [
        f"{r['backend']} on {r['gpu']}: {r['model']} prompt {r['prompt_len']} gen {r['gen']} x{r['runs']}",
        f"  weights         {r.get('weights_format', 'not recorded')}",
        f"  load            {r['load_s']:.2f} s (ready, after a {min(r['gen'], 4)}-token warm-up: "
        f"{r.get('ready_s', float('nan')):.2f} s)",
        f"  TTFT            {r['ttft_ms']:.1f} ms (median)",
        f"  decode          {r['decode_tok_s']:.2f} tok/s (median), step {r['step_ms']} ms",
        f"  weights/step    {r['weight_bytes_per_step'] / 1e9:.3f} GB (lm_head {r['lm_head']}) -> "
        f"{r['achieved_gb_s']:.1f} GB/s = {100 * r['fraction_of_copy']:.1f}% of {r['copy_probe']} "
        f"({r['copy_gb_s']:.1f} GB/s)",
        f"  peak GPU memory {r['peak_gpu_mem_gib']} GiB, host peak RSS {r['host_peak_rss_gib']} GiB",
    ]
    if has_images(r):
        lines.append(image_text(r))
    if r.get("video"):
        lines.append(video_text(r))
    if r.get("sms") is not None:
        lines.insert(
            1,
            f"  multiprocessors {r['sms']} of {r['device_sms']} (--sms {r['sms_requested']}: a green "
            "context; decode and the copy probe both ran on them)",
        )
    if r.get("peer"):
        p = r["peer"]
        lines.append(
            f"  peer            {p['peer']} ({p['dtype']}, {p['device']}, static cache"
            f"{', torch.compile' if p['compiled'] else ''}, experts {p.get('experts', 'eager')}): "
            f"{p['decode_tok_s']:.2f} tok/s, TTFT {p['ttft_ms']:.1f} ms -> ours: {p['decode_ratio']}x its "
            f"decode, its TTFT / ours {p['ttft_ratio']}x"
        )
    if r.get("speculative"):
        s = r["speculative"]
        lines.append(
            f"  speculative     {s['spec_tok_s']} tok/s (median), tau {s['tau']}, step {s['step_ms']} ms "
            f"(draft {s['draft_step_ms']} ms + verify {s['verify_step_ms']} ms on the GPU)"
            + (f"; EMULATED acceptance {s['emulated_acceptance']}" if s["emulated_acceptance"] is not None else "")
        )
    for key, title in (
        ("decode_step_kernels", "decode step, per kernel (its launches replayed as one graph)"),
        ("draft_step_kernels", "DFlash draft forward, per kernel (eager launches, event-timed)"),
        ("verify_step_kernels", "DFlash verify forward + drafter context, per kernel (eager, event-timed)"),
        (
            "prefill_chunk_kernels",
            f"prefill chunk of {r.get('prefill_chunk_rows')} tokens, per kernel (eager launches, event-timed)",
        ),
    ):
        ks = r.get(key) or []
        if ks:
            lines.append(f"  {title}; sum {sum(k['us'] for k in ks):.0f} us:")
        for k in ks:
            lines.append(f"    {k['kernel']:<56} {k['us']:9.1f} us x{k.get('count', 1)}")
    for step, e in (r.get("roofline") or {}).items():
        tc = "n/a" if e["frac_tc"] is None else f"{100 * e['frac_tc']:.2f}%"
        lines.append(
            f"  roofline {step:<8} {e['bytes'] / 1e6:10.1f} MB {e['flops'] / 1e9:10.2f} GFLOP "
            f"{e['ms']:9.3f} ms: {100 * e['frac_copy']:.1f}% of copy, {tc} of tensor cores"
        )
    return "\n".join(lines)
