"""The ``--alerts`` option of ``kvbench run`` and ``kvbench compare``: its help, and what each
command does with the rules (see :mod:`kvbench.report.alerts`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbench.cli.options import err_console
from kvbench.fileio import write_text_atomic
from kvbench.report.alert_outputs import alert_lines, alerts_markdown, fired, with_alerts_junit
from kvbench.report.alerts import Alert, AlertRule, evaluate_all, unknown_rules
from kvbench.results.schema import RunRecord

ALERTS_HELP = (
    "Monitoring alerts: 'default' (frag_index<0.7, page_turnover_per_s>50, "
    "prefix_hit_rate<0.8) and/or NAME<VALUE / NAME>VALUE rules, comma-separated."
)
RUN_HELP = ALERTS_HELP + " Listed in the output and summary.md."
COMPARE_HELP = ALERTS_HELP + " On the new records; a fired alert fails (exit 1, JUnit failure)."


def judge(records: Sequence[RunRecord], rules: Sequence[AlertRule]) -> list[Alert]:
    """Every rule on every record; warns about a rule no record can answer."""
    for rule in unknown_rules(records, rules):
        err_console.print(f"[yellow]warning:[/] alert rule {rule}: no record has a metric or "
                          f"curve named {rule.name!r}", highlight=False)
    return evaluate_all(records, rules)


def report_run(records: Sequence[RunRecord], rules: Sequence[AlertRule], out_dir: Path) -> None:
    """``kvbench run --alerts``: the alerts printed and added to the run's summary.md."""
    alerts = judge(records, rules)
    for line in alert_lines(alerts):
        err_console.print(line, highlight=False, markup=False)
    summary = out_dir / "summary.md"
    text = summary.read_text(encoding="utf-8") if summary.exists() else ""
    write_text_atomic(summary, text + "\n" + alerts_markdown(alerts))


def gate_compare(records: Sequence[RunRecord], rules: Sequence[AlertRule], junit: str,
                 exit_code: int) -> tuple[str, str, int]:
    """``kvbench compare --alerts``: the alerts' Markdown section, the JUnit report with the
    alerts' test suite, and the exit code (1 when one fired and nothing worse happened)."""
    alerts = judge(records, rules)
    section = "\n" + alerts_markdown(alerts)
    code = exit_code or (1 if fired(alerts) else 0)
    return section, with_alerts_junit(junit, alerts), code
