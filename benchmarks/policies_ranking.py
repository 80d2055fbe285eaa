"""The `policies` suite ranked on memory-bound loads (results/tables/policies-ranking.md).

Runs ``kvbench run policies`` at every point of a KV-budget x request-rate grid, for
several workload seeds, and writes a Markdown table per point: per engine the median and
min-max over seeds of output throughput, TTFT p50, TPOT p50, preemptions, max and mean
concurrency and the time requests waited for KV, and a rank where the seeds' ranges allow
one. Virtual clock: every figure is exact and the same on any machine.

    python benchmarks/policies_ranking.py run --out DIR     # the grid (skips finished points)
    python benchmarks/policies_ranking.py table --out DIR   # the Markdown, on stdout

Ranks. An engine's rank on a metric is 1 + the number of engines whose whole range over the
seeds is better (higher throughput; lower TTFT): two engines whose ranges overlap are
within the seeds' spread of each other and neither counts against the other. Ranks are
given only at memory-bound points: in every seed at least half of the engines preempted a
running request or kept a request waiting for KV memory. A higher concurrency is never a
rank of its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENGINES = ["paged", "paged-nocache", "contiguous", "paged-mixed", "paged-mixed-migrate",
           "segmented", "vattention", "vattention-64k", "vattention-prewarm"]
PREFIX_CACHE = {"paged": "yes", "paged-nocache": "off (reference)"}
SEEDS = [0, 1, 2]
BUDGETS = ["4GiB", "8GiB", "16GiB"]


@dataclass(frozen=True)
class Load:
    key: str
    title: str
    workload: str
    model: str
    num_requests: int
    rates: tuple[float, ...]


LOADS = [
    Load("mixed-text", "mixed-text, Llama-3-8B", "mixed-text", "llama-3-8b", 400,
         (4.0, 8.0, 16.0)),
    Load("mooncake", "Mooncake trace (first 300 requests), Qwen2.5-7B",
         "mooncake:../shared/traces/mooncake_synthetic_trace.jsonl", "qwen2.5-7b", 300,
         (0.5, 1.0, 2.0)),
]


def _rate(r: float) -> str:
    return f"{r:g}"


def point_dir(out: Path, load: Load, budget: str, rate: float, seed: int) -> Path:
    return out / load.key / f"kv{budget}-rate{_rate(rate)}-seed{seed}"


def command(load: Load, budget: str, rate: float, seed: int, out: str) -> list[str]:
    return ["kvbench", "run", "policies", "--workload", load.workload, "--model", load.model,
            "--num-requests", str(load.num_requests), "--kv-memory", budget,
            "--request-rate", _rate(rate), "--seed", str(seed), "--prefix-caching",
            "--out", out]


def run(out: Path) -> int:
    kvbench = shutil.which("kvbench") or str(Path(sys.executable).with_name("kvbench"))
    total = 0.0
    for load in LOADS:
        for budget in BUDGETS:
            for rate in load.rates:
                for seed in SEEDS:
                    d = point_dir(out, load, budget, rate, seed)
                    if all((d / f"{e}.json").exists() for e in ENGINES):
                        continue
                    cmd = command(load, budget, rate, seed, str(d))
                    start = time.perf_counter()
                    done = subprocess.run([kvbench, *cmd[1:], "--force"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True)
                    took = time.perf_counter() - start
                    total += took
                    print(f"{load.key} {budget} rate {_rate(rate)} seed {seed}: "
                          f"rc {done.returncode}, {took:.1f} s", flush=True)
                    if done.returncode:
                        print(done.stderr[-2000:], file=sys.stderr)
                        return done.returncode
    print(f"total {total:.0f} s", flush=True)
    return 0


# metric key, header, format, better ("hi" | "lo" | None: not ranked)
METRICS = [
    ("output_throughput", "output tok/s", "{:.1f}", "hi"),
    ("median_ttft_ms", "TTFT p50 s", "{:.2f}", "lo"),
    ("median_tpot_ms", "TPOT p50 ms", "{:.1f}", None),
    ("preemptions", "preemptions", "{:.0f}", None),
    ("kv_wait_s", "KV wait s", "{:.0f}", None),
    ("max_concurrent_requests", "max conc.", "{:.0f}", None),
    ("mean_concurrent_requests", "mean conc.", "{:.1f}", None),
]


def summaries(out: Path, load: Load, budget: str, rate: float) -> dict[str, list[dict]]:
    by_engine: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for seed in SEEDS:
        d = point_dir(out, load, budget, rate, seed)
        for e in ENGINES:
            rec = json.loads((d / f"{e}.json").read_text())
            if rec["status"] != "ok":
                raise SystemExit(f"{d}/{e}.json: status {rec['status']}: {rec['error']}")
            s = dict(rec["summary"])
            s["median_ttft_ms"] = s["median_ttft_ms"] / 1000  # shown in seconds
            s["_commit"] = rec["git_commit"]
            by_engine[e].append(s)
    return by_engine


def memory_bound(by_engine: dict[str, list[dict]]) -> tuple[bool, list[int]]:
    """Per seed, how many engines preempted or kept a request waiting for KV; the point is
    memory-bound when that is at least half of the engines in every seed."""
    counts = [sum(1 for e in ENGINES
                  if by_engine[e][i]["preemptions"] > 0 or (by_engine[e][i]["kv_wait_s"] or 0) > 0)
              for i in range(len(SEEDS))]
    return all(c * 2 >= len(ENGINES) for c in counts), counts


def ranks(by_engine: dict[str, list[dict]], key: str, better: str) -> dict[str, int]:
    lo = {e: min(s[key] for s in v) for e, v in by_engine.items()}
    hi = {e: max(s[key] for s in v) for e, v in by_engine.items()}
    if better == "hi":
        return {e: 1 + sum(1 for o in ENGINES if lo[o] > hi[e]) for e in ENGINES}
    return {e: 1 + sum(1 for o in ENGINES if hi[o] < lo[e]) for e in ENGINES}


def order(rank: dict[str, int]) -> str:
    """Engines by rank; engines sharing a rank are within the seeds' spread of each other."""
    groups: dict[int, list[str]] = {}
    for e in ENGINES:
        groups.setdefault(rank[e], []).append(f"`{e}`")
    parts = []
    for r in sorted(groups):
        names = groups[r]
        tie = " (within the seeds' spread of each other)" if len(names) > 1 else ""
        parts.append(f"rank {r} {', '.join(names)}{tie}")
    return "; ".join(parts)


