"""Synthetic run records for the regression-gate tests (no engine runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench.results.schema import RunRecord, WorkloadInfo

MACHINE = {
    "hostname": "test", "platform": "Linux", "python": "3.11.7", "cpu": "Test CPU",
    "cpu_count": 4, "versions": {"kvbench": "0.1.0", "torch": "2.13.0+cpu"}, "gpu": None,
}

SUMMARY = {
    "num_requests": 10, "completed": 10, "rejected": 0, "duration_s": 12.5,
    "wall_time_s": 3.0, "request_throughput": 0.8, "output_throughput": 80.0,
    "median_ttft_ms": 100.0, "p99_ttft_ms": 180.0, "median_tpot_ms": 20.0,
    "max_concurrent_requests": 6, "mean_concurrent_requests": 4.5,
    "kv_capacity_bytes": 8 << 20, "peak_kv_reserved_bytes": 6 << 20,
    "peak_kv_used_bytes": 5 << 20, "mean_kv_utilization": 0.8, "kv_waste_pct": 20.0,
    "min_frag_index": 0.9, "preemptions": 0, "prefix_hit_rate": None,
    "peak_rss_bytes": 500 << 20,
}


def make_record(
    engine: str = "paged", *, suite: str = "unit", clock: str = "virtual",
    digest: str = "d1g3st", summary: dict[str, Any] | None = None,
    machine: dict[str, Any] | None = None, curves: dict[str, list[float]] | None = None,
    status: str = "ok",
) -> RunRecord:
    t = [float(i) for i in range(1, 11)]
    return RunRecord(
        kvbench_version="0.1.0", git_commit="abc", created_utc="2026-11-01T00:00:00+00:00",
        machine=machine or MACHINE, command=f"kvbench run {suite}", suite=suite,
        workload=WorkloadInfo(name="unit-wl", digest=digest, source="tests", seed=0,
                              num_requests=10, prompt_tokens=1000, output_tokens=1000),
        engine=engine, engine_config={"kind": engine}, model={"name": "tiny", "dtype": "float32"},
        device="sim:a100-80gb" if clock == "virtual" else "cpu", clock=clock, status=status,
        summary=dict(SUMMARY if summary is None else summary),
        curves=curves if curves is not None else {
            "t_s": t, "kv_reserved_bytes": [float(min(i, 6) << 20) for i in range(1, 11)],
        },
        requests=[],
    )


def write(record: RunRecord, folder: Path, name: str | None = None) -> Path:
    return record.write(folder / f"{name or record.engine}.json")


def changed(record: RunRecord, **summary: Any) -> RunRecord:
    return record.model_copy(update={"summary": {**record.summary, **summary}})
