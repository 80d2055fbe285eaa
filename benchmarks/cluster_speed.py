"""Cluster simulation speed: the Azure conversation trace on N replicas against one replica
replaying its N-th share of the load (every N-th request, same timeline), both with decode
fast-forward (``--no-fast-forward``: both step by step), as the median of repeats of wall
and CPU time (CPU time is what a loaded machine inflates least), with the load average.

It also prints what bounds the ratio: the replica steps each run takes (in decode runs taken
in one go, and one at a time), the cluster's steps (one per event on the shared clock), and
the fixed cost of a run outside its stepping loop (planning, loading, the record). When N
replicas take N times the replica steps of one replica at an N-th of the load, the ratio
cannot go below about N x (1 - fixed share of the single run).

    python benchmarks/cluster_speed.py [TRACE] [--replicas 8] [--repeats 3] [--router R]
        [--limit N]  (the trace's first N requests) [--no-fast-forward]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import Suite
from kvbench.workloads.io import save_workload
from kvbench.workloads.traces import import_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_llm_2023_conv.csv"


def _suite(workload_file: Path, replicas: int, router: str, fast_forward: bool) -> Suite:
    return Suite.model_validate({
        "name": "cluster-speed",
        "workload": {"file": str(workload_file)},
        "model": {"preset": "llama-2-7b"},
        "run": {"device": "sim:a100-80gb", "clock": "virtual", "engines": ["paged"],
                "fast_forward": fast_forward},
        "cluster": {"replicas": replicas, "router": router},
    })


def _time(suite: Suite, out: Path) -> dict[str, Any]:
    """Wall and CPU seconds of one run, its stepping loop's wall time, and its steps."""
    plan = plan_run(suite, None, out, "cluster_speed", force=True)
    t0, c0 = time.perf_counter(), time.process_time()
    [record] = execute_plan(plan, plots=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    ff = record.engine_config.get("fast_forward", {})
    return {"wall": wall, "cpu": cpu, "loop": record.summary["wall_time_s"],
            "steps": record.summary["num_steps"], "bulk": ff.get("steps", 0),
            "mode": ff.get("mode")}


def _line(label: str, runs: list[dict[str, Any]]) -> dict[str, float]:
    wall = statistics.median(r["wall"] for r in runs)
    cpu = statistics.median(r["cpu"] for r in runs)
    loop = statistics.median(r["loop"] for r in runs)
    last = runs[-1]
    print(f"{label}: wall median {wall:.2f} s of {[round(r['wall'], 2) for r in runs]}, "
          f"CPU median {cpu:.2f} s of {[round(r['cpu'], 2) for r in runs]}; stepping loop "
          f"{loop:.2f} s wall, fixed {wall - loop:.2f} s ({100 * (wall - loop) / wall:.0f}%); "
          f"{last['steps']} steps, {last['bulk']} replica steps in decode runs "
          f"(fast-forward {last['mode']})")
    return {"wall": wall, "cpu": cpu, "loop": loop}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--no-fast-forward", dest="fast_forward", action="store_false")
    args = ap.parse_args()
    n = args.replicas
    load0 = os.getloadavg()
    full = import_trace("azure", Path(args.trace), limit=args.limit)
    share = dataclasses.replace(full, requests=full.requests[::n], name=f"{full.name}-1of{n}")
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        save_workload(full, d / "full.jsonl")
        save_workload(share, d / "share.jsonl")
        one, many = [], []
        for k in range(args.repeats):
            one.append(_time(_suite(d / "share.jsonl", 1, args.router, args.fast_forward),
                             d / f"one{k}"))
            many.append(_time(_suite(d / "full.jsonl", n, args.router, args.fast_forward),
                              d / f"many{k}"))
    a = _line(f"1 replica, 1/{n} of {len(full.requests)} requests ({len(share.requests)})", one)
    b = _line(f"{n} replicas ({args.router}), all requests", many)
    fixed = (a["wall"] - a["loop"]) / a["wall"]
    print(f"ratio: wall {b['wall'] / a['wall']:.2f}x, CPU {b['cpu'] / a['cpu']:.2f}x, "
          f"stepping loops {b['loop'] / a['loop']:.2f}x (target <= 2x); replica steps "
          f"{many[-1]['steps'] / one[-1]['steps']:.2f}x; floor at {n} x (1 - fixed share "
          f"{fixed:.2f}) = {n * (1 - fixed):.2f}x")
    print(f"load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
