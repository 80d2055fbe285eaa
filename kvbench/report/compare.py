"""The regression gate: new run records against baselines, metric by metric and curve by curve.

Records are matched by (suite, engine). Where a baseline folder holds several records for
one pair (baselines of many machines), the one from this record's machine is used, else the
machine-independent virtual-clock one.

Each gated metric's kind (from :mod:`kvbench.results.metric_table`) resolves to
*deterministic* or *timing* for a pair (``clock`` by the new record's clock, ``device`` by
its device: a simulated device's memory is modelled, a real one's measured), and a change
counts only beyond an allowed band (tolerances from :mod:`kvbench.report.thresholds`):

- deterministic: ``band = exact_tolerance x |baseline|`` (any real change counts);
- timing: with ``b`` the baseline's per-repeat values and ``m = median(b)``,
  ``band = max(tolerance x |m|, abs_tolerance, noise_k x 1.4826 x median(|b - m|))``,
  compared against ``median(new repeats) - m``. The scaled MAD is a robust standard
  deviation, so with the default ``noise_k = 3`` a change must exceed both the tolerance
  and three baseline standard deviations. One baseline repeat has no spread: the band is
  then the tolerance alone. Timing metrics are compared only between records of the same
  machine (:func:`kvbench.report.baselines.machine_slug`).

A change beyond the band in the worse direction is a regression (exit 1); in the better
direction an improvement (passes, fails with ``strict`` so that baselines get refreshed).
Input the gate cannot judge -- baseline not ``ok``, different workload digest, clock,
device or model, a metric or curve the baseline has and the new record lacks, a NaN or
infinite baseline value, a curve whose length differs from its time axis, a duplicate
record -- is *unusable* (exit 2) and says which. A NaN or infinite value in the new record
is a regression. An engine the baseline has for a suite the new run covers, but the new run
lacks, is *missing* (exit 1; skipped with ``allow_missing``).

Curves are compared as functions of the fraction of the run elapsed (a run that only takes
longer is judged by its time metrics): both are cut into ``curve_points`` slices holding
each slice's maximum, and the new curve regresses where it is worse than the baseline by
more than the band, taken relative to the baseline curve's peak. Timing curves may shift
by ``curve_time_slack`` of the run without counting.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel

from kvbench.report.baselines import machine_slug
from kvbench.report.thresholds import MetricRule, Thresholds
from kvbench.results.metric_table import (
    CURVE_BY_NAME,
    CURVE_ROW_PREFIX,
    CURVE_TIME,
    METRIC_BY_NAME,
    Kind,
)
from kvbench.results.recordset import FoundRecord
from kvbench.results.repeats import metric_values
from kvbench.results.schema import RunRecord

Verdict = Literal["pass", "regression", "improvement", "missing", "skipped", "unusable"]
MAD_TO_SIGMA = 1.4826
# Row name for findings about a pair's inputs rather than one metric.
INPUT_ROW = "input"


class Row(BaseModel):
    suite: str
    engine: str
    metric: str
    verdict: Verdict
    kind: Literal["deterministic", "timing"] | None = None
    direction: Literal["lower", "higher"] | None = None
    baseline: float | None = None
    new: float | None = None
    change: float | None = None
    allowed: float | None = None
    baseline_spread: float | None = None
    baseline_repeats: int | None = None
    new_repeats: int | None = None
    detail: str = ""

    @property
    def change_pct(self) -> float | None:
        if self.change is None or not self.baseline:
            return None
        return 100.0 * self.change / abs(self.baseline)


class Pair(BaseModel):
    suite: str
    engine: str
    new_path: str
    baseline_path: str | None
    new_machine: str
    baseline_machine: str | None
    clock: str
    notes: list[str] = []


class CompareResult(BaseModel):
    strict: bool
    thresholds: str
    pairs: list[Pair] = []
    rows: list[Row] = []

    def count(self, verdict: Verdict) -> int:
        return sum(r.verdict == verdict for r in self.rows)

    def failing(self, row: Row) -> bool:
        return row.verdict in ("regression", "missing") or (
            self.strict and row.verdict == "improvement"
        )

    @property
    def exit_code(self) -> int:
        if self.count("unusable"):
            return 2
        return 1 if any(self.failing(r) for r in self.rows) else 0


def mad_spread(values: Sequence[float]) -> float:
    """Scaled median absolute deviation: a standard deviation that outliers do not inflate."""
    if len(values) < 2:
        return 0.0
    m = statistics.median(values)
    return MAD_TO_SIGMA * statistics.median(abs(v - m) for v in values)


def resolve_kind(kind: Kind, record: RunRecord) -> Literal["deterministic", "timing"]:
    if kind == "clock":
        return "deterministic" if record.clock == "virtual" else "timing"
    if kind == "device":
        return "deterministic" if is_simulated(record) else "timing"
    return kind


def is_simulated(record: RunRecord) -> bool:
    """A simulated device's memory is modelled (exact); a real one's is measured."""
    return record.device.startswith("sim:")


def judge(worse_by: float, band: float) -> Verdict:
    """``worse_by`` > 0 means worse than the baseline."""
    if worse_by > band:
        return "regression"
    if -worse_by > band:
        return "improvement"
    return "pass"


def compare_metric(
    name: str, rule: MetricRule, kind: str, base: list[float], new: list[float],
    th: Thresholds,
) -> Row:
    b, n = statistics.median(base), statistics.median(new)
    spread = mad_spread(base)
    if kind == "deterministic":
        band = th.gate.exact_tolerance * max(abs(b), abs(n))
    else:
        band = max(rule.tolerance * abs(b), rule.abs_tolerance, th.gate.noise_k * spread)
    change = n - b
    direction = METRIC_BY_NAME[name].direction
    worse_by = change if direction == "lower" else -change
    return Row(
        suite="", engine="", metric=name, verdict=judge(worse_by, band), kind=kind,  # type: ignore[arg-type]
        direction=direction, baseline=b, new=n, change=change, allowed=band,
        baseline_spread=spread, baseline_repeats=len(base), new_repeats=len(new),
    )


def slice_max(t: Sequence[float], v: Sequence[float], points: int) -> np.ndarray:
    """Maximum of ``v`` in each of ``points`` equal slices of the run. A curve's value at
    time t covers the steps since its previous point, so a slice with no point of its own
    takes the next point's value."""
    t_arr, v_arr = np.asarray(t, dtype=np.float64), np.asarray(v, dtype=np.float64)
    end = float(t_arr[-1]) if len(t_arr) else 0.0
    frac = t_arr / end if end > 0 else np.ones_like(t_arr)
    cell = np.clip(np.ceil(frac * points).astype(np.int64) - 1, 0, points - 1)
    out = np.full(points, np.nan)
    np.fmax.at(out, cell, v_arr)
    following = v_arr[-1] if len(v_arr) else 0.0
    for i in range(points - 1, -1, -1):
        if math.isnan(out[i]):
            out[i] = following
        following = out[i]
    return out


