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
  machine (:func:`kvbench.report.baselines.machine_slug`), except the requests served
  (``completed``, ``failed``): a lost request is lost on any machine, and for them the new
  record's worst repeat is judged, not its median.

A change beyond the band in the worse direction is a regression (exit 1); in the better
direction an improvement (passes, fails with ``strict`` so that baselines get refreshed).
A value no run can produce -- NaN, infinite, or outside the metric's plausible range
(:func:`plausible_range`: negative durations, sizes and counts, shares outside 0..1 or
0..100, more requests served than the run had) -- is *invalid* in the new record (exit 1).
Input the gate cannot judge -- baseline not ``ok``, different workload digest, clock,
device or model, a metric or curve one record has and the other lacks (absent or null), an
implausible baseline value, a curve whose length differs from its time axis, a duplicate
record, a pair where fewer than half of the gated metrics and curves it could compare were
compared (unless ``allow_partial``) -- is *unusable* (exit 2) and says which. An engine the
baseline has for a suite the new run covers, but the new run lacks, is *missing* (exit 1;
skipped with ``allow_missing``). A wall-clock record whose baseline is from another
machine, or that has baselines only for other machines, is *uncompared*: nothing of its
speed was judged; it passes, saying so, and fails with ``strict``.

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
from kvbench.report.thresholds import REQUEST_GATES, MetricRule, Thresholds
from kvbench.results.metric_table import (
    CURVE_BY_NAME,
    CURVE_ROW_PREFIX,
    CURVE_TIME,
    METRIC_BY_NAME,
    Kind,
    MetricSpec,
)
from kvbench.results.recordset import FoundRecord
from kvbench.results.repeats import metric_values
from kvbench.results.schema import RunRecord

Verdict = Literal["pass", "regression", "improvement", "invalid", "uncompared", "missing",
                  "skipped", "unusable"]
