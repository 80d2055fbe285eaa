"""Fitting the cost model's coefficients to measured step times.

The fit keeps the cost model's roofline form with attention as its own operator
(``CostCoefficients.split_attention``): fixed costs per step and per sequence, plus a
roofline for the linear layers and one for attention. Which side of each max binds is
decided per point, alternating with a bounded linear least-squares fit of relative error
(efficiencies at most 1, fixed costs at least 0) until no point changes side.
"""

from __future__ import annotations

import statistics

import numpy as np

from kvbench.engines.base import BatchShape
from kvbench.engines.costmodel import CostModel
from kvbench.engines.hardware import CostCoefficients
from kvbench.errors import KvbenchError
from kvbench.tools.calibrate.profile import FitSummary, ProfilePoint

# Fitted parameters: fixed costs per step and per sequence, then 1 / efficiency for
# linear-layer FLOPs and bytes and attention FLOPs and bytes. The lower bounds say that no
# step beats the peak figures. (A per-token cost would be collinear with the linear layers'
# FLOPs, so there is none.)
_NUM_PARAMS = 6
_LOWER = np.array([0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def features(cost: CostModel, shape: BatchShape) -> np.ndarray:
    """[1, seqs, then seconds at peak of: linear-layer FLOPs, weight and copy bytes,
    attention FLOPs (masked ones included), KV bytes] of one step."""
    r = cost.terms(shape)
    peak_flops, peak_bw = cost.hardware.flops_per_s, cost.hardware.hbm_bytes_per_s
    return np.array([
        1.0, shape.num_seqs,
        (r.flops - r.attention_flops) / peak_flops, (r.nbytes - r.kv_bytes) / peak_bw,
        (r.attention_flops + r.masked_attention_flops) / peak_flops, r.kv_bytes / peak_bw,
    ])


def fit_coefficients(x: np.ndarray, t: np.ndarray) -> CostCoefficients:
    """Least relative-squared-error coefficients (split-attention form) for features ``x``
    (rows from :func:`features`) and measured step times ``t``.

    Which side of each max binds is fixed per point, the rest is a linear fit; the two
    alternate until no point changes side. Starting sides: as measured at peak figures, and
    each uniform choice; the best end wins.
    """
    if len(t) < _NUM_PARAMS:
        raise KvbenchError(f"a fit needs at least {_NUM_PARAMS} points, got {len(t)}")
    n = len(t)
    starts = [(x[:, 2] >= x[:, 3], x[:, 4] >= x[:, 5])] + [
        (np.full(n, a), np.full(n, b)) for a in (True, False) for b in (True, False)
    ]
    best: tuple[float, np.ndarray] | None = None
    for linear, attention in starts:
        for _ in range(50):
            a = np.column_stack([
                x[:, 0], x[:, 1], x[:, 2] * linear, x[:, 3] * ~linear,
                x[:, 4] * attention, x[:, 5] * ~attention,
            ])
            p = _bounded_lstsq(a / t[:, None], np.ones(n), _LOWER)
            sides = (p[2] * x[:, 2] >= p[3] * x[:, 3], p[4] * x[:, 4] >= p[5] * x[:, 5])
            if (sides[0] == linear).all() and (sides[1] == attention).all():
                break
            linear, attention = sides
        loss = float(np.sum((_predict(p, x) / t - 1) ** 2))
        if best is None or loss < best[0]:
            best = (loss, p)
    assert best is not None
    p = best[1]
    return CostCoefficients(
        flops_efficiency=float(1 / p[2]), bandwidth_efficiency=float(1 / p[3]),
        overhead_s=float(p[0]), per_seq_s=float(p[1]),
        attention_flops_efficiency=float(1 / p[4]),
        attention_bandwidth_efficiency=float(1 / p[5]),
    )


def _predict(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    return (
        x[:, :2] @ p[:2]
        + np.maximum(p[2] * x[:, 2], p[3] * x[:, 3])
        + np.maximum(p[4] * x[:, 4], p[5] * x[:, 5])
    )


def _bounded_lstsq(a: np.ndarray, b: np.ndarray, lower: np.ndarray) -> np.ndarray:
    """argmin |a p - b| subject to p >= lower, exactly, by trying every set of parameters
    left free (the rest at their bound): six parameters make 64 small solves."""
    n = a.shape[1]
    rhs = b - a @ lower
    best_loss, best = float(np.sum(rhs**2)), lower.copy()
    for mask in range(1, 1 << n):
        free = [j for j in range(n) if mask >> j & 1]
        sol = np.linalg.lstsq(a[:, free], rhs, rcond=None)[0]
        if (sol < 0).any():
            continue
        p = lower.copy()
        p[free] += sol
        loss = float(np.sum((a @ p - b) ** 2))
        if loss < best_loss:
            best_loss, best = loss, p
    return best


def holdout_mask(n: int, every: int) -> np.ndarray:
    """A fixed pseudo-random ``1/every`` of ``n`` points; a plain stride would line up with a
    grid axis (every 4th point of a 4-chunk grid is the largest chunk)."""
    held = np.zeros(n, bool)
    held[np.random.default_rng(0).permutation(n)[: n // every]] = True
    return held


def summarize(points: list[ProfilePoint]) -> FitSummary:
    train = [abs(p.error_pct) for p in points if not p.held_out]
    held = [abs(p.error_pct) for p in points if p.held_out] or [float("nan")]
    ratios = [
        w / c for p in points for w, c in zip(p.samples_s, p.cpu_samples_s, strict=True) if c > 0
    ]
    return FitSummary(
        train_points=len(train), heldout_points=sum(p.held_out for p in points),
        train_median_err_pct=statistics.median(train),
        heldout_median_err_pct=statistics.median(held),
        heldout_p90_err_pct=float(np.percentile(held, 90)),
        heldout_max_err_pct=max(held),
        median_wall_over_cpu=statistics.median(ratios) if ratios else float("nan"),
    )

