"""Alerts in the outputs: console lines, a Markdown section (``summary.md``, compare's
summary) and a JUnit test suite of their own ("kvbench alerts", one test case per rule and
record: a fired alert is a failure of type ``alert``, a rule not evaluated is skipped)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from kvbench.report.alerts import Alert

_MARK = {"fired": "**ALERT**", "ok": "ok", "not evaluated": "not evaluated"}


def fired(alerts: Sequence[Alert]) -> list[Alert]:
    return [a for a in alerts if a.verdict == "fired"]


def _value(a: Alert) -> str:
    return "-" if a.value is None else f"{a.value:.4g}"


def alert_lines(alerts: Sequence[Alert]) -> list[str]:
    """One line per fired alert, then a count of the rest."""
    hits = fired(alerts)
    lines = [f"ALERT {a.suite}/{a.engine}: {a.rule.name} = {_value(a)} (rule {a.rule}"
             + (f", {a.rule.source}" if a.rule.source else "") + ")"
             + (f"; {a.detail}" if a.detail else "") for a in hits]
    skipped = sum(a.verdict == "not evaluated" for a in alerts)
    ok = len(alerts) - len(hits) - skipped
    lines.append(f"alerts: {len(hits)} fired, {ok} ok"
                 + (f", {skipped} not evaluated" if skipped else ""))
    return lines


def alerts_markdown(alerts: Sequence[Alert]) -> str:
    rules = sorted({str(a.rule) for a in alerts})
    lines = [
        f"## Alerts: {len(fired(alerts))} fired",
        "",
        f"Rules: {', '.join(f'`{r}`' for r in rules)} (monitoring thresholds; see "
        "`kvbench.report.alerts`).",
        "",
        "| alert | suite | engine | rule | value | detail |",
        "|---|---|---|---|---:|---|",
    ]
    order = {"fired": 0, "not evaluated": 1, "ok": 2}
    for a in sorted(alerts, key=lambda a: order[a.verdict]):
        cells = [_MARK[a.verdict], a.suite, a.engine, f"`{a.rule}`", _value(a), a.detail]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def alerts_testsuite(alerts: Sequence[Alert]) -> ET.Element:
    suite = ET.Element("testsuite", name="kvbench alerts", tests=str(len(alerts)))
    failures = skipped = 0
    for a in alerts:
        case = ET.SubElement(suite, "testcase", classname=f"kvbench.alerts.{a.suite}.{a.engine}",
                             name=str(a.rule))
        message = f"{a.rule.name} = {_value(a)}" + (f"; {a.detail}" if a.detail else "")
        if a.verdict == "fired":
            failures += 1
            ET.SubElement(case, "failure", message=message, type="alert").text = (
                f"alert {a.rule}" + (f" ({a.rule.source})" if a.rule.source else "")
                + f": {message}"
            )
        elif a.verdict == "not evaluated":
            skipped += 1
            ET.SubElement(case, "skipped", message=a.detail)
        else:
            ET.SubElement(case, "system-out").text = f"ok: {message}"
    suite.set("failures", str(failures))
    suite.set("errors", "0")
    suite.set("skipped", str(skipped))
    return suite


def with_alerts_junit(junit: str, alerts: Sequence[Alert]) -> str:
    """``junit`` (a ``<testsuites>`` document) with the alerts' test suite added."""
    root = ET.fromstring(junit)
    root.append(alerts_testsuite(alerts))
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
