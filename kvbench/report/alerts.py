"""Alert rules: monitoring thresholds on what a run measured, the way an operator pages on a
gauge. The seeds give three (SEED-CLAIMS C6-C8), the default set:

- ``frag_index<0.7``: the fragmentation index (largest free extent / free KV memory) falls
  below 0.7 at some step (C6: "healthy above 0.7");
- ``page_turnover_per_s>50``: KV page allocations plus frees per second of run exceed 50
  (C7: "alert above 50 per second");
- ``prefix_hit_rate<0.8``: prompt tokens served from the prefix cache are under 80% of those
  looked up (C8: "should exceed 80%").

A rule is ``NAME<VALUE`` or ``NAME>VALUE``; ``NAME`` is a summary metric of the record or,
failing that, one of its curves (``frag_index`` is a curve: the rule fires if any point
crosses, and says for how much of the run). ``--alerts default`` is the set above; rules after
it replace the default rule of the same name or add to it (``default,page_turnover_per_s>500``);
rules without ``default`` are the whole set.

A rule whose metric a record does not have (an engine that cannot observe it, prefix caching
off) is *not evaluated* for that record, never fired. Alerts are opt-in: when asked for, a
fired alert is a failure (``kvbench compare`` exits 1; JUnit: a failure of type ``alert``);
``kvbench run`` lists them and leaves its exit status to the engines. CI that wants them as
warnings runs them in a step allowed to fail.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvbench.errors import KvbenchError
from kvbench.results.schema import RunRecord

DEFAULT_KEYWORD = "default"
_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*([<>])\s*([-+0-9.eE]+)\s*$")

Verdict = Literal["fired", "ok", "not evaluated"]


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    op: Literal["<", ">"]
    threshold: float
    source: str = ""

    def __str__(self) -> str:
        return f"{self.name}{self.op}{self.threshold:g}"

    def crosses(self, value: float) -> bool:
        return value < self.threshold if self.op == "<" else value > self.threshold


DEFAULT_RULES: tuple[AlertRule, ...] = (
    AlertRule("frag_index", "<", 0.7, "C6"),
    AlertRule("page_turnover_per_s", ">", 50.0, "C7"),
    AlertRule("prefix_hit_rate", "<", 0.8, "C8"),
)


def parse_rules(text: str) -> tuple[AlertRule, ...]:
    """Rules from ``--alerts``: comma-separated ``NAME<VALUE`` / ``NAME>VALUE``, with
    ``default`` standing for the seeds' set."""
    rules: dict[str, AlertRule] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part == DEFAULT_KEYWORD:
            for rule in DEFAULT_RULES:
                rules.setdefault(rule.name, rule)
            continue
        m = _RULE.match(part)
        try:
            threshold = float(m.group(3)) if m else math.nan
        except ValueError:
            threshold = math.nan
        if m is None or not math.isfinite(threshold):
            raise KvbenchError(
                f"--alerts: {part!r} is not a rule; write NAME<VALUE or NAME>VALUE, e.g. "
                f"{', '.join(map(str, DEFAULT_RULES))}, or {DEFAULT_KEYWORD!r} for those"
            )
        rules[m.group(1)] = AlertRule(m.group(1), m.group(2), threshold)  # type: ignore[arg-type]
    if not rules:
        raise KvbenchError(f"--alerts: no rules given; e.g. --alerts {DEFAULT_KEYWORD}")
    return tuple(rules.values())


@dataclass(frozen=True, slots=True)
class Alert:
    """One rule judged on one record."""

    rule: AlertRule
    suite: str
    engine: str
    verdict: Verdict
    value: float | None = None
    detail: str = ""


def evaluate(record: RunRecord, rules: Sequence[AlertRule]) -> list[Alert]:
    return [_judge(record, rule) for rule in rules]


def evaluate_all(records: Sequence[RunRecord], rules: Sequence[AlertRule]) -> list[Alert]:
    return [a for r in records for a in evaluate(r, rules)]


def unknown_rules(records: Sequence[RunRecord], rules: Sequence[AlertRule]) -> list[AlertRule]:
    """Rules whose name is neither a summary metric nor a curve of any of ``records``."""
    return [rule for rule in rules
            if not any(rule.name in r.summary or rule.name in r.curves for r in records)]


def _judge(record: RunRecord, rule: AlertRule) -> Alert:
    def alert(verdict: Verdict, value: float | None = None, detail: str = "") -> Alert:
        return Alert(rule, record.suite, record.engine, verdict, value, detail)

    if record.status != "ok":
        return alert("not evaluated", detail=f"run ended {record.status!r}")
    value = record.summary.get(rule.name)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return alert("fired" if rule.crosses(value) else "ok", float(value))
    curve = record.curves.get(rule.name)
    if curve:
        return _judge_curve(record, rule, curve, alert)
    return alert("not evaluated", detail=f"the record has no {rule.name}")


def _judge_curve(record: RunRecord, rule: AlertRule, curve: list[float], alert) -> Alert:
    worst = min(curve) if rule.op == "<" else max(curve)
    crossing = [i for i, v in enumerate(curve) if rule.crosses(v)]
    if not crossing:
        return alert("ok", worst, "worst point of the curve")
    t = record.curves.get("t_s") or []
    detail = f"worst point of the curve; crossed at {len(crossing)} of {len(curve)} points"
    if len(t) == len(curve) and t[-1] > 0:
        # A point covers the steps since the previous one (curves keep each bucket's worst).
        spans = [t[i] - (t[i - 1] if i else 0.0) for i in crossing]
        detail += f", {100 * sum(spans) / t[-1]:.0f}% of the run, first at {t[crossing[0]]:.3g} s"
    return alert("fired", worst, detail)
