"""Summary metrics of a run: pure functions over the harness's timings and step log.

Definitions (times in the run's clock; latencies measured from the request's arrival):

- ``ttft_ms``: first output token time - arrival.
- ``tpot_ms``: (e2el - ttft) / (output_tokens - 1), per request with more than one output token.
- ``itl_ms``: gaps between consecutive output-token emissions of a request, pooled over requests.
- ``e2el_ms``: finish - arrival.
- ``request_throughput`` / ``output_throughput`` / ``total_token_throughput``: completed
  requests, output tokens, prompt + output tokens of completed requests, per second of run.
- ``max_concurrent_requests``: most requests holding KV (running) at once;
  ``mean_concurrent_requests``: its time-weighted mean over steps.
- ``mean_kv_utilization``: time-integral of KV used / time-integral of KV reserved, over steps
  where anything is reserved; ``kv_waste_pct`` = 100 x (1 - mean_kv_utilization).
- ``min_frag_index``: minimum over steps of largest_free / free (steps with free memory).
- ``prefix_hit_rate``: prompt tokens served from the prefix cache / prompt tokens looked up.
Names follow ``vllm bench serve`` where they overlap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.harness import EngineRun

PERCENTILES = (50, 90, 99)


def _dist(prefix: str, values: list[float]) -> dict[str, float | None]:
    if not values:
        out: dict[str, float | None] = {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None}
        out.update({f"p{p}_{prefix}_ms": None for p in PERCENTILES if p != 50})
        return out
    arr = np.asarray(values, dtype=np.float64) * 1000.0
    out = {f"mean_{prefix}_ms": float(arr.mean()), f"median_{prefix}_ms": float(np.median(arr))}
    for p in PERCENTILES:
        if p != 50:
            out[f"p{p}_{prefix}_ms"] = float(np.percentile(arr, p))
    return out


def latency_samples(run: EngineRun) -> dict[str, list[float]]:
    """Per-request TTFT, TPOT, E2EL and pooled ITL samples, in seconds."""
    ttft, tpot, e2el, itl = [], [], [], []
    for t in run.timings.values():
        if t.finish_s is None or t.first_token_s is None:
            continue
        arrival = t.request.arrival_s
        ttft.append(t.first_token_s - arrival)
        e2el.append(t.finish_s - arrival)
        out = t.request.output_tokens
        if out > 1:
            tpot.append((t.finish_s - t.first_token_s) / (out - 1))
        times = np.unique(np.asarray(t.token_times_s))
        if len(times) > 1:
            itl.extend(np.diff(times).tolist())
    return {"ttft": ttft, "tpot": tpot, "e2el": e2el, "itl": itl}


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> float | None:
    total = float(weights.sum())
    return float((values * weights).sum() / total) if total > 0 else None


def summarize(run: EngineRun) -> dict[str, Any]:
    timings = list(run.timings.values())
    completed = [t for t in timings if t.status == "ok"]
    rejected = sum(t.status == "rejected" for t in timings)
    duration = run.duration_s
    out_tokens = sum(t.output_tokens_emitted for t in timings)
    prompt_done = sum(t.request.prompt_tokens for t in completed)
    rate = (lambda x: x / duration) if duration > 0 else (lambda x: None)

    summary: dict[str, Any] = {
        "num_requests": len(timings),
        "completed": len(completed),
        "rejected": rejected,
        "duration_s": duration,
        "wall_time_s": run.wall_time_s,
        "num_steps": len(run.steps),
        "request_throughput": rate(len(completed)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(
            prompt_done + sum(t.output_tokens_emitted for t in completed)
        ),
        "total_output_tokens": out_tokens,
    }
    for name, values in latency_samples(run).items():
        summary.update(_dist(name, values))
    summary.update(kv_metrics(run))
    return summary


def kv_metrics(run: EngineRun) -> dict[str, Any]:
    s = run.steps
    kv = run.last_kv
    out: dict[str, Any] = {
        "max_concurrent_requests": max(s.running, default=0),
        "mean_concurrent_requests": None,
        "preemptions": int(sum(s.preempted)),
        "kv_capacity_bytes": kv.capacity_bytes if kv else None,
        "peak_kv_reserved_bytes": None,
        "peak_kv_used_bytes": None,
        "mean_kv_utilization": None,
        "kv_waste_pct": None,
        "min_frag_index": None,
        "prefix_hit_rate": None,
        "peak_rss_bytes": max(s.rss_bytes, default=None),
    }
    if not len(s):
        return out
    dt = np.asarray(s.dt_s, dtype=np.float64)
    out["mean_concurrent_requests"] = _weighted_mean(np.asarray(s.running, np.float64), dt)
    if all(v is not None for v in s.kv_reserved_bytes):
        reserved = np.asarray(s.kv_reserved_bytes, dtype=np.float64)
        out["peak_kv_reserved_bytes"] = int(reserved.max())
        if all(v is not None for v in s.kv_used_bytes):
            used = np.asarray(s.kv_used_bytes, dtype=np.float64)
            out["peak_kv_used_bytes"] = int(used.max())
            busy = reserved > 0
            denom = float((reserved[busy] * dt[busy]).sum())
            if denom > 0:
                util = float((used[busy] * dt[busy]).sum()) / denom
                out["mean_kv_utilization"] = util
                out["kv_waste_pct"] = 100.0 * (1.0 - util)
    if all(v is not None for v in s.kv_free_bytes) and all(
        v is not None for v in s.kv_largest_free_bytes
    ):
        free = np.asarray(s.kv_free_bytes, dtype=np.float64)
        largest = np.asarray(s.kv_largest_free_bytes, dtype=np.float64)
        mask = free > 0
        if mask.any():
            out["min_frag_index"] = float((largest[mask] / free[mask]).min())
    if kv is not None and kv.prefix_query_tokens:
        out["prefix_hit_rate"] = (kv.prefix_hit_tokens or 0) / kv.prefix_query_tokens
    return out
