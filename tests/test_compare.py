"""The regression gate: exit codes, the noise rule, curves, merging and report formats."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from record_factory import changed, make_record, write
from typer.testing import CliRunner

from helpers import REPO
from kvbench.cli.app import app
from kvbench.report.compare import compare_metric, compare_records, mad_spread, slice_max
from kvbench.report.thresholds import MetricRule, Thresholds, load_thresholds
from kvbench.results.recordset import FoundRecord
from kvbench.results.repeats import fold_repeats, metric_values

THRESHOLDS = REPO / "ci" / "thresholds.toml"


def run_compare(new: Path, base: Path, *extra: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        app, ["compare", str(new), str(base), "--thresholds", str(THRESHOLDS), *extra],
        catch_exceptions=False,
    )
    return result.exit_code, result.output


@pytest.fixture(params=["virtual", "wall"])
def clock(request) -> str:
    return request.param


def test_record_against_itself_passes(tmp_path: Path, clock: str) -> None:
    path = write(make_record(clock=clock), tmp_path)
    code, out = run_compare(path, path)
    assert code == 0, out
    assert "PASS" in out


@pytest.mark.parametrize("metric", ["peak_kv_reserved_bytes", "memory_growth_pct"])
def test_memory_raised_20_pct_fails(tmp_path: Path, clock: str, metric: str) -> None:
    base = make_record(clock=clock)
    if metric not in base.summary:  # older records predate the metric
        base = changed(base, **{metric: 40.0})
    new = changed(base, **{metric: base.summary[metric] * 1.2})
    code, out = run_compare(write(new, tmp_path / "new"), write(base, tmp_path / "base"))
    assert code == 1, out
    assert "REGRESSION" in out and metric in out


def test_improvement_is_reported_and_strict_fails(tmp_path: Path) -> None:
    base = make_record()
    new = changed(base, peak_kv_reserved_bytes=int(base.summary["peak_kv_reserved_bytes"] * 0.8))
    new_path, base_path = write(new, tmp_path / "new"), write(base, tmp_path / "base")
    code, out = run_compare(new_path, base_path)
    assert code == 0, out
    assert "IMPROVEMENT" in out
    code, out = run_compare(new_path, base_path, "--strict")
    assert code == 1, out


@pytest.mark.parametrize(
    ("change", "message"),
    [({"digest": "other"}, "different workload digest"), ({"clock": "wall"}, "different clock")],
)
def test_other_workload_or_clock_is_unusable(tmp_path: Path, change: dict, message: str) -> None:
    base = make_record()
    new = make_record(**change)
    code, out = run_compare(write(new, tmp_path / "new"), write(base, tmp_path / "base"))
    assert code == 2, out
    assert message in out


def test_schema_mismatch_is_unusable_and_still_reported(tmp_path: Path) -> None:
    base_path = write(make_record(), tmp_path / "base")
    data = json.loads(base_path.read_text())
    data["schema_version"] = 999
    new_path = tmp_path / "new.json"
    new_path.write_text(json.dumps(data))
    junit = tmp_path / "junit.xml"
    code, out = run_compare(new_path, base_path, "--junit", str(junit))
    assert code == 2
    assert "schema_version 999" in out
    assert ET.parse(junit).getroot().find("testsuite").get("errors") == "1"


def test_missing_metric_is_unusable(tmp_path: Path) -> None:
    base = make_record()
    summary = dict(base.summary)
    del summary["peak_kv_reserved_bytes"]
    new = base.model_copy(update={"summary": summary})
    code, out = run_compare(write(new, tmp_path / "new"), write(base, tmp_path / "base"))
    assert code == 2
    assert "missing metric" in out and "peak_kv_reserved_bytes" in out


def test_failed_run_is_a_regression(tmp_path: Path) -> None:
    base = make_record()
    new = make_record(status="failed")
    code, out = run_compare(write(new, tmp_path / "new"), write(base, tmp_path / "base"))
    assert code == 1
    assert "`status`" in out


# --- the noise rule ---------------------------------------------------------------------

RULE = MetricRule(tolerance=0.02)  # median_ttft_ms: lower is better (the metric table)
TH = Thresholds(metrics={"median_ttft_ms": RULE})
# median 100, |deviations| 0,10,10,5,5 -> MAD 5 -> spread 7.41 -> band 3 x 7.41 = 22.2 ms
NOISY_BASE = [100.0, 110.0, 90.0, 105.0, 95.0]


def test_mad_spread() -> None:
    assert mad_spread(NOISY_BASE) == pytest.approx(1.4826 * 5)
    assert mad_spread([7.0]) == 0.0


def test_timing_regression_below_noise_band_passes() -> None:
    new = [115.0, 114.0, 116.0]  # +15%: beyond the 2% tolerance, inside the noise
    row = compare_metric("median_ttft_ms", RULE, "timing", NOISY_BASE, new, TH)
    assert row.verdict == "pass"
    assert row.allowed == pytest.approx(3 * 1.4826 * 5)


def test_timing_regression_above_noise_band_fails() -> None:
    new = [130.0, 128.0, 131.0]
    row = compare_metric("median_ttft_ms", RULE, "timing", NOISY_BASE, new, TH)
    assert row.verdict == "regression"


def test_timing_single_baseline_repeat_uses_tolerance() -> None:
    row = compare_metric("median_ttft_ms", RULE, "timing", [100.0], [103.0], TH)
    assert row.verdict == "regression" and row.allowed == pytest.approx(2.0)


def test_deterministic_any_change_counts() -> None:
    row = compare_metric("median_ttft_ms", RULE, "deterministic", [100.0], [100.001], TH)
    assert row.verdict == "regression"


def _wall_with_repeats(values: list[float]) -> dict:
    rec = make_record(clock="wall")
    runs = [changed(rec, median_ttft_ms=v) for v in values]
    return fold_repeats(runs)


def test_repeats_through_the_cli(tmp_path: Path) -> None:
    """Synthetic repeat sets in wall-clock records: the gate reads medians and spread."""
    base = _wall_with_repeats([100.0, 140.0, 60.0, 120.0, 80.0])  # spread 29.7 -> band 89
    base_path = write(base, tmp_path / "base")
    inside = _wall_with_repeats([150.0, 160.0, 170.0])  # +60: beyond 10%, inside the noise
    code, out = run_compare(write(inside, tmp_path / "inside"), base_path)
    assert code == 0, out
    above = _wall_with_repeats([200.0, 210.0, 190.0])  # +100: beyond the noise
    code, out = run_compare(write(above, tmp_path / "above"), base_path)
    assert code == 1, out
    assert "median_ttft_ms" in out


def test_fold_repeats_keeps_values_and_medians() -> None:
    rec = make_record(clock="wall")
    runs = [changed(rec, median_ttft_ms=v, max_concurrent_requests=c, duration_s=d)
            for v, c, d in ((3.0, 5, 2.0), (1.0, 6, 1.0), (2.0, 8, 3.0))]
    folded = fold_repeats(runs)
    assert folded.summary["median_ttft_ms"] == 2.0
    assert folded.summary["max_concurrent_requests"] == 6
    assert isinstance(folded.summary["max_concurrent_requests"], int)
    assert metric_values(folded, "median_ttft_ms") == [3.0, 1.0, 2.0]
    failed = changed(rec).model_copy(update={"status": "failed"})
    assert fold_repeats([rec, failed]).status == "failed"


# --- curves -----------------------------------------------------------------------------

def test_slice_max_holds_values_between_samples() -> None:
    # The point at t=4 covers the step from t=2 to t=4, so slice 3 (t 2..3) takes it.
    out = slice_max([1.0, 2.0, 4.0], [5.0, 7.0, 1.0], 4)
    assert out.tolist() == [5.0, 7.0, 1.0, 1.0]


def _curve_record(values: list[float], clock: str = "virtual"):
    t = [float(i) for i in range(1, len(values) + 1)]
    return make_record(clock=clock, curves={"t_s": t, "kv_reserved_bytes": values})


def test_curve_bump_fails_even_when_peak_metric_passes() -> None:
    th = load_thresholds(THRESHOLDS)
    flat = [10.0] * 50 + [100.0] + [10.0] * 49
    bump = [10.0] * 20 + [50.0] * 10 + [10.0] * 20 + [100.0] + [10.0] * 49
    result = compare_records([FoundRecord(Path("new"), _curve_record(bump))],
                             [FoundRecord(Path("base"), _curve_record(flat))], th)
    rows = {r.metric: r for r in result.rows}
    assert rows["curve:kv_reserved_bytes"].verdict == "regression"
    assert rows["peak_kv_reserved_bytes"].verdict == "pass"


def test_curve_drop_is_an_improvement() -> None:
    th = load_thresholds(THRESHOLDS)
    flat = [10.0] * 50 + [100.0] + [10.0] * 49
    bump = [10.0] * 20 + [50.0] * 10 + [10.0] * 20 + [100.0] + [10.0] * 49
    result = compare_records([FoundRecord(Path("new"), _curve_record(flat))],
                             [FoundRecord(Path("base"), _curve_record(bump))], th)
    rows = {r.metric: r for r in result.rows}
    assert rows["curve:kv_reserved_bytes"].verdict == "improvement"


def test_timing_curve_tolerates_small_time_shift() -> None:
    th = load_thresholds(THRESHOLDS)
    base = [0.0] * 50 + [100.0] * 50
    shifted = [0.0] * 49 + [100.0] * 51  # 1% earlier: a step edge that moved, not growth
    result = compare_records([FoundRecord(Path("n"), _curve_record(shifted, "wall"))],
                             [FoundRecord(Path("b"), _curve_record(base, "wall"))], th)
    rows = {r.metric: r for r in result.rows}
    assert rows["curve:kv_reserved_bytes"].verdict == "pass"


# --- merging and matching ---------------------------------------------------------------

def test_records_from_shards_merge_and_overlap_is_unusable(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write(make_record("paged"), base)
    write(make_record("contiguous"), base)
    new = tmp_path / "artifacts"
    write(make_record("paged"), new / "shard-1")
    write(make_record("contiguous"), new / "shard-2")
    code, out = run_compare(new, base)
    assert code == 0, out
    write(make_record("paged"), new / "shard-3")
    code, out = run_compare(new, base)
    assert code == 2 and "duplicate" in out


def test_missing_engine_in_new_fails_unless_allowed(tmp_path: Path) -> None:
    base = tmp_path / "base"
    write(make_record("paged"), base)
    write(make_record("contiguous"), base)
    new = write(make_record("paged"), tmp_path / "new")
    code, out = run_compare(new, base)
    assert code == 1 and "no new record for this engine" in out
    assert "MISSING" in out and "contiguous" in out and "--allow-missing" in out
    code, out = run_compare(new, base, "--allow-missing")
    assert code == 0 and "PASS" in out, out


def test_junit_and_json_outputs(tmp_path: Path) -> None:
    base = make_record()
    new = changed(base, peak_kv_reserved_bytes=base.summary["peak_kv_reserved_bytes"] * 2)
    junit, js, md = tmp_path / "j.xml", tmp_path / "c.json", tmp_path / "c.md"
    code, _ = run_compare(write(new, tmp_path / "new"), write(base, tmp_path / "base"),
                          "--junit", str(junit), "--json", str(js), "--markdown", str(md))
    assert code == 1
    suite = ET.parse(junit).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert len({(c.get("classname"), c.get("name")) for c in cases}) == len(cases)
    failed = [c.get("name") for c in cases if c.find("failure") is not None]
    assert "peak_kv_reserved_bytes" in failed and suite.get("failures") == str(len(failed))
    data = json.loads(js.read_text())
    assert data["exit_code"] == 1
    assert any(r["metric"] == "peak_kv_reserved_bytes" and r["verdict"] == "regression"
               for r in data["rows"])
    assert md.read_text().startswith("## kvbench compare: REGRESSION")
