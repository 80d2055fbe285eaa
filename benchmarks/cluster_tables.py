"""The cluster tables in results/tables/: every configuration simulated under the virtual
clock (figures exact on any machine), points run in parallel on local processes.

    python benchmarks/cluster_tables.py disaggregated [--num-requests 1000] [--workers 2]
    python benchmarks/cluster_tables.py field [--num-requests 4000] [--workers 2]
    python benchmarks/cluster_tables.py field-saturated [--num-requests 2000] [--rates inf,100]

``disaggregated`` writes results/tables/disaggregated-mooncake.md: prefill/decode splits of
8 simulated A100-80GB against 8 colocated replicas on the Mooncake trace. ``field`` writes
the cluster section of results/tables/field-scenario.md (between its markers): 8 replicas
of Llama-2-7B on the Azure conversation trace, every router, paged vs contiguous.
``field-saturated`` writes the section after it: the same cluster with the trace's arrivals
re-timed (``--request-rate``) so that the queues fill.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import shlex
import sys
from pathlib import Path
from typing import Any

from kvbench.fileio import write_text_atomic
from kvbench.results.provenance import Measurement
from kvbench.results.schema import RunRecord
from kvbench.tools.grid import local_workers, run_point
from kvbench.units import format_bytes

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
TABLES = REPO / "results" / "tables"
MARK_START = "<!-- cluster: benchmarks/cluster_tables.py field -->"
MARK_END = "<!-- /cluster -->"
MARK_SAT_START = "<!-- cluster-saturated: benchmarks/cluster_tables.py field-saturated -->"
MARK_SAT_END = "<!-- /cluster-saturated -->"


def _run_all(suites: list[dict[str, Any]], workers: int) -> list[RunRecord]:
    workers, capped = local_workers(workers, len(suites))
    if capped:
        print(capped)
    with cf.ProcessPoolExecutor(max_workers=workers) as pool:
        payloads = list(pool.map(run_point, suites, [None] * len(suites),
                                 ["benchmarks/cluster_tables.py"] * len(suites)))
    out = []
    for suite, payload in zip(suites, payloads, strict=True):
        if "error" in payload:
            sys.exit(f"{suite['name']}: {payload['error']}")
        [record] = [RunRecord.model_validate_json(t) for t in payload["records"]]
        out.append(record)
    return out


def _f(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def disaggregated(num_requests: int, workers: int) -> str:
    configs = [("8 colocated", "round-robin", {"replicas": 8, "router": "round-robin"}),
               ("8 colocated", "prefix-aware", {"replicas": 8, "router": "prefix-aware"})]
    for p, d, link in ((4, 4, "nvlink-a100"), (4, 4, "ib-ndr"), (4, 4, "roce-100g"),
                       (6, 2, "ib-ndr"), (2, 6, "ib-ndr")):
        configs.append((f"{p} prefill + {d} decode, {link}", "prefix-aware",
                        {"prefill_replicas": p, "decode_replicas": d, "router": "prefix-aware",
                         "link": link}))
    suites = [{
        "name": f"mooncake-cluster-{k}",
        "workload": {"trace": "mooncake", "num_requests": num_requests,
                     "path": str(TRACES / "mooncake_synthetic_trace.jsonl")},
        "model": {"preset": "qwen2.5-7b"},
        "run": {"device": "sim:a100-80gb", "clock": "virtual", "max_num_seqs": 256,
                "max_num_batched_tokens": 8192, "engines": ["paged"]},
        "cluster": cluster,
    } for k, (_, _, cluster) in enumerate(configs)]
    records = _run_all(suites, workers)
    rows = []
    for (shape, router, _), rec in zip(configs, records, strict=True):
        s = rec.summary
        rows.append([
            shape, router, str(s["completed"]), _f(s["request_throughput"], ".2f"),
            _f(s["median_ttft_ms"], ".0f"), _f(s["p99_ttft_ms"], ".0f"),
            _f(s["median_tpot_ms"], ".1f"), _f((s.get("cluster_prefix_hit_rate") or 0) * 100),
            format_bytes(s.get("kv_transfer_bytes")) if s.get("kv_transfers") else "-",
            _f(s.get("mean_kv_transfer_ms"), ".2f"),
            _f(s.get("kv_transfer_share_of_ttft_pct"), ".2f"),
            format_bytes(s.get("peak_prefill_kv_reserved_bytes") or s["peak_kv_reserved_bytes"])
            if s.get("kv_transfers") else format_bytes(s["peak_kv_reserved_bytes"]),
            format_bytes(s.get("peak_decode_kv_reserved_bytes")) if s.get("kv_transfers")
            else "-",
            format_bytes(s.get("peak_kv_held_for_transfer_bytes")) if s.get("kv_transfers")
            else "-",
            str(s["preemptions"]),
        ])
    rec = records[0]
    header = ["GPUs", "router", "done", "req/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
              "prefix hit %", "KV sent", "transfer ms (mean)", "transfer % of TTFT",
              "peak KV prefill side (colocated: all)", "peak KV decode side",
              "peak KV held for transfer", "preemptions"]
    lines = [
        "# Disaggregated prefill/decode vs colocated replicas (Mooncake trace)",
        "",
        f"Qwen2.5-7B on 8 simulated A100-80GB (one GPU per replica), the first {num_requests} "
        f"requests of the Mooncake FAST'25 synthetic trace ({rec.workload.num_requests} "
        f"requests, {rec.workload.prompt_tokens} prompt tokens; kvcache-ai/Mooncake, "
        "Apache-2.0) at their own arrival times, paged KV (block 16, prefix caching), "
        "max_num_seqs 256, max_num_batched_tokens 8192, virtual clock: every figure is "
        "exact and identical on any machine. Requests longer than Qwen2.5's 32768-token "
        "context are rejected alike in every row.",
        "",
        "Disaggregated: a prefill replica computes the prompt and first token, keeps the "
        "prompt's KV until the decode replica (the one with the lowest KV load) has received "
        "it over the link (bytes = prompt tokens x 56 KiB; one transfer at a time out of and "
        "into each GPU), and the client sees the first token on receipt, so TTFT includes the "
        "transfer. Link bandwidths are per-direction line rates (NVLink 3 on A100: 300 GB/s, "
        "InfiniBand NDR: 50 GB/s, RoCE 100 GbE: 12.5 GB/s; sources in "
        "`kvbench/engines/cluster.py`).",
        "",
        "| " + " | ".join(header) + " |",
        "|---|---|" + "---:|" * (len(header) - 2),
        *["| " + " | ".join(r) + " |" for r in rows],
        "",
        "Regenerate (a few minutes; the figures do not depend on the machine):",
        "",
        "```sh",
        f"python benchmarks/cluster_tables.py disaggregated --num-requests {num_requests}",
        "```",
        "",
        "One row by hand: `kvbench run mooncake-sim --engines paged --num-requests "
        f"{num_requests} --prefill-replicas 4 --decode-replicas 4 --link ib-ndr --router "
        "prefix-aware`.",
    ]
    return "\n".join(lines) + "\n"


ROUTERS = ["round-robin", "least-outstanding", "least-kv", "prefix-aware", "session-affinity"]
FIELD_HEADER = ["layout", "router", "done", "max conc. (cluster)", "mean conc.",
                "busiest replica max", "least busy replica max", "load imbalance",
                "prefix hit %", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "preemptions",
                "KV waste %"]


def _field_rows(num_requests: int, workers: int,
                rate: float | None = None) -> tuple[list[list[str]], RunRecord]:
    """Every layout x router on 8 replicas; ``rate`` re-times the arrivals (requests/s,
    inf: all at once)."""
    configs = [(engine, router) for engine in ("paged", "contiguous") for router in ROUTERS]
    run: dict[str, Any] = {"device": "sim:a100-80gb", "clock": "virtual",
                           "max_model_len": 4096}
    if rate is not None:
        run["request_rate"] = rate
    suites = [{
        "name": f"field-cluster-{engine}-{router}",
        "workload": {"trace": "azure", "num_requests": num_requests,
                     "path": str(TRACES / "azure_llm_2023_conv.csv")},
        "model": {"preset": "llama-2-7b"},
        "run": {**run, "engines": [engine]},
        "cluster": {"replicas": 8, "router": router},
    } for engine, router in configs]
    records = _run_all(suites, workers)
    rows = []
    for (engine, router), rec in zip(configs, records, strict=True):
        s = rec.summary
        rows.append([
            engine, router, str(s["completed"]), str(s["max_concurrent_requests"]),
            _f(s["mean_concurrent_requests"]), str(s["peak_replica_concurrent_requests"]),
            str(s["min_replica_max_concurrent_requests"]), _f(s["load_imbalance"], ".2f"),
            _f((s["cluster_prefix_hit_rate"] or 0) * 100) if s["cluster_prefix_hit_rate"]
            is not None else "-",
            _f(s["median_ttft_ms"], ".0f"), _f(s["p99_ttft_ms"], ".0f"),
            _f(s["median_tpot_ms"], ".1f"), str(s["preemptions"]),
            _f(s["kv_waste_pct"]),
        ])
    return rows, records[0]


def _table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(FIELD_HEADER) + " |",
            "|---|---|" + "---:|" * (len(FIELD_HEADER) - 2),
            *["| " + " | ".join(r) + " |" for r in rows]]


def field(num_requests: int, workers: int) -> str:
    rows, rec = _field_rows(num_requests, workers)
    lines = [
        MARK_START,
        "## 8 replicas behind a router (`kvbench run --replicas 8`, simulated A100-80GB)",
        "",
        f"8 replicas of Llama-2-7B, one per simulated A100-80GB, on one virtual clock behind "
        f"each router, replaying the first {num_requests} requests of the Azure LLM inference "
        f"trace 2023 (conversation; {rec.workload.prompt_tokens} prompt and "
        f"{rec.workload.output_tokens} output tokens; Patel et al., Splitwise, ISCA 2024; "
        "CC-BY 4.0) at their own arrival times; max_model_len 4096, vLLM's default budget "
        "(gpu_memory_utilization 0.9). Paged KV (block 16, prefix caching) vs contiguous "
        "extents reserving max_model_len. Concurrency is requests holding KV; load imbalance "
        "is the time-weighted mean of max/mean running requests over replicas.",
        "",
        *_table(rows),
        "",
        "This trace has no session ids and no shared prompt content (its rows are lengths "
        "only), so session-affinity routes as least-outstanding does and no router can raise "
        "the prefix hit rate; the mixed lengths are what this section adds to the fixed "
        "2048-token scenario above.",
        "",
        "```sh",
        f"python benchmarks/cluster_tables.py field --num-requests {num_requests}",
        "```",
        MARK_END,
    ]
    return "\n".join(lines) + "\n"


def field_saturated(num_requests: int, workers: int, rates: list[float]) -> str:
    parts = []
    for rate in rates:
        rows, rec = _field_rows(num_requests, workers, rate)
        load = ("all at once (`--request-rate inf`, an offline load)" if rate == float("inf")
                else f"re-timed to {rate:g} requests/s, Poisson (`--request-rate {rate:g}`)")
        parts += [f"### Arrivals {load}", "", *_table(rows), ""]
    rates_arg = ",".join(f"{r:g}" for r in rates)
    lines = [
        MARK_SAT_START,
        "## 8 replicas, saturated: the same trace arriving faster than the cluster serves it",
        "",
        f"The first {num_requests} requests of the Azure conversation trace "
        f"({rec.workload.prompt_tokens} prompt and {rec.workload.output_tokens} output "
        "tokens), their lengths kept and their arrivals re-timed, on the cluster of the "
        "section above (8 x Llama-2-7B, simulated A100-80GB, max_model_len 4096, "
        "gpu_memory_utilization 0.9, max_num_seqs 256). At the trace's own rate no replica "
        "runs more than a few requests at once; here the queues fill, so the KV layout sets "
        "how many requests each replica holds (paged: what the tokens need; contiguous: "
        "max_model_len each) and the router sets how evenly the queues and KV fill. Virtual "
        "clock: every figure is exact and the same on any machine, loaded or not.",
        "",
        *parts,
        "Every prompt is distinct (the trace carries lengths only): the paged rows' prefix "
        "hits are preempted requests finding their own prompt blocks still cached when they "
        "are scheduled again. With every request arriving at once, least-outstanding, "
        "prefix-aware and session-affinity place requests as round-robin does (nothing has "
        "finished yet when they are routed).",
        "",
        "```sh",
        f"python benchmarks/cluster_tables.py field-saturated --num-requests {num_requests} "
        f"--rates {rates_arg}",
        "```",
        MARK_SAT_END,
    ]
    return "\n".join(lines) + "\n"


def _splice(path: Path, start: str, end: str, section: str) -> None:
    old = path.read_text()
    if start in old:
        head, _, rest = old.partition(start)
        _, _, tail = rest.partition(end + "\n")
        new = head + section + tail
    else:
        new = old.rstrip("\n") + "\n\n" + section
    write_text_atomic(path, new)


def _stamped(text: str, measurement: Measurement) -> str:
    """``text`` with the provenance line under its first heading."""
    lines = text.split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("#"))
    stamp = measurement.line("Virtual clock: the figures are the same on any machine and load.")
    return "\n".join([*lines[:at + 1], "", stamp, *lines[at + 1:]])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table", choices=["disaggregated", "field", "field-saturated"])
    ap.add_argument("--num-requests", type=int)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rates", default="inf,100",
                    help="field-saturated: arrival rates (requests/s, inf: all at once)")
    args = ap.parse_args()
    measurement = Measurement(shlex.join(["python", "benchmarks/cluster_tables.py",
                                          *sys.argv[1:]]))
    path = TABLES / "field-scenario.md"
    if args.table == "disaggregated":
        text = disaggregated(args.num_requests or 1000, args.workers)
        path = TABLES / "disaggregated-mooncake.md"
        write_text_atomic(path, _stamped(text, measurement))
    elif args.table == "field":
        section = field(args.num_requests or 4000, args.workers)
        _splice(path, MARK_START, MARK_END, _stamped(section, measurement))
    else:
        rates = [float(x) for x in args.rates.split(",")]
        section = field_saturated(args.num_requests or 2000, args.workers, rates)
        _splice(path, MARK_SAT_START, MARK_SAT_END, _stamped(section, measurement))
    print(f"written {path}")


if __name__ == "__main__":
    main()
