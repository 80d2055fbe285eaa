"""Simulated records are identical run to run apart from host metrics and timestamps, and
the gate treats device memory as exact on a simulated device and host memory as timing."""

from __future__ import annotations

from pathlib import Path

from record_factory import make_record

from kvbench.report.compare import compare_pair, resolve_kind
from kvbench.report.thresholds import load_thresholds
from kvbench.results.metric_table import CURVE_BY_NAME, METRIC_BY_NAME
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection

# What depends on the machine running the simulator, not on the simulated run.
HOST_SUMMARY = {"wall_time_s", "peak_rss_bytes", "rss_growth_pct", "telemetry_overhead_pct"}
HOST_CURVES = {"rss_bytes"}


def _records(out: Path) -> dict:
    suite = Suite(
        name="host", workload=WorkloadSection(preset="mixed-text", num_requests=30),
        model=ModelSection(preset="llama-2-7b"),
        run=RunSection(device="sim:a100-80gb", kv_memory="4GiB", engines=["paged", "contiguous"],
                       kv_allocation="on-demand", attention_impl="sdpa-dense-mask"),
    )
    return {r.engine: r.model_dump() for r in execute_plan(plan_run(suite, None, out, "test"))}


def test_sim_records_are_identical_apart_from_host_metrics(tmp_path: Path) -> None:
    a, b = _records(tmp_path / "a"), _records(tmp_path / "b")
    for engine in a:
        ra, rb = a[engine], b[engine]
        for r in (ra, rb):
            r.pop("created_utc")
            r.pop("run_id")
            for key in HOST_SUMMARY:
                r["summary"].pop(key)
            for key in HOST_CURVES:
                r["curves"].pop(key)
        assert ra["summary"]["peak_device_bytes"] > 0
        assert ra["summary"]["memory_growth_pct"] is not None
        assert ra == rb


def test_device_memory_is_exact_on_a_simulated_device_only() -> None:
    sim, cpu = make_record(clock="virtual"), make_record(clock="wall")
    for name in ("peak_device_bytes", "memory_growth_pct"):
        assert resolve_kind(METRIC_BY_NAME[name].kind, sim) == "deterministic"
        assert resolve_kind(METRIC_BY_NAME[name].kind, cpu) == "timing"
    assert resolve_kind(METRIC_BY_NAME["peak_rss_bytes"].kind, sim) == "timing"
    assert resolve_kind(CURVE_BY_NAME["device_used_bytes"].kind, sim) == "deterministic"
    assert "device_used_bytes" in load_thresholds().curves


def test_sim_device_growth_is_gated_exactly_and_host_rss_is_not() -> None:
    th = load_thresholds()
    base = make_record(clock="virtual")
    base = base.model_copy(update={"summary": {**base.summary, "memory_growth_pct": 0.0,
                                               "peak_device_bytes": 70 << 30}})
    other_machine = {**base.machine, "cpu": "Other CPU"}
    new = base.model_copy(update={
        "machine": other_machine,
        "summary": {**base.summary, "memory_growth_pct": 2.0, "peak_rss_bytes": 900 << 20},
    })
    rows = {r.metric: r for r in compare_pair(new, base, th)[0]}
    assert rows["memory_growth_pct"].verdict == "regression"
    assert rows["memory_growth_pct"].kind == "deterministic"
    assert rows["peak_device_bytes"].verdict == "pass"
    assert rows["peak_rss_bytes"].verdict == "skipped"  # host metric from another machine
