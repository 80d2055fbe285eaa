"""Output tokens per CPU-second of one engine on the engine-bound suite: the run loop's
process CPU time (engine start excluded), which a busy shared machine disturbs far less than
wall-clock tokens/s (a process's share of the CPUs). Run the engines side by side, a round
at a time, and compare their figures.

``python benchmarks/engine_bound_cpu.py ENGINE [--threads N] [--num-requests N]
[--workload PRESET] [--attention KERNELS]`` prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

from kvbench.engines.registry import build_engine
from kvbench.results.metrics import summarize
from kvbench.run.clocks import WallClock
from kvbench.run.harness import run_engine
from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.run.plan import plan_run
from kvbench.run.threads import set_cpu_threads, torch_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--workload", help="another workload preset (e.g. mixed-multimodal)")
    ap.add_argument("--attention", help="the built-in engine's kernels (default: auto)")
    args = ap.parse_args()
    suite, base = resolve_suite("engine-bound", RunFlags(
        engines=args.engine, cpu_threads=args.threads, num_requests=args.num_requests,
        workload=args.workload, attention=args.attention))
    plan = plan_run(suite, base, None, "engine_bound_cpu")
    set_cpu_threads(args.threads)
    ((_, config),) = plan.engines
    engine = build_engine(config)
    wall, cpu = time.perf_counter(), time.process_time()
    run = run_engine(engine, plan.workload, WallClock())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    engine.close()
    tokens = sum(r.output_tokens for r in plan.workload.requests)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(json.dumps({
        "engine": args.engine, "workload": plan.workload.name, "status": run.status,
        "attention": engine.describe().get("executor", {}).get("attention"),
        "threads": torch_threads(),
        "output_tokens": tokens, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
        "output_tokens_per_cpu_s": round(tokens / cpu, 1),
        "output_throughput": summarize(run).get("output_throughput"), "loadavg": load,
    }))


if __name__ == "__main__":
    main()