def _window(a: np.ndarray, width: int, op) -> np.ndarray:
    if width == 0:
        return a
    padded = np.pad(a, width, mode="edge")
    return op(np.lib.stride_tricks.sliding_window_view(padded, 2 * width + 1), axis=1)


def compare_curve(
    name: str, rule: MetricRule, kind: str, base: RunRecord, new: RunRecord, th: Thresholds
) -> Row:
    points = th.gate.curve_points
    b = slice_max(base.curves[CURVE_TIME], base.curves[name], points)
    n = slice_max(new.curves[CURVE_TIME], new.curves[name], points)
    peak = float(np.max(np.abs(b))) if len(b) else 0.0
    if kind == "deterministic":
        band, width = th.gate.exact_tolerance * peak, 0
    else:
        band = max(rule.tolerance * peak, rule.abs_tolerance)
        width = math.ceil(th.gate.curve_time_slack * points)
    direction = CURVE_BY_NAME[name].direction
    sign = 1.0 if direction == "lower" else -1.0
    # Worse: beyond the most lenient baseline value within the slack; better: beyond the
    # least lenient one.
    lenient = _window(b, width, np.max if sign > 0 else np.min)
    strict = _window(b, width, np.min if sign > 0 else np.max)
    worse = sign * (n - lenient)
    better = sign * (strict - n)
    i_worse, i_better = int(np.argmax(worse)), int(np.argmax(better))
    # Worse anywhere is a regression; otherwise better anywhere is an improvement.
    verdict: Verdict = "pass"
    if worse[i_worse] > band:
        verdict = "regression"
    elif better[i_better] > band:
        verdict = "improvement"
    i = i_worse if verdict == "regression" or worse[i_worse] >= better[i_better] else i_better
    return Row(
        suite="", engine="", metric=f"{CURVE_ROW_PREFIX}{name}", verdict=verdict, kind=kind,  # type: ignore[arg-type]
        direction=direction, baseline=float(b[i]), new=float(n[i]),
        change=float(n[i] - b[i]), allowed=band,
        detail=f"values at {100 * (i + 0.5) / points:.0f}% of the run, the largest difference; "
        "allowed relative to the baseline curve's peak",
    )


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _input_problems(new: RunRecord, base: RunRecord) -> list[str]:
    problems = []
    if base.status != "ok":
        problems.append(f"baseline ended {base.status!r}; save a complete run as the baseline")
    if new.workload.digest != base.workload.digest:
        problems.append(
            f"different workload digest: new {new.workload.name} {new.workload.digest} "
            f"({new.workload.num_requests} requests), baseline {base.workload.name} "
            f"{base.workload.digest} ({base.workload.num_requests} requests)"
        )
    for label, a, b in (
        ("clock", new.clock, base.clock),
        ("device", new.device, base.device),
        ("model", new.model.get("name"), base.model.get("name")),
    ):
        if a != b:
            problems.append(f"different {label}: new {a}, baseline {b}")
    return problems