# Verdicts of a metric or curve the gate judged.
JUDGED: tuple[Verdict, ...] = ("pass", "regression", "improvement", "invalid")
MAD_TO_SIGMA = 1.4826
# Row names for findings about a pair rather than one metric: its inputs, its status, and
# whether its speed was compared.
INPUT_ROW = "input"
STATUS_ROW = "status"
SPEED_ROW = "speed"
PAIR_ROWS = (INPUT_ROW, STATUS_ROW, SPEED_ROW)
# Detail of a timing metric not compared because the records come from two machines.
OTHER_MACHINE = "timing, from another machine: compared only between records of one machine"
# Detail of a metric or curve the new record has and the baseline lacks.
NOT_IN_BASELINE = "not in the baseline (absent or null), but in the new record"


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
    # Gates of kvbench's defaults the thresholds file drops or loosens.
    relaxed: list[str] = []
    pairs: list[Pair] = []
    rows: list[Row] = []

    def count(self, verdict: Verdict) -> int:
        return sum(r.verdict == verdict for r in self.rows)

    def failing(self, row: Row) -> bool:
        return row.verdict in ("regression", "invalid", "missing") or (
            self.strict and row.verdict in ("improvement", "uncompared")
        )

    @property
    def gated(self) -> tuple[int, int]:
        """How many gated metrics and curves were compared, of how many (all pairs)."""
        rows = [r for r in self.rows if r.metric not in PAIR_ROWS]
        return sum(r.verdict in JUDGED for r in rows), len(rows)

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
    direction = METRIC_BY_NAME[name].direction
    b, n, detail = statistics.median(base), statistics.median(new), ""
    if name in REQUEST_GATES and len(new) > 1:
        # A request lost in one repeat is lost: the worst repeat is judged, not the median.
        n = min(new) if direction == "higher" else max(new)
        detail = f"the worst of {len(new)} repeats"
    spread = mad_spread(base)
    if kind == "deterministic":
        band = th.gate.exact_tolerance * max(abs(b), abs(n))
    else:
        band = max(rule.tolerance * abs(b), rule.abs_tolerance, th.gate.noise_k * spread)
    change = n - b
    worse_by = change if direction == "lower" else -change
    return Row(
        suite="", engine="", metric=name, verdict=judge(worse_by, band), kind=kind,  # type: ignore[arg-type]
        direction=direction, baseline=b, new=n, change=change, allowed=band,
        baseline_spread=spread, baseline_repeats=len(base), new_repeats=len(new),
        detail=detail,
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


def plausible_range(spec: MetricSpec) -> tuple[float, float]:
    """The values a metric or curve can take, from its unit: durations, sizes, counts and
    rates are never negative; fractions (and the fragmentation index) lie in 0..1 and
    percentages in 0..100, except growth, which memory can only lose down to -100%."""
    if spec.unit == "bytes/wave":
        return -math.inf, math.inf  # a slope: memory released per wave is negative
    if spec.unit == "%":
        return (-100.0, math.inf) if "growth" in spec.name else (0.0, 100.0)
    if "fraction" in (spec.unit, spec.fmt) or "frag_index" in spec.name:
        return 0.0, 1.0
    return 0.0, math.inf


def _range_text(lo: float, hi: float, unit: str) -> str:
    if math.isinf(hi):
        return f">= {lo:g} {unit}".rstrip()
    return f"{lo:g}..{hi:g} {unit}".rstrip()


def _bad_value(values: Sequence[float], spec: MetricSpec, record: RunRecord) -> str | None:
    """How a value among ``values`` is no number a run can produce, if one is: NaN,
    infinite, outside the metric's plausible range, or more requests served than the run
    had."""
    lo, hi = plausible_range(spec)
    limit = record.summary.get("num_requests")
    if spec.name in (*REQUEST_GATES, "rejected") and isinstance(limit, int | float):
        hi = min(hi, float(limit))
    for v in values:
        if not math.isfinite(v):
            return str(v)
        if not lo <= v <= hi:
            return f"{v:g}, outside the plausible range {_range_text(lo, hi, spec.unit)}"
    return None


def _has_curve(rec: RunRecord, name: str) -> bool:
    return bool(rec.curves.get(name)) and CURVE_TIME in rec.curves


def _curve_shape(rec: RunRecord, which: str, name: str) -> str | None:
    """Why a record's curve does not fit its time axis, if it does not."""
    values, times = rec.curves[name], rec.curves[CURVE_TIME]
    if len(values) == len(times):
        return None
    return (f"the {which} record's curve {name} has {len(values)} points but its time axis "
            f"{CURVE_TIME} has {len(times)}")


def _bad_curve(rec: RunRecord, name: str) -> str | None:
    """How a curve or its time axis holds a value no run can produce, if it does."""
    axis = _bad_value(rec.curves[CURVE_TIME], CURVE_BY_NAME[CURVE_TIME], rec)
    return (_bad_value(rec.curves[name], CURVE_BY_NAME[name], rec)
            or (axis and f"{axis} on its time axis {CURVE_TIME}"))


class _Gate:
    """One pair's records and settings, and the checks every metric and curve goes through
    before it is compared, in order: present on both sides, plausible values, same
    machine for timing."""

    def __init__(self, new: RunRecord, base: RunRecord, th: Thresholds, base_path: str):
        self.new, self.base, self.th, self.base_path = new, base, th, base_path
        self.same_machine = machine_slug(new.machine) == machine_slug(base.machine)

    def row(self, metric: str, verdict: Verdict, kind: str | None, detail: str) -> Row:
        return Row(suite=self.new.suite, engine=self.new.engine, metric=metric,
                   verdict=verdict, kind=kind, detail=detail)  # type: ignore[arg-type]

    def other_machine(self, name: str, kind: str) -> bool:
        return kind == "timing" and not self.same_machine and name not in REQUEST_GATES

    def precheck(self, metric: str, spec: MetricSpec, kind: str, in_base: bool,
                 in_new: bool) -> Row | None:
        """The row of a metric or curve that is not in both records, if it is not."""
        if in_base and in_new:
            return None
        if not in_base and not in_new:
            if spec.needs:
                return None  # what it needs (a CUDA device, an SLO, ...) this run lacks
            if self.other_machine(spec.name, kind):
                return self.row(metric, "skipped", kind, OTHER_MACHINE)
            return self.row(metric, "skipped", kind, "in neither record (absent or null)")
        if not in_base:
            return self.row(metric, "unusable", kind, NOT_IN_BASELINE)
        what = "curve" if metric.startswith(CURVE_ROW_PREFIX) else "metric"
        return self.row(metric, "unusable", kind, f"missing {what}: the baseline has it, the "
                        "new record does not (absent or null)")

    def value_check(self, metric: str, kind: str, base_bad: str | None,
                    new_bad: str | None) -> Row | None:
        """The row of a metric or curve with a value no run can produce, or from another
        machine, if it is either."""
        curve = metric.startswith(CURVE_ROW_PREFIX)
        if base_bad is not None:
            return self.row(metric, "unusable", kind, (
                f"the baseline curve holds {base_bad}" if curve else
                f"the baseline's value is {base_bad}") + ", which cannot be compared; save a "
                f"baseline from a run that measured it ({self.base_path})")
        if new_bad is not None:
            return self.row(metric, "invalid", kind, (
                f"the new curve holds {new_bad}" if curve else f"the new value is {new_bad}")
                + ": the run measured no usable number")
        if self.other_machine(metric.removeprefix(CURVE_ROW_PREFIX), kind):
            return self.row(metric, "skipped", kind, OTHER_MACHINE)
        return None

    def metric_row(self, name: str, rule: MetricRule) -> Row | None:
        spec = METRIC_BY_NAME[name]
        kind = resolve_kind(spec.kind, self.new)
        b, n = metric_values(self.base, name), metric_values(self.new, name)
        found = self.precheck(name, spec, kind, b is not None, n is not None)
        if found is not None or b is None or n is None:
            return found
        found = self.value_check(name, kind, _bad_value(b, spec, self.base),
                                 _bad_value(n, spec, self.new))
        return found or compare_metric(name, rule, kind, b, n, self.th).model_copy(
            update={"suite": self.new.suite, "engine": self.new.engine})

    def curve_row(self, name: str, rule: MetricRule) -> Row | None:
        spec = CURVE_BY_NAME[name]
        kind = resolve_kind(spec.kind, self.new)
        metric = f"{CURVE_ROW_PREFIX}{name}"
        in_base, in_new = _has_curve(self.base, name), _has_curve(self.new, name)
        found = self.precheck(metric, spec, kind, in_base, in_new)
        if found is not None or not (in_base and in_new):
            return found
        shape = _curve_shape(self.base, "baseline", name) or _curve_shape(self.new, "new", name)
        if shape:
            return self.row(metric, "unusable", kind, shape)
        found = self.value_check(metric, kind, _bad_curve(self.base, name),
                                 _bad_curve(self.new, name))
        return found or compare_curve(name, rule, kind, self.base, self.new, self.th).model_copy(
            update={"suite": self.new.suite, "engine": self.new.engine})


def _speed_row(gate: _Gate, rows: list[Row]) -> Row | None:
    """On the wall clock a run's speed is timing: from another machine none of it is
    compared, and the gate says so rather than passing quietly."""
    skipped = sum(r.detail == OTHER_MACHINE for r in rows)
    if gate.new.clock != "wall" or not skipped:
        return None
    return gate.row(SPEED_ROW, "uncompared", "timing", (
        f"nothing of this run's speed was compared: the baseline ran on "
        f"{machine_slug(gate.base.machine)}, this run on {machine_slug(gate.new.machine)}, "
        f"and timing is compared only on one machine ({skipped} timing metrics and curves "
        "skipped); save a baseline on this machine (kvbench baseline save) to gate them"
    ))


def _baseline_gaps(gate: _Gate, rows: list[Row]) -> Row | None:
    """One row naming the baseline file and every gated metric and curve it lacks: a
    baseline must hold what it is compared on."""
    lacking = [r.metric for r in rows if r.detail == NOT_IN_BASELINE]
    if not lacking:
        return None
    return gate.row(INPUT_ROW, "unusable", None, (
        f"the baseline {gate.base_path} lacks {len(lacking)} gated metrics and curves the new "
        f"record has (absent or null): {', '.join(lacking)}; save a baseline from a complete "
        "run with this kvbench (kvbench baseline save)"
    ))


def _partial_check(gate: _Gate, rows: list[Row], allow_partial: bool,
                   speed_row: bool) -> Row | str | None:
    """Fewer than half of the gated metrics and curves the pair could compare compared:
    an unusable row, or with ``allow_partial`` a note. Timing ones from another machine
    are left to the speed row where there is one."""
    if any(r.verdict == "unusable" for r in rows):
        return None
    comparable = [r for r in rows if not (speed_row and r.detail == OTHER_MACHINE)]
    judged = sum(r.verdict in JUDGED for r in comparable)
    if rows and not comparable:
        return None
    if comparable and 2 * judged >= len(comparable):
        return None
    names = ", ".join(r.metric for r in comparable if r.verdict not in JUDGED)
    text = (f"only {judged} of {len(comparable)} gated metrics and curves could be compared "
            f"(not compared: {names})" if comparable else
            "none of the gated metrics and curves is in these records")
    if allow_partial:
        return text + "; allowed by --allow-partial"
    return gate.row(INPUT_ROW, "unusable", None, text + "; compare records that hold them, "
                    "or pass --allow-partial to accept a partial comparison")


def compare_pair(
    new: RunRecord, base: RunRecord, th: Thresholds, *, base_path: str = "the baseline file",
    allow_partial: bool = False,
) -> tuple[list[Row], list[str]]:
    """Rows for one (suite, engine) pair and notes about it."""
    def row(**kw) -> Row:
        return Row(suite=new.suite, engine=new.engine, **kw)

    problems = _input_problems(new, base)
    if problems:
        return [row(metric=INPUT_ROW, verdict="unusable", detail=p) for p in problems], []
    if new.status != "ok":
        # An incomplete run's metrics describe only part of the workload: judge the status.
        error = new.error.splitlines()[0] if new.error else ""
        detail = f"run ended {new.status!r} {error}".strip()
        return [row(metric=STATUS_ROW, verdict="regression", detail=detail)], []
    gate = _Gate(new, base, th, base_path)
    rows = [r for r in (
        *(gate.metric_row(name, rule) for name, rule in th.metrics.items()),
        *(gate.curve_row(name, rule) for name, rule in th.curves.items()),
    ) if r is not None]
    speed = _speed_row(gate, rows)
    # The speed row names both machines; the note would repeat it.
    notes = _notes(new, base, gate.same_machine or speed is not None)
    partial = _partial_check(gate, rows, allow_partial, speed is not None)
    if isinstance(partial, str):
        notes.append(partial)
    gaps = _baseline_gaps(gate, rows)
    return [*(x for x in (gaps, partial, speed) if isinstance(x, Row)), *rows], notes


def pick_baseline(
    new: FoundRecord, candidates: list[FoundRecord]
) -> tuple[FoundRecord | None, str, Verdict | None]:
    """The baseline for a new record among those of its (suite, engine): the only one; else
    the one from the same machine; else the machine-independent virtual-clock one. Returns
    the record, or why there is none and the verdict that makes of the pair (None: a
    note)."""
    if len(candidates) == 1:
        return candidates[0], "", None
    slug = machine_slug(new.record.machine)
    for label, subset in (
        ("this machine", [c for c in candidates if machine_slug(c.record.machine) == slug]),
        ("the virtual clock", [c for c in candidates if c.record.clock == "virtual"]),
    ):
        if len(subset) == 1:
            return subset[0], "", None
        if len(subset) > 1:
            paths = ", ".join(str(c.path) for c in subset)
            return None, f"several baselines for {label}: {paths}; name one folder", "unusable"
    if not candidates:
        return None, "no baseline for this suite and engine: not compared", None
    machines = sorted({machine_slug(c.record.machine) for c in candidates})
    return None, (
        f"nothing of this run was compared: no baseline for {slug} (baselines exist for "
        f"{', '.join(machines)}); save one on this machine (kvbench baseline save)"
    ), "uncompared"


def _compare_one(
    f: FoundRecord, candidates: list[FoundRecord], th: Thresholds, allow_partial: bool
) -> tuple[Pair, list[Row]]:
    """One new record against its baseline among ``candidates``."""
    base, why, verdict = pick_baseline(f, candidates)
    rec = f.record
    pair = Pair(suite=rec.suite, engine=rec.engine, new_path=str(f.path),
                baseline_path=str(base.path) if base else None,
                new_machine=machine_slug(rec.machine),
                baseline_machine=machine_slug(base.record.machine) if base else None,
                clock=rec.clock)
    if base is None:
        if verdict is None:
            pair.notes.append(why)
            return pair, []
        return pair, [Row(suite=rec.suite, engine=rec.engine, metric=INPUT_ROW,
                          verdict=verdict, detail=why)]
    rows, notes = compare_pair(rec, base.record, th, base_path=str(base.path),
                               allow_partial=allow_partial)
    pair.notes += notes
    return pair, rows


def compare_records(
    new: Sequence[FoundRecord], baseline: Sequence[FoundRecord], th: Thresholds,
    *, strict: bool = False, allow_missing: bool = False, allow_partial: bool = False,
    thresholds_path: str = "", relaxed: Sequence[str] = (),
) -> CompareResult:
    """Every new record against its baseline. ``allow_missing``: a baseline engine the new
    run lacks is skipped instead of failing. ``allow_partial``: a pair where fewer than
    half of the gated metrics could be compared is a note instead of unusable.
    ``relaxed``: the gates of the defaults the thresholds drop or loosen, for the reports."""
    result = CompareResult(strict=strict, thresholds=thresholds_path, relaxed=list(relaxed))
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
        pair, rows = _compare_one(found[0], base_by_key.get((suite, engine), []), th,
                                  allow_partial)
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
    # Without any baseline nothing was judged: not a pass, even where it says why.
    if not any(p.baseline_path for p in result.pairs) and not any(
        r.verdict in ("unusable", "missing") for r in result.rows
    ):
        result.rows.append(Row(suite="", engine="", metric=INPUT_ROW, verdict="unusable",
                               detail="no new record has a baseline: nothing was compared"))
    return result
