"""Downsampling of per-step columns into record curves, keeping peaks.

Steps are grouped into at most ``max_points`` buckets of consecutive steps; each bucket
keeps the maximum of "how much" columns (reserved, used, queue sizes) and the minimum of
"how little is left" columns (free, largest free, fragmentation index), so a peak or a
trough of a single step survives any downsampling.
"""

from __future__ import annotations

import numpy as np

from kvbench.harness import StepLog

MAX_POINTS = 1000

_MAX_COLS = (
    "kv_reserved_bytes", "kv_used_bytes", "kv_shared_bytes", "running", "waiting",
    "prefix_hit_tokens", "block_allocs", "block_frees", "num_tokens",
)
_MIN_COLS = ("kv_free_bytes", "kv_largest_free_bytes")
_SUM_COLS = ("preempted",)


def _bucket_edges(n: int, max_points: int) -> np.ndarray:
    k = min(n, max_points)
    return np.linspace(0, n, k + 1).astype(np.int64)


def _column(values: list) -> np.ndarray | None:
    if not values or any(v is None for v in values):
        return None
    return np.asarray(values, dtype=np.float64)


def build_curves(steps: StepLog, max_points: int = MAX_POINTS) -> dict[str, list[float]]:
    n = len(steps)
    if n == 0:
        return {}
    edges = _bucket_edges(n, max_points)
    starts = edges[:-1]
    curves: dict[str, list[float]] = {}
    t = np.asarray(steps.t_s, dtype=np.float64)
    curves["t_s"] = t[np.minimum(edges[1:] - 1, n - 1)].tolist()
    cols: dict[str, np.ndarray] = {}
    for name in (*_MAX_COLS, *_MIN_COLS, *_SUM_COLS):
        col = _column(getattr(steps, name))
        if col is not None:
            cols[name] = col
    free, largest = cols.get("kv_free_bytes"), cols.get("kv_largest_free_bytes")
    if free is not None and largest is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            cols["frag_index"] = np.where(free > 0, largest / np.maximum(free, 1), 1.0)
    for name, col in cols.items():
        if name in _SUM_COLS:
            agg = np.add.reduceat(col, starts)
        elif name in _MIN_COLS or name == "frag_index":
            agg = np.minimum.reduceat(col, starts)
        else:
            agg = np.maximum.reduceat(col, starts)
        curves[name] = agg.tolist()
    if steps.rss_bytes:
        rss_t = np.asarray(steps.rss_t_s)
        rss = np.asarray(steps.rss_bytes, dtype=np.float64)
        if len(rss) > max_points:
            e = _bucket_edges(len(rss), max_points)
            rss_t = rss_t[np.minimum(e[1:] - 1, len(rss) - 1)]
            rss = np.maximum.reduceat(rss, e[:-1])
        curves["rss_t_s"] = rss_t.tolist()
        curves["rss_bytes"] = rss.tolist()
    return curves