def _notes(new: RunRecord, base: RunRecord, same_machine: bool) -> list[str]:
    notes = []
    if not same_machine:
        notes.append(
            f"baseline ran on {machine_slug(base.machine)}, this run on "
            f"{machine_slug(new.machine)}: timing metrics not compared"
        )
    nc, bc = _flat(new.engine_config), _flat(base.engine_config)
    # How many steps a simulator took in bulk says how it ran, not what ran; where each
    # modality's KV was stored follows from the KV policy's own configuration.
    changed = sorted(k for k in nc.keys() | bc.keys()
                     if nc.get(k) != bc.get(k) and k != "fast_forward.steps"
                     and not k.startswith("kv_modalities."))
    if changed:
        notes.append("engine configuration differs: " + ", ".join(
            f"{k} {bc.get(k)!r} -> {nc.get(k)!r}" for k in changed
        ))
    nv, bv = new.machine.get("versions") or {}, base.machine.get("versions") or {}
    moved = sorted(k for k in nv.keys() | bv.keys() if nv.get(k) != bv.get(k))
    if moved:
        notes.append("versions differ: " + ", ".join(
            f"{k} {bv.get(k)} -> {nv.get(k)}" for k in moved
        ))
    return notes


def _non_finite(values: Sequence[float]) -> str | None:
    """How a value among ``values`` is not a finite number ("nan", "inf"), if one is."""
    bad = next((v for v in values if not math.isfinite(v)), None)
    return None if bad is None else str(bad)


def _has_curve(rec: RunRecord, name: str) -> bool:
    return bool(rec.curves.get(name)) and CURVE_TIME in rec.curves


