"""Parameter grids (`kvbench sweep --grid`): points in parallel on local processes or Ray,
records identical to a serial run, failed points as failed records."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from kvbench.errors import KvbenchError
from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.tools.grid import grid_points, parse_axis, point_suite, run_grid

FLAGS = RunFlags(num_requests=10, engines="paged")


def _normal(records) -> list[dict]:
    """Records without what depends on the machine or the moment."""
    out = []
    for rec in records:
        data = json.loads(rec.to_json())
        for key in ("created_utc", "run_id", "machine", "git_commit", "telemetry"):
            data.pop(key)
        for key in ("wall_time_s", "peak_rss_bytes", "rss_growth_pct",
                    "telemetry_overhead_pct"):
            data["summary"].pop(key, None)
        data["curves"].pop("rss_bytes", None)
        out.append(data)
    return out


def _axes():
    return [parse_axis("block_size=8,32"), parse_axis("engine=paged,contiguous")]


def test_axes_resolve_flag_names_and_suite_paths() -> None:
    assert parse_axis("replicas=2,4").path == "cluster.replicas"
    assert parse_axis("kv-memory=1GiB").path == "run.kv_memory"
    assert parse_axis("engines.mine.block_size=8").path == "engines.mine.block_size"
    for bad in ("block_size", "nosuch=1", "run.block_size=8,8", "workload=x"):
        with pytest.raises(KvbenchError):
            parse_axis(bad)
    points = grid_points([parse_axis("block_size=8,16"),
                          parse_axis("router=round-robin,least-kv")])
    assert [p.label for p in points] == [
        "block_size=8,router=round-robin", "block_size=8,router=least-kv",
        "block_size=16,router=round-robin", "block_size=16,router=least-kv"]
    suite, _ = resolve_suite("quick-sim", FLAGS)
    one = point_suite(suite, [parse_axis("engines.paged.block_size=64")],
                      grid_points([parse_axis("engines.paged.block_size=64")])[0])
    assert one.engine("paged").block_size == 64  # type: ignore[attr-defined]


def test_two_workers_give_the_records_of_a_serial_run(tmp_path) -> None:
    suite, base = resolve_suite("quick-sim", FLAGS)
    serial = run_grid(suite, base, _axes(), tmp_path / "serial", "t")
    parallel = run_grid(suite, base, _axes(), tmp_path / "parallel", "t", workers=2)
    assert serial.failed == parallel.failed == 0
    assert len(serial.records) == 4
    assert _normal(serial.records) == _normal(parallel.records)
    assert len(list((tmp_path / "parallel").glob("p*/*.json"))) == 4
    assert "block_size" in (tmp_path / "parallel" / "grid.md").read_text()


def test_a_failed_point_is_a_failed_record_and_the_grid_goes_on(tmp_path, capsys) -> None:
    code, text = run_cli(["sweep", "quick-sim", "--num-requests", "6", "--engines", "paged",
                          "--grid", "max_num_seqs=4,0", "--workers", "2",
                          "--out", str(tmp_path / "g")], capsys)
    assert code == 1, text
    records = sorted((tmp_path / "g").glob("p*/*.json"))
    assert len(records) == 2
    statuses = sorted(json.loads(p.read_text())["status"] for p in records)
    assert statuses == ["failed", "ok"]
    assert "max_num_seqs=0" in (tmp_path / "g" / "grid.md").read_text()


def test_a_request_rate_axis_reports_the_knee(tmp_path) -> None:
    suite, base = resolve_suite("quick-sim", RunFlags(num_requests=40, engines="paged",
                                                      kv_memory="2GiB"))
    result = run_grid(suite, base, [parse_axis("request_rate=1,8,64")], tmp_path / "k", "t")
    text = (tmp_path / "k" / "grid.md").read_text()
    assert "KV-pressure knee" in text and "method: knee" in text
    assert [p.point.label for p in result.points] == [f"request_rate={r}" for r in (1, 8, 64)]


def test_the_ray_backend_gives_the_records_of_a_serial_run(tmp_path) -> None:
    ray = pytest.importorskip("ray")
    suite, base = resolve_suite("quick-sim", FLAGS)
    serial = run_grid(suite, base, _axes(), tmp_path / "serial", "t")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        on_ray = run_grid(suite, base, _axes(), tmp_path / "ray", "t", backend="ray")
    finally:
        ray.shutdown()
    assert on_ray.failed == 0 and on_ray.backend == "ray"
    assert _normal(serial.records) == _normal(on_ray.records)


def test_grid_only_options_need_a_grid(tmp_path, capsys) -> None:
    code, text = run_cli(["sweep", "quick-sim", "--workers", "2", "--out",
                          str(tmp_path / "x")], capsys)
    assert code == 2 and "--grid" in text
