"""The metric table against what runs really record: every metric and curve a record holds is
declared, and every declared one is produced by some run (or says what it needs)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from record_factory import make_record
from typer.testing import CliRunner

from kvbench.cli.app import app
from kvbench.report.tables import table_rows
from kvbench.report.thresholds import load_thresholds
from kvbench.results.leaks import KV_KIND, PROBE_KINDS
from kvbench.results.metric_table import (
    CURVE_BY_NAME,
    CURVES,
    METRIC_BY_NAME,
    METRICS,
    report_metrics,
    spec_for_row,
)
from kvbench.results.schema import REPEATS_KEY, RunRecord, load_record
from kvbench.run.telemetry import CudaProbe, NvmlProbe

ARGS = ["quick-sim", "--num-requests", "12"]


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, list[RunRecord]]:
    """Records of both built-in engine kinds: a plain run, one with an SLO, and a soak."""
    out: dict[str, list[RunRecord]] = {}
    for what, extra in (("run", ["--slo", "ttft:500,tpot:50"]), ("soak", ["--waves", "2"])):
        folder = tmp_path_factory.mktemp(what)
        result = CliRunner().invoke(app, [what, *ARGS, *extra, "--out", str(folder)])
        assert result.exit_code == 0, result.output
        out[what] = [load_record(p) for p in sorted(folder.glob("*.json"))]
        assert {r.engine for r in out[what]} == {"paged", "contiguous"}
    return out


def _produced(records: list[RunRecord]) -> set[str]:
    return {k for r in records for k, v in r.summary.items() if v is not None}


def test_every_recorded_metric_is_in_the_table(records) -> None:
    for rec in records["run"] + records["soak"]:
        unknown = set(rec.summary) - set(METRIC_BY_NAME) - {REPEATS_KEY}
        assert not unknown, f"{rec.engine}: add {sorted(unknown)} to the metric table"
        assert not set(rec.curves) - set(CURVE_BY_NAME), rec.engine


def test_every_table_entry_is_produced_or_says_what_it_needs(records) -> None:
    run, soak = _produced(records["run"]), _produced(records["soak"])
    keys = {k for r in records["run"] for k in r.summary}
    leak_kinds = {
        f"leak_{k.removesuffix('_bytes')}_bytes_per_wave" for k in (KV_KIND, *PROBE_KINDS)
    }
    for spec in METRICS:
        if not spec.needs or spec.needs == ("slo",):
            assert spec.name in run, spec.name
        elif spec.needs == ("soak",):
            assert spec.name in soak and spec.name not in keys, spec.name
        elif spec.needs == ("cuda",):
            # Off CUDA the run records the metric as None.
            assert spec.name in keys and spec.name not in run, spec.name
        elif spec.needs == ("device",):
            # A simulated device's memory is modelled: the (simulated) run produces it.
            assert spec.name in run, spec.name
        elif spec.needs == ("oom",):
            # Only a run that ran out of device memory has these.
            assert spec.name not in keys, spec.name
        elif spec.needs in (("modal",), ("groups",)):
            # Only a modality-aware pool has page classes (tests/test_kv_modal.py runs one),
            # only a pool allocating per layer group has groups (tests/test_hybrid_kv.py).
            assert spec.name not in keys, spec.name
        elif spec.needs == ("wall",):
            # Recorded by every run, None on the virtual clock (tests/test_measurement.py
            # checks a wall-clock run's).
            assert spec.name in keys and spec.name not in run, spec.name
        elif spec.needs == ("quality",):
            # Output agreement: recorded by every run, None unless a real-compute engine
            # stores KV below full precision (tests/test_quality_check.py runs one).
            assert spec.name in keys and spec.name not in run, spec.name
        elif spec.needs in (("policy",), ("fragmentation",)):
            # Counters some KV policies keep, facts of a fragmentation wait: recorded by every
            # run, None where there are none.
            assert spec.name in keys, spec.name
        elif spec.needs == ("offload",):
            # Recorded by every run, None unless a server publishes its offload tiers
            # (tests/test_openai_metrics.py reads them).
            assert spec.name in keys and spec.name not in run, spec.name
        elif spec.needs in (("cluster",), ("disaggregated",)):
            # A cluster run's (tests/test_cluster.py checks they are produced there).
            assert spec.name not in keys, spec.name
        else:
            assert spec.needs == ("soak", "cuda") and spec.name in leak_kinds, spec.name


def test_every_curve_is_produced_or_comes_from_a_cuda_probe(records) -> None:
    produced = {k for r in records["run"] for k, v in r.curves.items() if v}
    nvml = NvmlProbe(SimpleNamespace(nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=1)),
                     None, per_process=True, pids=set)
    cuda = set(CudaProbe.columns) | set(nvml.columns)
    for spec in CURVES:
        if spec.needs in (("disaggregated",), ("modal",), ("offload",), ("groups",)):
            # Produced by their own runs: tests/test_cluster.py, tests/test_kv_modal.py,
            # tests/test_offload_tiers.py, tests/test_hybrid_kv.py.
            assert spec.name not in produced, spec.name
            continue
        assert (spec.name in produced) != ("cuda" in spec.needs), spec.name
        assert ("cuda" in spec.needs) == (spec.name in cuda), spec.name


def test_default_thresholds_gate_declared_metrics_with_a_direction() -> None:
    th = load_thresholds()
    assert th.metrics and th.curves
    for name in th.metrics:
        assert METRIC_BY_NAME[name].gateable
    for name in th.curves:
        assert CURVE_BY_NAME[name].gateable


def test_names_are_unique_and_units_agree_with_names() -> None:
    assert len(METRIC_BY_NAME) == len(METRICS) and len(CURVE_BY_NAME) == len(CURVES)
    for spec in (*METRICS, *CURVES):
        if spec.name.endswith("_bytes"):
            assert spec.unit == "bytes" and spec.fmt == "bytes", spec.name
        if spec.name.endswith("_ms"):
            assert spec.unit == "ms", spec.name
        if spec.name.endswith("_pct"):
            assert spec.unit == "%", spec.name


def test_run_table_rows_keep_their_labels_and_order() -> None:
    # Every metric given a value: rows empty for every engine are left out of run tables.
    full = {**make_record().summary, **{spec.name: 1.0 for spec in report_metrics()}}
    labels = [row[0] for row in table_rows([make_record(summary=full)])]
    assert labels == [
        "status", "completed requests", "rejected requests", "duration (s)", "requests/s",
        "output tokens/s", "total tokens/s", "output tokens per CPU-second", "TTFT p50 (ms)",
        "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "E2EL p50 (ms)",
        "max concurrent requests", "mean concurrent requests",
        "KV capacity", "peak KV reserved", "peak KV used", "KV utilization (used/reserved)",
        "KV waste %", "min fragmentation index", "time a request waited for KV (s)",
        "of which with enough KV free (s)", "peak text KV", "peak image KV", "peak audio KV",
        "output match rate vs full precision", "probe max abs logit diff", "preemptions",
        "prefix cache hit rate", "peak process RSS", "peak device memory",
    ]


@pytest.mark.parametrize(("name", "value", "text"), [
    ("peak_kv_reserved_bytes", 6 << 20, "6.0 MiB"),
    ("mean_kv_utilization", 0.8, "80.0%"),
    ("median_tpot_ms", 20.0, "20.00"),
    ("completed", 10.0, "10"),  # a count read back from JSON as a float
    ("max_concurrent_requests", 6.5, "6.5"),  # a median of repeats keeps its fraction
    ("leak_detected", True, "yes"),
    ("kv_waste_pct", None, "-"),
    ("kv_waste_pct", math.nan, "nan"),
    ("peak_rss_bytes", math.inf, "inf"),
])
def test_format(name: str, value: object, text: str) -> None:
    assert METRIC_BY_NAME[name].format(value) == text


def test_gate_rows_find_their_spec() -> None:
    assert spec_for_row("curve:rss_bytes") is CURVE_BY_NAME["rss_bytes"]
    assert spec_for_row("median_ttft_ms") is METRIC_BY_NAME["median_ttft_ms"]
    assert spec_for_row("input") is None


def test_record_factory_metrics_are_declared() -> None:
    assert set(make_record().summary) <= set(METRIC_BY_NAME)


def test_report_shows_metrics_from_the_table(records, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    for rec in records["run"]:
        rec.write(folder / f"{rec.engine}.json")
    result = CliRunner().invoke(app, ["report", str(folder), "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    md = (tmp_path / "out" / "report.md").read_text()
    for spec in METRICS:
        # A row no engine has a value for is left out.
        shown = spec.report and any(r.summary.get(spec.name) is not None for r in records["run"])
        assert (f"| {spec.label} |" in md) == shown, spec.name