def _curve_shape(rec: RunRecord, which: str, name: str) -> str | None:
    """Why a record's curve does not fit its time axis, if it does not."""
    values, times = rec.curves[name], rec.curves[CURVE_TIME]
    if len(values) == len(times):
        return None
    return (f"the {which} record's curve {name} has {len(values)} points but its time axis "
            f"{CURVE_TIME} has {len(times)}")


def compare_pair(new: RunRecord, base: RunRecord, th: Thresholds) -> tuple[list[Row], list[str]]:
    """Rows for one (suite, engine) pair and notes about it."""
    def row(**kw) -> Row:
        return Row(suite=new.suite, engine=new.engine, **kw)

    problems = _input_problems(new, base)
    if problems:
        return [row(metric=INPUT_ROW, verdict="unusable", detail=p) for p in problems], []
    same_machine = machine_slug(new.machine) == machine_slug(base.machine)
    rows: list[Row] = []
    if new.status != "ok":
        # An incomplete run's metrics describe only part of the workload: judge the status.
        error = new.error.splitlines()[0] if new.error else ""
        detail = f"run ended {new.status!r} {error}".strip()
        return [row(metric="status", verdict="regression", detail=detail)], []
    for name, rule in th.metrics.items():
        kind = resolve_kind(METRIC_BY_NAME[name].kind, new)
        b, n = metric_values(base, name), metric_values(new, name)
        if b is None and n is None:
            continue
        if b is None:
            rows.append(row(metric=name, verdict="skipped", kind=kind,
                            detail="not in the baseline; save a new baseline to gate it"))
        elif n is None:
            rows.append(row(metric=name, verdict="unusable", kind=kind,
                            detail="missing metric: the baseline has it, the new record does not"))
        elif (bad := _non_finite(b)) is not None:
            rows.append(row(metric=name, verdict="unusable", kind=kind,
                            detail=f"the baseline's value is {bad}, which cannot be compared; "
                            "save a baseline from a run that measured it"))
        elif (bad := _non_finite(n)) is not None:
            rows.append(row(metric=name, verdict="regression", kind=kind,
                            detail=f"the new value is {bad}: the run measured no usable number"))
        elif kind == "timing" and not same_machine:
            rows.append(row(metric=name, verdict="skipped", kind=kind,
                            detail="timing metric from another machine"))
        else:
            rows.append(compare_metric(name, rule, kind, b, n, th).model_copy(
                update={"suite": new.suite, "engine": new.engine}))
    for name, rule in th.curves.items():
        kind = resolve_kind(CURVE_BY_NAME[name].kind, new)
        metric = f"{CURVE_ROW_PREFIX}{name}"
        if not _has_curve(base, name):
            continue
        if not _has_curve(new, name):
            rows.append(row(metric=metric, verdict="unusable", kind=kind,
                            detail=f"missing curve: the baseline has {name} over {CURVE_TIME}, "
                            "the new record does not"))
        elif problem := _curve_shape(base, "baseline", name) or _curve_shape(new, "new", name):
            rows.append(row(metric=metric, verdict="unusable", kind=kind, detail=problem))
        elif (bad := _non_finite([*base.curves[name], *base.curves[CURVE_TIME]])) is not None:
            rows.append(row(metric=metric, verdict="unusable", kind=kind,
                            detail=f"the baseline curve holds {bad}; save a new baseline"))
        elif (bad := _non_finite([*new.curves[name], *new.curves[CURVE_TIME]])) is not None:
            rows.append(row(metric=metric, verdict="regression", kind=kind,
                            detail=f"the new curve holds {bad}: the run measured no usable "
                            "number"))
        elif kind == "timing" and not same_machine:
            rows.append(row(metric=metric, verdict="skipped", kind=kind,
                            detail="timing curve from another machine"))
        else:
            rows.append(compare_curve(name, rule, kind, base, new, th).model_copy(
                update={"suite": new.suite, "engine": new.engine}))
    return rows, _notes(new, base, same_machine)


