"""Cluster simulation speed: the Azure conversation trace on N replicas against one replica
replaying its N-th share of the load (every N-th request, same timeline), wall time of each
as the median of repeats.

    python benchmarks/cluster_speed.py [TRACE] [--replicas 8] [--repeats 3] [--router R]
        [--limit N]  (the trace's first N requests)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import Suite
from kvbench.workloads.io import save_workload
from kvbench.workloads.traces import import_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"


def _suite(workload_file: Path, replicas: int, router: str) -> Suite:
    return Suite.model_validate({
        "name": "cluster-speed",
        "workload": {"file": str(workload_file)},
        "model": {"preset": "llama-2-7b"},
        "run": {"device": "sim:a100-80gb", "clock": "virtual", "engines": ["paged"]},
        "cluster": {"replicas": replicas, "router": router},
    })


def _time(suite: Suite, out: Path) -> tuple[float, float, dict]:
    """Wall and CPU seconds of one run (CPU time is what a loaded machine does not
    inflate)."""
    plan = plan_run(suite, None, out, "cluster_speed", force=True)
    t0, c0 = time.perf_counter(), time.process_time()
    [record] = execute_plan(plan, plots=False)
    return time.perf_counter() - t0, time.process_time() - c0, record.summary


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--limit", type=int)
    args = ap.parse_args()
    n = args.replicas
    full = import_trace("azure", Path(args.trace), limit=args.limit)
    share = dataclasses.replace(full, requests=full.requests[::n], name=f"{full.name}-1of{n}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        save_workload(full, d / "full.jsonl")
        save_workload(share, d / "share.jsonl")
        one, many, cpu1, cpun = [], [], [], []
        for k in range(args.repeats):
            wall, cpu, s1 = _time(_suite(d / "share.jsonl", 1, args.router), d / f"one{k}")
            one.append(wall)
            cpu1.append(cpu)
            wall, cpu, sn = _time(_suite(d / "full.jsonl", n, args.router), d / f"many{k}")
            many.append(wall)
            cpun.append(cpu)
    m1, mn = statistics.median(one), statistics.median(many)
    c1, cn = statistics.median(cpu1), statistics.median(cpun)
    print(f"1 replica, 1/{n} of {len(full.requests)} requests ({len(share.requests)}): "
          f"wall median {m1:.2f} s of {[round(x, 2) for x in one]}, CPU median {c1:.2f} s; "
          f"{s1['num_steps']} steps")
    print(f"{n} replicas ({args.router}), all requests: wall median {mn:.2f} s of "
          f"{[round(x, 2) for x in many]}, CPU median {cn:.2f} s; {sn['num_steps']} "
          "cluster steps")
    print(f"ratio: wall {mn / m1:.2f}x, CPU {cn / c1:.2f}x (target <= 2x)")


if __name__ == "__main__":
    main()
