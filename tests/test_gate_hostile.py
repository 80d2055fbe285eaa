"""Regressions dressed up to pass the gate: baselines that hold nothing, thresholds that drop
the default gates, impossible values, and wall-clock records from another machine. Each must
fail or be refused, saying why."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_main import cli
from record_factory import MACHINE, changed, make_record, write

from helpers import REPO
from kvbench.report.baselines import machine_slug
from kvbench.report.compare import compare_records, plausible_range
from kvbench.report.thresholds import load_thresholds, parse_thresholds, relaxations
from kvbench.results.metric_table import CURVE_BY_NAME, METRIC_BY_NAME
from kvbench.results.recordset import FoundRecord
from kvbench.results.repeats import fold_repeats

DEFAULTS_TEXT = (REPO / "kvbench" / "report" / "thresholds.toml").read_text(encoding="utf-8")
OTHER = {**MACHINE, "cpu": "Other CPU"}


@pytest.fixture
def kvbench(capsys, monkeypatch):
    def run(*args):
        code, out = cli(capsys, monkeypatch)(*args)
        assert "Traceback" not in out, out
        return code, out
    return run


def _hostile_new(base, **summary):
    """The new record: TTFT doubled and a request lost."""
    return changed(base, median_ttft_ms=base.summary["median_ttft_ms"] * 2,
                   completed=base.summary["completed"] - 1, **summary)


def _pair(tmp_path: Path, new, base) -> tuple[Path, Path]:
    return write(new, tmp_path / "new"), write(base, tmp_path / "base")


# --- 1. a baseline must hold what it is compared on ---------------------------------------

@pytest.mark.parametrize("clock", ["virtual", "wall"])
def test_empty_baseline_summary_is_unusable_naming_file_and_metrics(
    kvbench, tmp_path: Path, clock: str
) -> None:
    good = make_record(clock=clock)
    new, base = _pair(tmp_path, _hostile_new(good), make_record(clock=clock, summary={}))
    code, out = kvbench("compare", new, base)
    assert code == 2, out
    assert f"the baseline {base} lacks" in out
    assert "completed" in out and "median_ttft_ms" in out and "UNUSABLE INPUT" in out


def test_null_baseline_summary_is_unusable(kvbench, tmp_path: Path) -> None:
    base = write(make_record(), tmp_path / "base")
    data = json.loads(base.read_text())
    data["summary"] = None
    base.write_text(json.dumps(data))
    new = write(_hostile_new(make_record()), tmp_path / "new")
    code, out = kvbench("compare", new, base)
    assert code == 2, out
    assert str(base) in out and "summary" in out


@pytest.mark.parametrize("how", ["absent", "null"])
def test_baseline_lacking_gated_metrics_is_unusable(kvbench, tmp_path: Path, how: str) -> None:
    good = make_record()
    summary = dict(good.summary)
    for name in ("median_ttft_ms", "completed"):
        if how == "absent":
            del summary[name]
        else:
            summary[name] = None
    new, base = _pair(tmp_path, _hostile_new(good), make_record(summary=summary))
    code, out = kvbench("compare", new, base)
    assert code == 2, out
    assert f"the baseline {base} lacks 2 gated metrics" in out
    assert "completed, median_ttft_ms" in out or "median_ttft_ms, completed" in out


def test_baseline_lacking_a_gated_curve_is_unusable(kvbench, tmp_path: Path) -> None:
    good = make_record()
    base = make_record(curves={"t_s": [1.0, 2.0]})
    new, base_path = _pair(tmp_path, good, base)
    code, out = kvbench("compare", new, base_path)
    assert code == 2, out
    assert "lacks 1 gated metrics and curves" in out and "curve:kv_reserved_bytes" in out


def _sparse(**summary) -> dict:
    return {"num_requests": 10, **summary}


def test_fewer_than_half_compared_is_unusable_unless_allowed(kvbench, tmp_path: Path) -> None:
    # Both records hold only the request counts: the rest of what is gated is in neither.
    rec = make_record(summary=_sparse(completed=10, rejected=0))
    path = write(rec, tmp_path / "run")
    md = tmp_path / "c.md"
    code, out = kvbench("compare", path, path, "--markdown", md)
    assert code == 2, out
    assert "only 3 of" in out and "--allow-partial" in out
    assert "Compared 3 of" in md.read_text()
    code, out = kvbench("compare", path, path, "--allow-partial")
    assert code == 0, out
    assert "allowed by --allow-partial" in out and "Compared 3 of" in out


def test_both_summaries_empty_is_unusable(kvbench, tmp_path: Path) -> None:
    rec = make_record(summary={}, curves={})
    path = write(rec, tmp_path / "run")
    code, out = kvbench("compare", path, path)
    assert code == 2, out
    assert "only 0 of" in out and "Compared 0 of" in out


def test_nothing_gated_in_the_records_is_unusable(kvbench, tmp_path: Path) -> None:
    # Goodput needs an SLO, which this run lacks: the file gates nothing these records hold.
    th = _thresholds(tmp_path, "[metrics.request_goodput]\ntolerance = 0\n")
    path = write(make_record(), tmp_path / "run")
    code, out = kvbench("compare", path, path, "--thresholds", th, "--allow-loose")
    assert code == 2, out
    assert "none of the gated metrics and curves is in these records" in out


def test_only_host_memory_gated_from_another_machine_is_unusable(
    kvbench, tmp_path: Path
) -> None:
    th = _thresholds(tmp_path, "[metrics.peak_rss_bytes]\ntolerance = 0.15\n")
    new = changed(make_record(machine=OTHER), peak_rss_bytes=10 << 30)
    code, out = kvbench("compare", *_pair(tmp_path, new, make_record()), "--thresholds", th,
                        "--allow-loose")
    assert code == 2, out
    assert "only 0 of 1" in out and "peak_rss_bytes" in out


def test_summary_line_counts_compared_metrics(kvbench, tmp_path: Path) -> None:
    path = write(make_record(), tmp_path / "run")
    md = tmp_path / "c.md"
    code, out = kvbench("compare", path, path, "--markdown", md)
    assert code == 0, out
    result = compare_records([FoundRecord(path, make_record())],
                             [FoundRecord(path, make_record())], load_thresholds())
    compared, gated = result.gated
    assert 2 * compared >= gated > compared > 0
    line = f"Compared {compared} of {gated} gated metrics and curves."
    assert line in out and line in md.read_text()


# --- 2. thresholds that drop the defaults say so ------------------------------------------

def _thresholds(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "th.toml"
    path.write_text(text)
    return path


LOOSE_REQUEST_GATES = {
    "only preemptions": ("[metrics.preemptions]\ntolerance = 0.15\n", "metrics.completed dropped"),
    "exact_tolerance 1": (DEFAULTS_TEXT.replace("exact_tolerance = 1e-9", "exact_tolerance = 1.0"),
                          "gate.exact_tolerance 1e-09 -> 1"),
    "noise_k 10": (DEFAULTS_TEXT.replace("noise_k = 3.0", "noise_k = 10.0"),
                   "gate.noise_k 3 -> 10"),
    "completed tolerance": (
        DEFAULTS_TEXT.replace("[metrics.completed]\ntolerance = 0.0",
                              "[metrics.completed]\ntolerance = 0.5"),
        "metrics.completed.tolerance 0 -> 0.5"),
    "completed abs_tolerance": (
        DEFAULTS_TEXT.replace("[metrics.completed]\ntolerance = 0.0",
                              "[metrics.completed]\ntolerance = 0.0\nabs_tolerance = 1"),
        "metrics.completed.abs_tolerance 0 -> 1"),
}


@pytest.mark.parametrize("case", LOOSE_REQUEST_GATES)
def test_loosened_request_gates_are_refused_without_allow_loose(
    kvbench, tmp_path: Path, case: str
) -> None:
    text, words = LOOSE_REQUEST_GATES[case]
    assert text != DEFAULTS_TEXT
    th = _thresholds(tmp_path, text)
    new, base = _pair(tmp_path, changed(make_record(), completed=9), make_record())
    md = tmp_path / "c.md"
    code, out = kvbench("compare", new, base, "--thresholds", th, "--markdown", md)
    assert code == 2, out
    assert str(th) in out and words in out and "--allow-loose" in out
    assert "lost request" in md.read_text()


def test_allow_loose_accepts_and_lists_every_dropped_gate(kvbench, tmp_path: Path) -> None:
    th = _thresholds(tmp_path, LOOSE_REQUEST_GATES["only preemptions"][0])
    new, base = _pair(tmp_path, changed(make_record(), completed=9), make_record())
    md = tmp_path / "c.md"
    code, out = kvbench("compare", new, base, "--thresholds", th, "--allow-loose",
                        "--markdown", md)
    assert code == 0, out  # accepted on purpose: only preemptions are gated
    for text in (out, md.read_text()):
        assert "looser than kvbench's defaults" in text
        assert "metrics.completed dropped" in text and "curves.rss_bytes dropped" in text


def test_loosened_other_gates_are_listed_not_refused(kvbench, tmp_path: Path) -> None:
    text = DEFAULTS_TEXT.replace("[metrics.kv_waste_pct]\ntolerance = 0.15",
                                 "[metrics.kv_waste_pct]\ntolerance = 0.5")
    th = _thresholds(tmp_path, text.replace("curve_points = 100", "curve_points = 10"))
    path = write(make_record(), tmp_path / "run")
    code, out = kvbench("compare", path, path, "--thresholds", th)
    assert code == 0, out
    assert "metrics.kv_waste_pct.tolerance 0.15 -> 0.5" in out
    assert "gate.curve_points 100 -> 10" in out


def test_defaults_and_tighter_files_list_nothing(kvbench, tmp_path: Path) -> None:
    tighter = DEFAULTS_TEXT.replace("[metrics.duration_s]\ntolerance = 0.10",
                                    "[metrics.duration_s]\ntolerance = 0.05")
    th = parse_thresholds(tighter, "tighter.toml")
    assert relaxations(th, load_thresholds()) == []
    path = write(make_record(), tmp_path / "run")
    code, out = kvbench("compare", path, path, "--thresholds", REPO / "ci" / "thresholds.toml")
    assert code == 0, out
    assert "looser" not in out


# --- 3. implausible values are invalid, not improvements ----------------------------------

IMPLAUSIBLE = {
    "negative latency": ("median_ttft_ms", -1e9),
    "negative duration": ("duration_s", -3.0),
    "negative bytes": ("peak_kv_reserved_bytes", -1),
    "negative count": ("preemptions", -5),
    "negative throughput": ("output_throughput", -80.0),
    "percentage above 100": ("kv_waste_pct", 150.0),
    "negative percentage": ("kv_waste_pct", -1.0),
    "fragmentation index above 1": ("min_frag_index", 2.0),
    "more completed than run": ("completed", 11),
    "negative concurrency": ("max_concurrent_requests", -6),
}


@pytest.mark.parametrize("case", IMPLAUSIBLE)
@pytest.mark.parametrize("strict", [False, True])
def test_implausible_new_value_is_invalid(kvbench, tmp_path: Path, case: str,
                                          strict: bool) -> None:
    metric, value = IMPLAUSIBLE[case]
    base = make_record()
    new, base_path = _pair(tmp_path, changed(base, **{metric: value}), base)
    code, out = kvbench("compare", new, base_path, *(["--strict"] if strict else []))
    assert code == 1, out
    assert "INVALID" in out and metric in out and f"the new value is {value:g}" in out
    assert "IMPROVEMENT" not in out


@pytest.mark.parametrize("case", IMPLAUSIBLE)
def test_implausible_baseline_value_is_unusable(kvbench, tmp_path: Path, case: str) -> None:
    metric, value = IMPLAUSIBLE[case]
    base = make_record()
    new, base_path = _pair(tmp_path, base, changed(base, **{metric: value}))
    code, out = kvbench("compare", new, base_path)
    assert code == 2, out
    assert metric in out and f"the baseline's value is {value:g}" in out


def test_implausible_fraction_is_invalid(kvbench, tmp_path: Path) -> None:
    base = changed(make_record(), prefix_hit_rate=0.5)
    new, base_path = _pair(tmp_path, changed(base, prefix_hit_rate=1.5), base)
    code, out = kvbench("compare", new, base_path)
    assert code == 1, out
    assert "prefix_hit_rate" in out and "plausible range 0..1" in out


def test_implausible_repeat_is_invalid(kvbench, tmp_path: Path) -> None:
    rec = make_record(clock="wall")
    base = fold_repeats([changed(rec, median_ttft_ms=v) for v in (100.0, 101.0, 99.0)])
    new = fold_repeats([changed(rec, median_ttft_ms=v) for v in (100.0, -1e9, 99.0)])
    new_path, base_path = _pair(tmp_path, new, base)
    code, out = kvbench("compare", new_path, base_path)
    assert code == 1, out
    assert "median_ttft_ms" in out and "the new value is -1e+09" in out


@pytest.mark.parametrize(("curve", "values"), [
    ("kv_reserved_bytes", [1.0] * 9 + [-1e9]),
    ("t_s", [-1.0] + [float(i) for i in range(2, 11)]),
])
def test_implausible_curve_is_invalid(kvbench, tmp_path: Path, curve: str,
                                      values: list[float]) -> None:
    t = [float(i) for i in range(1, 11)]
    good = {"t_s": t, "kv_reserved_bytes": [1.0] * 10}
    new, base = _pair(tmp_path, make_record(curves={**good, curve: values}),
                      make_record(curves=good))
    code, out = kvbench("compare", new, base)
    assert code == 1, out
    assert "curve:kv_reserved_bytes" in out and "the new curve holds" in out


def test_plausible_ranges_follow_the_units() -> None:
    assert plausible_range(METRIC_BY_NAME["median_ttft_ms"]) == (0.0, float("inf"))
    assert plausible_range(METRIC_BY_NAME["kv_waste_pct"]) == (0.0, 100.0)
    assert plausible_range(METRIC_BY_NAME["mean_kv_utilization"]) == (0.0, 1.0)
    assert plausible_range(CURVE_BY_NAME["frag_index"]) == (0.0, 1.0)
    # Memory can shrink, but not below nothing; a per-wave slope can be negative.
    assert plausible_range(METRIC_BY_NAME["memory_growth_pct"])[0] == -100.0
    assert plausible_range(METRIC_BY_NAME["leak_rss_bytes_per_wave"])[0] == float("-inf")


def test_memory_shrinking_is_an_improvement_not_invalid(kvbench, tmp_path: Path) -> None:
    base = changed(make_record(), memory_growth_pct=10.0)
    new, base_path = _pair(tmp_path, changed(base, memory_growth_pct=-20.0), base)
    code, out = kvbench("compare", new, base_path)
    assert code == 0, out
    assert "IMPROVEMENT" in out and "INVALID" not in out


# --- 4. wall-clock records from another machine --------------------------------------------

def test_other_machine_says_speed_was_not_compared_and_fails_strict(
    kvbench, tmp_path: Path
) -> None:
    base = make_record(clock="wall")
    new = changed(make_record(clock="wall", machine=OTHER), median_ttft_ms=1e4)
    new_path, base_path = _pair(tmp_path, new, base)
    md, junit = tmp_path / "c.md", tmp_path / "j.xml"
    code, out = kvbench("compare", new_path, base_path, "--markdown", md, "--junit", junit)
    assert code == 0, out
    words = (f"the baseline ran on {machine_slug(MACHINE)}, this run on {machine_slug(OTHER)}")
    for text in (out, md.read_text()):
        assert "nothing of this run's speed was compared" in text and words in text
    case = [c for c in ET.parse(junit).iter("testcase") if c.get("name") == "speed"]
    assert case and case[0].find("skipped") is not None
    code, out = kvbench("compare", new_path, base_path, "--strict", "--junit", junit)
    assert code == 1, out
    assert "NOT COMPARED" in out
    case = [c for c in ET.parse(junit).iter("testcase") if c.get("name") == "speed"]
    assert case[0].find("failure") is not None


def test_lost_request_on_another_machine_fails(kvbench, tmp_path: Path) -> None:
    base = make_record(clock="wall")
    new = changed(make_record(clock="wall", machine=OTHER), completed=9)
    code, out = kvbench("compare", *_pair(tmp_path, new, base))
    assert code == 1, out
    assert "REGRESSION" in out and "`completed`" in out


def test_lost_request_in_one_repeat_fails(kvbench, tmp_path: Path) -> None:
    rec = make_record(clock="wall")
    base = fold_repeats([rec, rec, rec])
    new = fold_repeats([rec, changed(rec, completed=9), rec])  # median still 10
    code, out = kvbench("compare", *_pair(tmp_path, new, base))
    assert code == 1, out
    assert "`completed`" in out and "the worst of 3 repeats" in out


def test_baselines_only_from_other_machines(kvbench, tmp_path: Path) -> None:
    root, new = tmp_path / "baselines", tmp_path / "new"
    third = {**MACHINE, "cpu": "Third CPU"}
    write(make_record(clock="wall", machine=OTHER), root / "other" / "unit")
    write(make_record(clock="wall", machine=third), root / "third" / "unit")
    write(make_record("contiguous"), root / "any" / "unit")
    write(make_record(clock="wall"), new)
    write(make_record("contiguous"), new)
    code, out = kvbench("compare", new, root)
    assert code == 0, out
    assert "nothing of this run was compared" in out and machine_slug(OTHER) in out
    code, out = kvbench("compare", new, root, "--strict")
    assert code == 1, out
    # Alone, it leaves nothing compared at all: not a pass.
    code, out = kvbench("compare", new / "paged.json", root, "--allow-missing")
    assert code == 2, out
    assert "nothing was compared" in out


def test_virtual_clock_from_another_machine_is_compared(kvbench, tmp_path: Path) -> None:
    base = make_record()
    new = make_record(machine=OTHER)
    code, out = kvbench("compare", *_pair(tmp_path, new, base), "--strict")
    assert code == 0, out
    assert "speed was compared" not in out


@pytest.mark.parametrize("template", [
    REPO / "ci" / "github-actions.yml", REPO / "ci" / "gitlab-ci.yml",
    REPO / ".github" / "workflows" / "kvbench.yml",
])
def test_ci_templates_gate_strictly(template: Path) -> None:
    text = template.read_text(encoding="utf-8")
    commands = [line for line in text.splitlines()
                if line.strip().startswith("kvbench compare ")]
    assert commands and all("--strict" in line for line in commands)


def test_compare_takes_its_folders_by_name_in_any_order(capsys, tmp_path, monkeypatch) -> None:
    """--baseline and --new by name (the order of git diff and asv compare needs no
    remembering); the Markdown also goes to a GitHub job's summary."""
    from helpers import run_cli

    base, new = tmp_path / "base", tmp_path / "new"
    write(make_record(), base)
    write(changed(make_record(), peak_kv_reserved_bytes=12 << 20), new)
    summary = tmp_path / "step-summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    results = [run_cli(args, capsys) for args in (
        ["compare", str(new), str(base)],
        ["compare", "--baseline", str(base), str(new)],
        ["compare", "--baseline", str(base), "--new", str(new)],
        ["compare", "--new", str(new), str(base)],
    )]
    assert [code for code, _ in results] == [1] * 4, results
    assert all("regression" in text for _, text in results)
    assert summary.read_text().count("## kvbench compare") == 4
    for args in (["compare", str(new)], ["compare", "--new", str(new), str(base), str(base)],
                 ["compare", "--baseline", str(base), "--new", str(new), str(base)]):
        code, text = run_cli(args, capsys)
        assert code == 2 and "Traceback" not in text and "--new NEW --baseline" in text
