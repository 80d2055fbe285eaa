"""Downsampling of per-step columns and probe samples into record curves, keeping peaks.

Steps are grouped into at most ``max_points`` buckets of consecutive steps, and every curve
shares the bucket time axis ``t_s`` (the clock time at the end of each bucket's last step).
Each bucket keeps the maximum of "how much" columns (reserved, used, queue sizes, cumulative
counters, probe readings, modelled device memory, the size of a request refused although
enough memory was free in total) and the minimum of "how little is left" columns (free,
largest free, fragmentation index), so a peak or a trough of a single step survives any
downsampling; ``preempted`` is summed. Probe readings are rate-limited, so a bucket without
a reading holds the previous one (a gauge keeps its last value).
"""

from __future__ import annotations

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.run.harness import StepLog
from kvbench.run.telemetry import Telemetry

MAX_POINTS = 1000

_MAX_COLS = (
    "kv_capacity_bytes", "kv_reserved_bytes", "kv_used_bytes", "kv_reserved_ahead_bytes",
    "kv_shared_bytes", "running",
    "waiting", "prefix_hit_tokens", "block_allocs", "block_frees", "num_tokens",
    "kv_copied_bytes", "page_table_entries", "kv_encoder_cache_bytes",
)
_MIN_COLS = ("kv_free_bytes", "kv_largest_free_bytes")
_SUM_COLS = ("preempted",)


def bucket_edges(n: int, max_points: int) -> np.ndarray:
    k = min(n, max_points)
    return np.linspace(0, n, k + 1).astype(np.int64)


def _column(values: list) -> np.ndarray | None:
    if not values or None in values:
        return None
    return np.asarray(values, dtype=np.float64)


def frag_index(free: np.ndarray, largest: np.ndarray) -> np.ndarray:
    """largest_free / free per point; 1.0 where nothing is free (nothing is fragmented)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(free > 0, largest / np.maximum(free, 1), 1.0)


def device_columns(steps: StepLog) -> dict[str, np.ndarray]:
    """Per-step modelled device memory: ``device_<component>_bytes`` for every component,
    and their sums ``device_allocated_bytes`` (live tensors), ``device_reserved_bytes``
    (plus the allocator's cache) and ``device_used_bytes`` (plus non-torch memory: what
    nvidia-smi shows). Empty for runs whose device memory is measured, not modelled."""
    if not steps.device:
        return {}
    out = {f"device_{name}_bytes": np.asarray(values, dtype=np.float64)
           for name, values in steps.device.items()}
    allocated = sum(out[f"device_{n}_bytes"] for n in DeviceMemory.ALLOCATED)
    out["device_allocated_bytes"] = allocated
    out["device_reserved_bytes"] = allocated + sum(out[f"device_{n}_bytes"]
                                                   for n in DeviceMemory.CACHED)
    out["device_used_bytes"] = out["device_reserved_bytes"] + out["device_non_torch_bytes"]
    return out


def fragmentation_waits(need: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Per step: the KV manager refused a request (``need`` > 0) although the free memory
    would have held it in total (external fragmentation)."""
    return (need > 0) & (free >= need)


def _sampled(steps: list[int], values: list[int], edges: np.ndarray) -> np.ndarray:
    """Per-bucket maximum of readings taken after the bucket's steps, carried forward over
    buckets without a reading (and backward before the first one)."""
    buckets = np.searchsorted(edges, np.asarray(steps), side="right") - 1
    out = np.full(len(edges) - 1, -np.inf)
    np.maximum.at(out, buckets, np.asarray(values, dtype=np.float64))
    have = np.isfinite(out)
    # Index of the latest bucket at or before each bucket that has a reading.
    idx = np.maximum.accumulate(np.where(have, np.arange(len(out)), -1))
    first = int(np.argmax(have))
    return out[np.where(idx >= 0, idx, first)]


def build_curves(
    steps: StepLog, telemetry: Telemetry | None = None, max_points: int = MAX_POINTS
) -> dict[str, list[float]]:
    n = len(steps)
    if n == 0:
        return {}
    edges = bucket_edges(n, max_points)
    starts = edges[:-1]
    curves: dict[str, list[float]] = {}
    t = np.asarray(steps.t_s, dtype=np.float64)
    curves["t_s"] = t[edges[1:] - 1].tolist()

    def put(name: str, col: np.ndarray) -> None:
        # Each column is reduced as soon as it is read: a long replay's columns are large.
        if name in _SUM_COLS:
            agg = np.add.reduceat(col, starts)
        elif name in _MIN_COLS or name == "frag_index":
            agg = np.minimum.reduceat(col, starts)
        else:
            agg = np.maximum.reduceat(col, starts)
        curves[name] = agg.tolist()

    for name in (*_MAX_COLS, *_MIN_COLS, *_SUM_COLS):
        col = _column(getattr(steps, name))
        if col is not None:
            put(name, col)
    for name, col in device_columns(steps).items():
        put(name, col)
    # Per page class of a modality-aware pool: kv_<class>_<reserved|used|capacity>_bytes.
    for name, v in steps.kv_class_bytes.items():
        put(f"kv_{name}", np.asarray(v, dtype=np.float64))
    # Used KV by modality of the tokens held: kv_<text|image|audio>_bytes, where every step
    # attributes it.
    for name, v in steps.kv_modality_bytes.items():
        col = _column(v)
        if col is not None:
            put(f"kv_{name}_bytes", col)
    free, largest = _column(steps.kv_free_bytes), _column(steps.kv_largest_free_bytes)
    if free is not None and largest is not None:
        put("frag_index", frag_index(free, largest))
    del free, largest
    need, need_free = _column(steps.kv_refused_bytes), _column(steps.kv_refused_free_bytes)
    if need is not None and need_free is not None:
        put("fragmentation_wait_bytes", np.where(fragmentation_waits(need, need_free), need, 0))
    if telemetry is not None:
        for samples in telemetry.samples.values():
            if samples.steps:
                for name in samples.columns:
                    curves[name] = _sampled(samples.steps, samples.column(name), edges).tolist()
    return curves
