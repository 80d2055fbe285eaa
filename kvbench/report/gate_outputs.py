"""The gate's outputs: a Markdown summary (PR comment, job summary), JUnit XML (one testcase
per suite x engine x metric) and JSON (every row, for tools)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from kvbench.report.compare import OTHER_MACHINE, CompareResult, Row
from kvbench.results.metric_table import spec_for_row
from kvbench.units import format_bytes

_ORDER = {"unusable": 0, "invalid": 1, "regression": 2, "missing": 3, "uncompared": 4,
          "improvement": 5, "skipped": 6, "pass": 7}
# Headline words of the failing verdicts, in order.
_FAILURES = {"invalid": "INVALID VALUES", "regression": "REGRESSION", "missing": "MISSING RECORDS",
             "uncompared": "NOT COMPARED", "improvement": "IMPROVEMENT (strict)"}
_LEGEND = (
    "A change counts beyond *allowed*: for deterministic metrics a float-rounding tolerance; "
    "for timing metrics max(tolerance x baseline median, absolute tolerance, noise_k x "
    "baseline spread), medians over repeats."
)


def format_value(metric: str, value: float | None) -> str:
    """A value of the gate row ``metric`` (a metric or ``curve:NAME``): sizes in binary
    units, other numbers plain (changes and bands of fractions are no percentages)."""
    if value is None:
        return "-"
    spec = spec_for_row(metric)
    if spec is not None and spec.unit == "bytes":
        return format_bytes(value)
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.4g}"


def _change(row: Row) -> str:
    if row.change is None:
        return "-"
    text = format_value(row.metric, row.change)
    text = text if text.startswith("-") else "+" + text
    pct = row.change_pct
    return f"{text} ({pct:+.1f}%)" if pct is not None else text


def _allowed(row: Row) -> str:
    if row.allowed is None:
        return "-"
    return "±" + format_value(row.metric, row.allowed)


def _verdict(result: CompareResult, row: Row) -> str:
    word = row.verdict.upper() if row.verdict != "pass" else "pass"
    return f"**{word}**" if result.failing(row) or row.verdict == "unusable" else word


def _table(result: CompareResult, rows: list[Row]) -> list[str]:
    lines = [
        "| verdict | suite | engine | metric | kind | baseline | new | change | allowed | detail |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        base = format_value(r.metric, r.baseline)
        if r.baseline_repeats and r.baseline_repeats > 1:
            base += f" (n={r.baseline_repeats})"
        cells = [_verdict(result, r), r.suite, r.engine, f"`{r.metric}`", r.kind or "-", base,
                 format_value(r.metric, r.new), _change(r), _allowed(r), r.detail]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def _headline(result: CompareResult) -> str:
    if result.exit_code == 2:
        return "UNUSABLE INPUT"
    failing = {r.verdict for r in result.rows if result.failing(r)}
    words = [w for v, w in _FAILURES.items() if v in failing]
    return ", ".join(words) if words else "PASS"


def _coverage(result: CompareResult) -> list[str]:
    """How much of what the thresholds gate was compared (nothing to say where no record
    reached the comparison)."""
    if not result.pairs:
        return []
    compared, gated = result.gated
    text = f"Compared {compared} of {gated} gated metrics and curves"
    speed = sum(r.detail == OTHER_MACHINE for r in result.rows)
    if speed:
        text += f"; {speed} timing ones not compared (baseline from another machine)"
    return [text + ".", ""]


def _relaxed(result: CompareResult) -> list[str]:
    if not result.relaxed:
        return []
    return [f"**Thresholds looser than kvbench's defaults** (`{result.thresholds}`): "
            + "; ".join(result.relaxed) + ".", ""]


def markdown_summary(result: CompareResult, *, details: bool = True) -> str:
    """``details`` adds the passed and skipped rows in a collapsed block."""
    code = result.exit_code
    counts = ", ".join(
        f"{result.count(v)} {v}" for v in ("regression", "invalid", "missing", "uncompared",
                                           "improvement", "unusable", "pass", "skipped")
        if result.count(v)
    )
    lines = [
        f"## kvbench compare: {_headline(result)}",
        "",
        f"{counts} (exit {code}; thresholds `{result.thresholds}`"
        + ("; strict: improvements and runs not compared fail" if result.strict else "") + ")",
        "",
        *_coverage(result),
        *_relaxed(result),
    ]
    notable = sorted((r for r in result.rows if r.verdict not in ("pass", "skipped")),
                     key=lambda r: _ORDER[r.verdict])
    if notable:
        lines += [*_table(result, notable), "", _LEGEND, ""]
    if result.pairs:
        lines += ["| suite | engine | clock | new record | baseline |", "|---|---|---|---|---|"]
        for p in result.pairs:
            lines.append(f"| {p.suite} | {p.engine} | {p.clock} | `{p.new_path}` "
                         f"| {f'`{p.baseline_path}`' if p.baseline_path else '-'} |")
        lines.append("")
    notes = [f"- {p.suite}/{p.engine}: {n}" for p in result.pairs for n in p.notes]
    if notes:
        lines += ["Notes:", *notes, ""]
    rest = [r for r in result.rows if r.verdict in ("pass", "skipped")]
    if rest and details:
        lines += [f"<details><summary>{len(rest)} passed or skipped</summary>", "",
                  *_table(result, rest), "", "</details>", ""]
    return "\n".join(lines)


def junit_xml(result: CompareResult) -> str:
    suite = ET.Element("testsuite", name="kvbench compare", tests=str(len(result.rows)))
    failures = errors = skipped = 0
    for r in result.rows:
        case = ET.SubElement(
            suite, "testcase", classname=f"kvbench.{r.suite or 'inputs'}.{r.engine or 'all'}",
            name=r.metric,
        )
        message = (f"baseline {format_value(r.metric, r.baseline)}, new "
                   f"{format_value(r.metric, r.new)}, change {_change(r)}, allowed "
                   f"{_allowed(r)}" if r.change is not None else r.detail)
        if r.verdict == "unusable":
            errors += 1
            ET.SubElement(case, "error", message=r.detail, type="unusable").text = r.detail
        elif result.failing(r):
            failures += 1
            ET.SubElement(case, "failure", message=message, type=r.verdict).text = (
                f"{r.verdict}: {message}. {r.detail}".strip()
            )
        elif r.verdict in ("skipped", "uncompared"):
            skipped += 1
            ET.SubElement(case, "skipped", message=r.detail)
        else:
            ET.SubElement(case, "system-out").text = f"{r.verdict}: {message}"
    suite.set("failures", str(failures))
    suite.set("errors", str(errors))
    suite.set("skipped", str(skipped))
    root = ET.Element("testsuites")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def json_report(result: CompareResult) -> str:
    data = result.model_dump()
    data["exit_code"] = result.exit_code
    data["compared"], data["gated"] = result.gated
    for row, dumped in zip(result.rows, data["rows"], strict=True):
        dumped["change_pct"] = row.change_pct
    return json.dumps(data, indent=1) + "\n"
