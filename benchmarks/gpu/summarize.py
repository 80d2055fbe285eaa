"""Markdown table of the decode-attention micro-benchmarks (pytest-benchmark JSON), paged
against contiguous at each context length, with the issue's targets checked.

Usage: ``python benchmarks/gpu/summarize.py BENCH.json`` (prints Markdown).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# Targets at long contexts: paged decode reads KV at >= 80% of peak HBM bandwidth and costs
# at most 10% more time than contiguous.
LONG_CONTEXT = 4096
MIN_PCT_OF_PEAK = 80.0
MAX_OVERHEAD_PCT = 10.0


def summarize(report: dict) -> str:
    rows = [b for b in report["benchmarks"] if "pct_of_peak_hbm" in b["extra_info"]]
    if not rows:
        return "No decode-attention benchmarks in the report.\n"
    contiguous = {
        b["extra_info"]["context"]: b["extra_info"]["device_us"]
        for b in rows
        if b["extra_info"]["layout"] == "contiguous"
    }
    first = rows[0]["extra_info"]
    lines = [
        f"Decode attention, {first['model']} layer shapes, {first['dtype']}, batch "
        f"{first['batch']}, on {first['gpu']} (peak HBM "
        f"{first['peak_hbm_bytes_per_s'] / 1e12:.2f} TB/s)",
        "",
        "| context | layout | kernel µs | wall µs (call + sync, median) | KV read GB/s "
        "| % of peak HBM | vs contiguous |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    missed: list[str] = []
    for b in sorted(rows, key=_order):
        x = b["extra_info"]
        base = contiguous.get(x["context"])
        paged = x["layout"] != "contiguous"
        overhead = 100 * (x["device_us"] / base - 1) if base and paged else None
        lines.append(
            f"| {x['context']} | {x['layout']} | {x['device_us']:.1f} "
            f"| {b['stats']['median'] * 1e6:.1f} | {x['kv_read_bytes_per_s'] / 1e9:.0f} "
            f"| {x['pct_of_peak_hbm']:.1f} "
            f"| {'' if overhead is None else f'{overhead:+.1f}%'} |"
        )
        if x["context"] >= LONG_CONTEXT and paged:
            if x["pct_of_peak_hbm"] < MIN_PCT_OF_PEAK:
                missed.append(
                    f"{x['layout']} at {x['context']}: {x['pct_of_peak_hbm']:.1f}% of peak HBM "
                    f"(target >= {MIN_PCT_OF_PEAK:.0f}%)"
                )
            if overhead is not None and overhead > MAX_OVERHEAD_PCT:
                missed.append(
                    f"{x['layout']} at {x['context']}: {overhead:+.1f}% vs contiguous "
                    f"(target <= +{MAX_OVERHEAD_PCT:.0f}%)"
                )
    lines.append("")
    lines.append(
        f"Targets at >= {LONG_CONTEXT} tokens (paged >= {MIN_PCT_OF_PEAK:.0f}% of peak HBM, "
        f"<= {MAX_OVERHEAD_PCT:.0f}% over contiguous): "
        + ("met." if not missed else "missed:")
    )
    lines += [f"- {m}" for m in missed]
    return "\n".join(lines) + "\n"


def _order(bench: dict) -> tuple[int, int]:
    """By context, then contiguous first and paged by block size."""
    x = bench["extra_info"]
    layout = x["layout"]
    return x["context"], 0 if layout == "contiguous" else int(layout.split("-")[1])


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: summarize.py BENCH.json")
    print(summarize(json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))), end="")


if __name__ == "__main__":
    main()
