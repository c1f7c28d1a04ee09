"""Device-probe helper: summarise ncu_step.py's two ncu CSVs (`--set full --page details`, and `--section
WarpStateStats --page raw`) into the JSON beside it (h200-ncu-decode-step.json; h200-ncu-speculative-step.json from the
sections SpeedOfLight, LaunchStats, Occupancy, WarpStateStats and MemoryWorkloadAnalysis).

    python3 ncu_summary.py details.csv raw.csv out.json
"""

import csv
import json
import sys


def rows(path):
    """ncu's CSV rows (its own log lines, not quoted, dropped)."""
    with open(path) as f:
        return [line for line in f if line.startswith('"')]


def stall_shares(raw_path):
    """{kernel: the five largest warp-stall sample shares} from the raw page."""
    table = list(csv.reader(rows(raw_path)))
    head, out = table[0], {}
    for r in table[2:]:  # row 1 holds the units
        counts = {}
        for h, v in zip(head, r):
            # the sampled stall counts, or (WarpStateStats alone) the average stalled warps per issue
            if "pcsamp_warps_issue_stalled" in h and not h.endswith("not_issued"):
                name = h.replace("smsp__pcsamp_warps_issue_stalled_", "")
            elif h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio"):
                name = h[len("smsp__average_warps_issue_stalled_") : -len("_per_issue_active.ratio")]
            else:
                continue
            try:
                counts[name] = float(v.replace(",", ""))
            except ValueError:
                pass
        total = sum(counts.values()) or 1.0
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
        out[r[head.index("Kernel Name")]] = {k: round(v / total, 3) for k, v in top}
    return out


def main(details_path, raw_path, out_path):
    metrics = {}
    for r in csv.DictReader(rows(details_path)):
        try:
            value = float(r["Metric Value"].replace(",", ""))
        except ValueError:  # the text-valued metrics (policies, names)
            continue
        metrics.setdefault(r["Kernel Name"], {})[r["Metric Name"]] = value
    stalls = stall_shares(raw_path)
    kernels = [
        {
            "kernel": name,
            "us": m["Duration"] / 1e3,
            "dram_pct": m["DRAM Throughput"],
            "grid": int(m["Grid Size"]),
            "block": int(m["Block Size"]),
            "regs": int(m["Registers Per Thread"]),
            "achieved_occupancy_pct": m["Achieved Occupancy"],
            "elapsed_cycles": m["Elapsed Cycles"],
            "sm_active_cycles": m["SM Active Cycles"],
            "stall_top": stalls.get(name),
        }
        for name, m in metrics.items()
    ]
    json.dump({"kernels": kernels}, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:4])
