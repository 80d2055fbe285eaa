"""Fitting the cost model's coefficients to measured step times.

Every :data:`FORMS` structure of the step cost is fitted (fixed costs per step and per
sequence, plus one roofline for the whole step or one for the linear layers and one for
attention, their compute and memory times overlapping or added), by bounded linear
least squares of relative error (efficiencies at most 1, fixed costs at least 0); the
form that predicts held-out steps best is kept.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import numpy as np

from kvbench.engines.base import BatchShape
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import CostCoefficients
from kvbench.errors import KvbenchError
from kvbench.tools.calibrate.profile import FitSummary, ProfilePoint


@dataclass(frozen=True, slots=True)
class Form:
    """A structure of the step cost: one roofline over the whole step, or one for the linear
    layers plus one for attention (``split``); in each, compute and memory time overlapping
    (the larger counts) or not (both count)."""

    name: str
    split: bool
    overlap: bool


FORMS = (
    Form("step roofline", split=False, overlap=True),
    Form("operator roofline", split=True, overlap=True),
    Form("step sum", split=False, overlap=False),
    Form("operator sum", split=True, overlap=False),
)


def features(cost: CostModel, shape: BatchShape) -> np.ndarray:
    """[1, seqs, then seconds at peak of: linear-layer FLOPs, weight and copy bytes,
    attention FLOPs, KV bytes, and the masked attention FLOPs that only unfused attention
    computes] of one step."""
    r = cost.terms(shape)
    peak_flops, peak_bw = cost.hardware.flops_per_s, cost.hardware.hbm_bytes_per_s
    return np.array([
        1.0, shape.num_seqs,
        (r.flops - r.attention_flops) / peak_flops, (r.nbytes - r.kv_bytes) / peak_bw,
        r.attention_flops / peak_flops, r.kv_bytes / peak_bw,
        r.masked_attention_flops / peak_flops,
    ])


def _design(x: np.ndarray, form: Form) -> np.ndarray:
    """The fitted columns of ``form``: fixed costs per step and per sequence, then (compute,
    memory) seconds at peak per roofline. A per-token cost would be collinear with the
    linear layers' FLOPs, so there is none."""
    if form.split:
        return np.column_stack([x[:, 0], x[:, 1], x[:, 2], x[:, 3], x[:, 4] + x[:, 6], x[:, 5]])
    return np.column_stack([x[:, 0], x[:, 1], x[:, 2] + x[:, 4], x[:, 3] + x[:, 5]])


def fit_coefficients(x: np.ndarray, t: np.ndarray,
                     form: Form = FORMS[1]) -> CostCoefficients:
    """Least relative-squared-error coefficients of ``form`` for features ``x`` (rows from
    :func:`features`) and measured step times ``t``. Fitted: the fixed costs and 1 /
    efficiency per roofline side, bounded so that no step beats the peak figures.

    With overlap, which side of each max binds is fixed per point and the rest is a linear
    fit; the two alternate until no point changes side. Starting sides: as measured at peak
    figures, and each uniform choice; the best end wins."""
    a = _design(x, form)
    n, k = a.shape
    if n < k:
        raise KvbenchError(f"a fit needs at least {k} points, got {n}")
    lower = np.r_[0.0, 0.0, np.ones(k - 2)]
    pairs = range(2, k, 2)
    if form.overlap:
        starts = [[a[:, j] >= a[:, j + 1] for j in pairs]] + [
            [np.full(n, side) for side in sides]
            for sides in itertools.product((True, False), repeat=len(pairs))
        ]
    else:
        starts = [[np.ones(n, bool) for _ in pairs]]
    best: tuple[float, np.ndarray] | None = None
    for binds in starts:
        for _ in range(50):
            cols = [a[:, 0], a[:, 1]]
            for j, side in zip(pairs, binds, strict=True):
                cols += [a[:, j] * side, a[:, j + 1] * ~side] if form.overlap else \
                    [a[:, j], a[:, j + 1]]
            p = _bounded_lstsq(np.column_stack(cols) / t[:, None], np.ones(n), lower)
            now = [p[j] * a[:, j] >= p[j + 1] * a[:, j + 1] for j in pairs]
            if not form.overlap or all((b == m).all() for b, m in zip(binds, now, strict=True)):
                break
            binds = now
        loss = float(np.sum((_predict(p, a, form.overlap) / t - 1) ** 2))
        if best is None or loss < best[0]:
            best = (loss, p)
    assert best is not None
    p = best[1]
    return CostCoefficients(
        flops_efficiency=float(1 / p[2]), bandwidth_efficiency=float(1 / p[3]),
        overhead_s=float(p[0]), per_seq_s=float(p[1]),
        attention_flops_efficiency=float(1 / p[4]) if form.split else None,
        attention_bandwidth_efficiency=float(1 / p[5]) if form.split else None,
        overlap=form.overlap,
    )


def fit_forms(x: np.ndarray, t: np.ndarray, held: np.ndarray
              ) -> dict[str, tuple[CostCoefficients, float]]:
    """Per form: its coefficients fitted on the points not ``held``, and the median absolute
    relative error (%) with which they predict the ``held`` points."""
    out: dict[str, tuple[CostCoefficients, float]] = {}
    for form in FORMS:
        coef = fit_coefficients(x[~held], t[~held], form)
        pred = _predict(_params(coef), _design(x[held], form), form.overlap)
        out[form.name] = coef, float(np.median(np.abs(pred / t[held] - 1)) * 100)
    return out


def best_form(x: np.ndarray, t: np.ndarray, held: np.ndarray
              ) -> tuple[Form, CostCoefficients, dict[str, float]]:
    """The form of :func:`fit_forms` with the least held-out error, its coefficients, and
    every form's error."""
    fits = fit_forms(x, t, held)
    form = min(FORMS, key=lambda f: fits[f.name][1])
    return form, fits[form.name][0], {k: err for k, (_c, err) in fits.items()}


def _params(c: CostCoefficients) -> np.ndarray:
    p = [c.overhead_s, c.per_seq_s, 1 / c.flops_efficiency, 1 / c.bandwidth_efficiency]
    if c.split_attention:
        assert c.attention_flops_efficiency and c.attention_bandwidth_efficiency
        p += [1 / c.attention_flops_efficiency, 1 / c.attention_bandwidth_efficiency]
    return np.array(p)


def _predict(p: np.ndarray, a: np.ndarray, overlap: bool) -> np.ndarray:
    out = a[:, :2] @ p[:2]
    for j in range(2, a.shape[1], 2):
        compute, memory = p[j] * a[:, j], p[j + 1] * a[:, j + 1]
        out = out + (np.maximum(compute, memory) if overlap else compute + memory)
    return out


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

