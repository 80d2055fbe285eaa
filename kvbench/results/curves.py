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

from kvbench.results.runlog import StepLog, TelemetryLog
from kvbench.results.stepstats import bucket, curve_columns

MAX_POINTS = 1000


def bucket_edges(n: int, max_points: int) -> np.ndarray:
    k = min(n, max_points)
    return np.linspace(0, n, k + 1).astype(np.int64)


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
    steps: StepLog, telemetry: TelemetryLog | None = None, max_points: int = MAX_POINTS
) -> dict[str, list[float]]:
    n, held = len(steps), len(steps.t_s)
    if n == 0:
        return {}
    edges = bucket_edges(n, max_points)
    columns = curve_columns(steps, held)
    t = np.asarray(steps.t_s, dtype=np.float64)
    folded = steps.folded
    if folded is not None:
        # Edges over the folded steps fall on their buckets' edges; the folded buckets go
        # in front of the steps held, and each edge to its index there.
        first, fine = folded.steps, folded.fine
        edges = np.unique(np.where(edges <= first, np.round(edges / fine).astype(np.int64) * fine,
                                   edges))
        points = np.where(edges <= first, edges // fine, first // fine + edges - first)
        columns = {name: (np.concatenate((*folded.curves[name][0], col)), how)
                   for name, (col, how) in columns.items() if name in folded.curves}
        t = np.concatenate((*folded.t_end, t))
    else:
        points = edges
    curves: dict[str, list[float]] = {"t_s": t[points[1:] - 1].tolist()}
    curves |= {name: values.tolist()
               for name, (values, _) in bucket(columns, points[:-1]).items()}
    if telemetry is not None:
        for samples in telemetry.samples.values():
            if samples.steps:
                for name in samples.columns:
                    curves[name] = _sampled(samples.steps, samples.column(name), edges).tolist()
    return curves
