"""Metrics and curves of a cluster run (:mod:`kvbench.engines.cluster.engine`): pure functions over
its per-step replica log, the harness's step log and the request timings.

Summary metrics (besides the usual ones, which cover the whole cluster: KV capacity and
reserved bytes, concurrency and device memory summed over replicas):

- ``replicas``: engines in the cluster (prefill plus decode ones when disaggregated).
- ``load_imbalance``: time-weighted mean, over steps where any replica runs a request, of
  max / mean running requests across the replicas that run them (colocated replicas, or
  decode replicas when disaggregated: a prefill replica's requests leave it with their
  first token); 1.0 is perfectly even. ``peak_replica_concurrent_requests`` /
  ``min_replica_max_concurrent_requests``: the busiest and the least busy of those
  replicas' peaks.
- ``cluster_prefix_hit_rate``: prompt tokens served from any replica's prefix cache /
  prompt tokens looked up, over all replicas (None without prefix caching).
- ``requests_moved_by_load_cap``: requests the prefix-aware router sent away from the
  replica with the longest cached prefix because it was over the load cap.

Disaggregated prefill/decode only:

- ``kv_transfers``, ``kv_transfer_bytes``: requests whose KV went over the link and the
  bytes sent (prompt tokens x KV bytes per token, all tensor-parallel ranks).
- ``mean_kv_transfer_ms``: link time per transfer (latency + bytes / bandwidth);
  ``mean_kv_link_wait_ms``: time a finished prefill waited for the link;
  ``mean_decode_admission_wait_ms``: time received KV waited for room on its decode replica.
- ``kv_transfer_share_of_ttft_pct``: over transferred requests, 100 x the sum of (link wait
  + transfer + admission wait) / the sum of their TTFT.
- ``peak_prefill_kv_reserved_bytes`` / ``peak_decode_kv_reserved_bytes``: the peak, over
  steps, of KV reserved summed over the prefill / decode replicas;
  ``peak_kv_held_for_transfer_bytes``: the most KV prefill replicas held for transfers at
  once.

Curves: ``replica<i>_running``, ``replica<i>_waiting``, ``replica<i>_kv_reserved_bytes``
for every replica, and, disaggregated, ``prefill_kv_reserved_bytes`` and
``decode_kv_reserved_bytes``; downsampled on the run's time axis as every other curve.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvbench.engines.cluster.engine import ClusterLog
from kvbench.results.curves import MAX_POINTS, bucket_edges
from kvbench.results.runlog import EngineRun


def cluster_summary(run: EngineRun, log: ClusterLog) -> dict[str, Any]:
    out: dict[str, Any] = {
        "replicas": len(log.roles),
        "load_imbalance": None,
        "peak_replica_concurrent_requests": None,
        "min_replica_max_concurrent_requests": None,
        "cluster_prefix_hit_rate": None,
        "requests_moved_by_load_cap": log.moved_by_load_cap,
    }
    kv = run.last_kv
    if kv is not None and kv.prefix_query_tokens:
        out["cluster_prefix_hit_rate"] = (kv.prefix_hit_tokens or 0) / kv.prefix_query_tokens
    n = min(log.num_steps, len(run.steps.dt_s))
    if n:
        running = log.dense(n)[0]
        held = [i for i, role in enumerate(log.roles) if role != "prefill"]
        peaks = running[:, held].max(axis=0)
        out["peak_replica_concurrent_requests"] = int(peaks.max())
        out["min_replica_max_concurrent_requests"] = int(peaks.min())
        routed = running[:, held]
        mean = routed.mean(axis=1)
        dt = np.asarray(run.steps.dt_s, dtype=np.float64)[:n]
        busy = (mean > 0) & (dt > 0)
        if busy.any():
            ratio = routed[busy].max(axis=1) / mean[busy]
            out["load_imbalance"] = float(np.average(ratio, weights=dt[busy]))
    if log.link is not None:
        out |= _transfer_summary(run, log, n)
    return out


def _transfer_summary(run: EngineRun, log: ClusterLog, n: int) -> dict[str, Any]:
    trs = log.transfers
    done = [t for t in trs if t.admitted_s is not None]
    out: dict[str, Any] = {
        "kv_transfers": len(trs),
        "kv_transfer_bytes": sum(t.nbytes for t in trs),
        "mean_kv_transfer_ms": _mean_ms([t.end_s - t.start_s for t in trs]),
        "mean_kv_link_wait_ms": _mean_ms([t.start_s - t.ready_s for t in trs]),
        "mean_decode_admission_wait_ms": _mean_ms([t.admitted_s - t.end_s for t in done
                                                   if t.admitted_s is not None]),
        "kv_transfer_share_of_ttft_pct": None,
        "peak_prefill_kv_reserved_bytes": None,
        "peak_decode_kv_reserved_bytes": None,
        "peak_kv_held_for_transfer_bytes": _peak_held(trs),
    }
    ttft = spent = 0.0
    for t in done:
        timing = run.timings.get(t.request.id)
        if timing is None or timing.first_token_s is None or t.admitted_s is None:
            continue
        ttft += timing.first_token_s - timing.request.arrival_s
        spent += t.admitted_s - t.ready_s
    if ttft > 0:
        out["kv_transfer_share_of_ttft_pct"] = 100.0 * spent / ttft
    if n:
        for role, series in _role_kv(log, n).items():
            out[f"peak_{role}_kv_reserved_bytes"] = int(series.max())
    return out


def _mean_ms(values: list[float]) -> float | None:
    return 1000.0 * float(np.mean(values)) if values else None


def _peak_held(trs: list) -> int:
    """The most bytes held at once over the intervals [ready, admitted) of ``trs``."""
    events = []
    for t in trs:
        events.append((t.ready_s, 1, t.nbytes))
        if t.admitted_s is not None:
            events.append((t.admitted_s, 0, -t.nbytes))
    held = peak = 0
    for _, _, delta in sorted(events):
        held += delta
        peak = max(peak, held)
    return peak


def _role_kv(log: ClusterLog, n: int) -> dict[str, np.ndarray]:
    reserved = log.dense(n)[2]
    return {role: reserved[:, [i for i, r in enumerate(log.roles) if r == role]].sum(axis=1)
            for role in ("prefill", "decode")}


def cluster_curves(log: ClusterLog, max_points: int = MAX_POINTS) -> dict[str, list[float]]:
    """Per-replica curves (and, disaggregated, per-role KV), on the step log's buckets."""
    n = log.num_steps
    if n == 0:
        return {}
    starts = bucket_edges(n, max_points)[:-1]
    cols: dict[str, np.ndarray] = {}
    for name, arr in zip(("running", "waiting", "kv_reserved_bytes"), log.dense(n),
                         strict=True):
        for i in range(arr.shape[1]):
            cols[f"replica{i}_{name}"] = arr[:, i]
    if log.link is not None:
        for role, series in _role_kv(log, n).items():
            cols[f"{role}_kv_reserved_bytes"] = series
    return {name: np.maximum.reduceat(col, starts).tolist() for name, col in cols.items()}