def pick_baseline(
    new: FoundRecord, candidates: list[FoundRecord]
) -> tuple[FoundRecord | None, str, bool]:
    """The baseline for a new record among those of its (suite, engine): the only one; else
    the one from the same machine; else the machine-independent virtual-clock one. Returns
    the record, or why there is none and whether that makes the input unusable."""
    if len(candidates) == 1:
        return candidates[0], "", False
    slug = machine_slug(new.record.machine)
    for label, subset in (
        ("this machine", [c for c in candidates if machine_slug(c.record.machine) == slug]),
        ("the virtual clock", [c for c in candidates if c.record.clock == "virtual"]),
    ):
        if len(subset) == 1:
            return subset[0], "", False
        if len(subset) > 1:
            paths = ", ".join(str(c.path) for c in subset)
            return None, f"several baselines for {label}: {paths}; name one folder", True
    if not candidates:
        return None, "no baseline for this suite and engine: not compared", False
    machines = sorted({machine_slug(c.record.machine) for c in candidates})
    return None, (
        f"no baseline for {slug} (baselines exist for {', '.join(machines)}): not compared"
    ), False


def compare_records(
    new: Sequence[FoundRecord], baseline: Sequence[FoundRecord], th: Thresholds,
    *, strict: bool = False, allow_missing: bool = False, thresholds_path: str = "",
) -> CompareResult:
    """Every new record against its baseline. ``allow_missing``: a baseline engine the new
    run lacks is skipped instead of failing."""
    result = CompareResult(strict=strict, thresholds=thresholds_path)
    new_by_key: dict[tuple[str, str], list[FoundRecord]] = defaultdict(list)
    base_by_key: dict[tuple[str, str], list[FoundRecord]] = defaultdict(list)
    for f in new:
        new_by_key[f.key].append(f)
    for f in baseline:
        base_by_key[f.key].append(f)
    for (suite, engine), found in sorted(new_by_key.items()):
        if len(found) > 1:
            paths = ", ".join(str(f.path) for f in found)
            result.rows.append(Row(suite=suite, engine=engine, metric=INPUT_ROW,
                                   verdict="unusable",
                                   detail=f"duplicate new records (shards overlap?): {paths}"))
            continue
        f = found[0]
        base, why, unusable = pick_baseline(f, base_by_key.get(f.key, []))
        pair = Pair(suite=suite, engine=engine, new_path=str(f.path),
                    baseline_path=str(base.path) if base else None,
                    new_machine=machine_slug(f.record.machine),
                    baseline_machine=machine_slug(base.record.machine) if base else None,
                    clock=f.record.clock)
        if base is None:
            if unusable:
                result.rows.append(Row(suite=suite, engine=engine, metric=INPUT_ROW,
                                       verdict="unusable", detail=why))
            else:
                pair.notes.append(why)
            result.pairs.append(pair)
            continue
        rows, notes = compare_pair(f.record, base.record, th)
        pair.notes += notes
        result.pairs.append(pair)
        result.rows += rows
    new_suites = {k[0] for k in new_by_key}
    for key in sorted(base_by_key):
        if key[0] in new_suites and key not in new_by_key:
            paths = ", ".join(str(f.path) for f in base_by_key[key])
            detail = f"no new record for this engine (baseline: {paths})"
            result.rows.append(Row(
                suite=key[0], engine=key[1], metric=INPUT_ROW,
                verdict="skipped" if allow_missing else "missing",
                detail=detail + ("; allowed by --allow-missing" if allow_missing else
                                 "; run it, or pass --allow-missing if it was dropped on purpose"),
            ))
    if not result.rows:
        result.rows.append(Row(suite="", engine="", metric=INPUT_ROW, verdict="unusable",
                               detail="no new record has a baseline: nothing was compared"))
    return result
