"""Repeated runs of one engine folded into one record (``kvbench run --repeat N``).

The folded record is the repeat with the median ``duration_s`` (its curves and request rows
are real ones, not averages), with every numeric summary metric replaced by its median over
the repeats and ``summary["repeats"]`` holding each metric's per-repeat values in run order.
The compare gate reads medians and spreads from there.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from kvbench.results.schema import REPEATS_KEY, RunRecord, is_number


def fold_repeats(records: Sequence[RunRecord]) -> RunRecord:
    """One record for the repeats of one engine; a repeat that did not end ``ok`` is
    returned as it is, so that a failure is never hidden behind a median."""
    if not records:
        raise ValueError("no repeats to fold")
    for rec in records:
        if rec.status != "ok":
            return rec
    if len(records) == 1:
        return records[0]
    order = sorted(range(len(records)), key=lambda i: records[i].summary.get("duration_s") or 0)
    rep = records[order[(len(order) - 1) // 2]]
    summary = dict(rep.summary)
    values: dict[str, list[float]] = {}
    for key, value in rep.summary.items():
        column = [r.summary.get(key) for r in records]
        if not is_number(value) or not all(is_number(v) for v in column):
            continue
        values[key] = column  # type: ignore[assignment]
        # Integer metrics keep an observed value, so counts stay counts.
        if all(isinstance(v, int) for v in column):
            summary[key] = statistics.median_low(column)
        else:
            summary[key] = statistics.median(column)
    summary[REPEATS_KEY] = values
    states = [s for r in records for s in r.machine_state]
    warnings = list(dict.fromkeys(w for r in records for w in r.warnings))
    return rep.model_copy(update={"summary": summary, "machine_state": states,
                                  "warnings": warnings})


def metric_values(record: RunRecord, name: str) -> list[float] | None:
    """Per-repeat values of a summary metric (one value for a single run); None if absent
    or not a number."""
    repeats = record.summary.get(REPEATS_KEY)
    if isinstance(repeats, dict) and name in repeats:
        return [float(v) for v in repeats[name]]
    value = record.summary.get(name)
    return [float(value)] if is_number(value) else None


def repeat_count(record: RunRecord) -> int:
    repeats = record.summary.get(REPEATS_KEY)
    if isinstance(repeats, dict) and repeats:
        return max(len(v) for v in repeats.values())
    return 1
