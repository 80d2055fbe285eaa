"""Alert rules (the seeds' C6-C8 monitoring thresholds): parsing, judging records, the
outputs, and ``--alerts`` on run and compare."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from record_factory import changed, make_record, write
from typer.testing import CliRunner

from helpers import REPO
from kvbench.cli.app import app
from kvbench.errors import KvbenchError
from kvbench.report.alert_outputs import alerts_markdown, with_alerts_junit
from kvbench.report.alerts import DEFAULT_RULES, evaluate, parse_rules
from kvbench.report.compare import compare_records
from kvbench.report.gate_outputs import junit_xml
from kvbench.report.thresholds import load_thresholds
from kvbench.results.recordset import load_records

THRESHOLDS = str(REPO / "ci" / "thresholds.toml")


def _record(**summary):
    curves = {"t_s": [1.0, 2.0, 3.0, 4.0], "frag_index": [1.0, 0.6, 0.9, 0.5],
              "kv_reserved_bytes": [1.0, 2.0, 2.0, 1.0]}
    return changed(make_record(curves=curves), **summary)


def test_parse_default_overrides_and_errors() -> None:
    assert parse_rules("default") == DEFAULT_RULES
    rules = parse_rules("default, page_turnover_per_s>500")
    assert [str(r) for r in rules] == ["frag_index<0.7", "page_turnover_per_s>500",
                                       "prefix_hit_rate<0.8"]
    assert [str(r) for r in parse_rules("min_frag_index<0.5")] == ["min_frag_index<0.5"]
    for bad in ("frag_index=0.7", "frag_index<", "<0.7", "frag_index<nan", ""):
        with pytest.raises(KvbenchError, match="--alerts"):
            parse_rules(bad)


def test_summary_and_curve_rules() -> None:
    record = _record(page_turnover_per_s=80.0, prefix_hit_rate=None)
    by_name = {a.rule.name: a for a in evaluate(record, DEFAULT_RULES)}
    assert by_name["page_turnover_per_s"].verdict == "fired"
    assert by_name["page_turnover_per_s"].value == 80.0
    frag = by_name["frag_index"]
    assert frag.verdict == "fired" and frag.value == 0.5
    assert "2 of 4 points, 50% of the run, first at 2 s" in frag.detail
    assert by_name["prefix_hit_rate"].verdict == "not evaluated"
    calm = evaluate(_record(page_turnover_per_s=10.0), parse_rules("page_turnover_per_s>50"))
    assert [a.verdict for a in calm] == ["ok"]
    failed = make_record(status="failed")
    assert {a.verdict for a in evaluate(failed, DEFAULT_RULES)} == {"not evaluated"}


def test_markdown_and_junit_list_fired_alerts() -> None:
    alerts = evaluate(_record(page_turnover_per_s=80.0), DEFAULT_RULES)
    md = alerts_markdown(alerts)
    assert md.startswith("## Alerts: 2 fired")
    assert "| **ALERT** | unit | paged | `page_turnover_per_s>50` | 80 |" in md
    th = load_thresholds(THRESHOLDS)
    result = compare_records([], [], th)
    root = ET.fromstring(with_alerts_junit(junit_xml(result), alerts))
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["kvbench compare", "kvbench alerts"]
    assert suites[1].get("failures") == "2" and suites[1].get("skipped") == "1"
    failure = suites[1].find("testcase/failure")
    assert failure is not None and failure.get("type") == "alert"


def _compare(tmp_path: Path, alerts: str | None, **summary) -> tuple[int, Path]:
    base = write(_record(), tmp_path / "base")
    new = write(_record(**summary), tmp_path / "new")
    out = tmp_path / "reports"
    args = ["compare", str(new), str(base), "--thresholds", THRESHOLDS,
            "--markdown", str(out / "c.md"), "--junit", str(out / "j.xml")]
    if alerts is not None:
        args += ["--alerts", alerts]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    return result.exit_code, out


def test_compare_alerts_are_off_by_default_and_fail_when_asked(tmp_path: Path) -> None:
    code, out = _compare(tmp_path / "off", None, page_turnover_per_s=80.0)
    assert code == 0 and "Alerts" not in (out / "c.md").read_text()
    code, out = _compare(tmp_path / "on", "default", page_turnover_per_s=80.0)
    assert code == 1
    assert "## Alerts: 2 fired" in (out / "c.md").read_text()
    assert "kvbench alerts" in (out / "j.xml").read_text()
    code, _ = _compare(tmp_path / "raised", "page_turnover_per_s>100", page_turnover_per_s=80.0)
    assert code == 0


def test_compare_alerts_judge_the_new_records(tmp_path: Path) -> None:
    found = load_records([write(_record(page_turnover_per_s=80.0), tmp_path / "n")])
    assert evaluate(found[0].record, parse_rules("page_turnover_per_s>50"))[0].verdict == "fired"


def test_run_alerts_go_to_the_output_and_summary(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "run", "quick-sim", "--num-requests", "20", "--out", str(out),
        "--alerts", "default,nonexistent_metric>1",
    ], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "ALERT quick-sim/paged: page_turnover_per_s" in result.output
    assert "no record has a metric or curve named 'nonexistent_metric'" in result.output
    summary = (out / "summary.md").read_text()
    assert "## Alerts:" in summary and "`frag_index<0.7`" in summary