def cell(values: list[float], fmt: str) -> str:
    med, lo, hi = statistics.median(values), min(values), max(values)
    if fmt.format(lo) == fmt.format(hi):
        return fmt.format(med)
    return f"{fmt.format(med)} ({fmt.format(lo)}-{fmt.format(hi)})"


def table(out: Path) -> str:
    lines: list[str] = []
    commits: set[str] = set()
    for load in LOADS:
        lines += [f"## {load.title}", ""]
        for budget in BUDGETS:
            for rate in load.rates:
                by_engine = summaries(out, load, budget, rate)
                commits |= {s["_commit"] for v in by_engine.values() for s in v}
                bound, counts = memory_bound(by_engine)
                state = ("memory-bound" if bound else "not memory-bound, not ranked")
                lines += [f"### {load.key}: KV {budget.replace('GiB', ' GiB')}, "
                          f"{_rate(rate)} req/s: {state}", "",
                          "Engines that preempted or waited for KV, per seed: "
                          + ", ".join(f"{c} of {len(ENGINES)}" for c in counts) + ".", ""]
                rk = {k: ranks(by_engine, k, b) for k, _, _, b in METRICS if b}
                head = "| engine | prefix cache | " + " | ".join(h for _, h, _, _ in METRICS)
                if bound:
                    head += " | rank tok/s | rank TTFT"
                lines += [head + " |", "|---|---|" + "---:|" * (len(METRICS) + 2 * bound)]
                for e in ENGINES:
                    row = [f"`{e}`", PREFIX_CACHE.get(e, "none")]
                    row += [cell([s[k] or 0 for s in by_engine[e]], f) for k, _, f, _ in METRICS]
                    if bound:
                        row += [str(rk["output_throughput"][e]), str(rk["median_ttft_ms"][e])]
                    lines.append("| " + " | ".join(row) + " |")
                lines.append("")
                if bound:
                    for key, what in (("output_throughput", "Output throughput"),
                                      ("median_ttft_ms", "TTFT p50")):
                        lines += [f"{what}: {order(rk[key])}.", ""]
    lines.append(f"Records' commits: {', '.join(sorted(commits))}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["run", "table", "commands"])
    parser.add_argument("--out", type=Path, required=True, help="the runs' folder")
    args = parser.parse_args(argv)
    if args.what == "run":
        return run(args.out)
    if args.what == "commands":
        for load in LOADS:
            print(" ".join(command(load, "$KV", 0, 0, "OUT")))
        return 0
    sys.stdout.write(table(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
