"""Baselines, machine names, and the run options CI fans out with (--repeat, --shard)."""

from __future__ import annotations

from pathlib import Path

import pytest
from record_factory import MACHINE, make_record, write
from typer.testing import CliRunner

from helpers import REPO
from kvbench.cli.app import app
from kvbench.errors import KvbenchError
from kvbench.report.baselines import ANY_MACHINE, machine_slug, save_baselines
from kvbench.results.recordset import load_records
from kvbench.results.repeats import REPEATS_KEY
from kvbench.results.schema import load_record
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.sharding import Shard
from kvbench.run.suite import load_suite


def test_machine_slug_cpu_and_gpu() -> None:
    cpu = {**MACHINE, "cpu": "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz", "cpu_count": 8}
    assert machine_slug(cpu) == "intel-xeon-gold-6338-x8-torch2.13"
    gpu = {**MACHINE, "gpu": {"name": "NVIDIA H200", "count": 1, "cuda": "13.0"},
           "versions": {"torch": "2.11.0"}}
    assert machine_slug(gpu) == "nvidia-h200-x1-cuda13.0-torch2.11"


def test_machine_command_prints_this_machines_slug() -> None:
    result = CliRunner().invoke(app, ["machine"], catch_exceptions=False)
    assert result.exit_code == 0
    slug = result.output.strip()
    assert slug and "/" not in slug and " " not in slug


def test_save_puts_virtual_under_any_and_wall_per_machine(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write(make_record("paged", clock="virtual", suite="s"), run, "paged")
    write(make_record("contiguous", clock="wall", suite="s"), run, "contiguous")
    root = tmp_path / "baselines"
    paths = save_baselines(load_records([run]), root)
    assert sorted(p.relative_to(root).as_posix() for p in paths) == [
        f"{ANY_MACHINE}/s/paged.json", f"{machine_slug(MACHINE)}/s/contiguous.json",
    ]
    stored = load_record(root / ANY_MACHINE / "s" / "paged.json")
    assert stored.requests == [] and stored.summary == make_record().summary
    named = save_baselines(load_records([run]), root, machine="Lab H200")
    assert root / "lab-h200" / "s" / "contiguous.json" in named


def test_save_refuses_incomplete_runs(tmp_path: Path) -> None:
    write(make_record(status="interrupted"), tmp_path)
    with pytest.raises(KvbenchError, match="only a complete run"):
        save_baselines(load_records([tmp_path]), tmp_path / "b")


def test_compare_picks_this_machines_baseline_from_the_root(tmp_path: Path) -> None:
    root = tmp_path / "baselines"
    other = {**MACHINE, "cpu": "Other CPU"}
    write(make_record(clock="wall", machine=other), root / "other-cpu" / "unit")
    write(make_record(clock="wall"), root / machine_slug(MACHINE) / "unit")
    new = write(make_record(clock="wall"), tmp_path / "new")
    result = CliRunner().invoke(
        app, ["compare", str(new), str(root), "--thresholds", str(REPO / "ci/thresholds.toml")],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    assert machine_slug(MACHINE) in result.output


def test_shard_parse_and_select() -> None:
    assert Shard.parse("2/3").select(["a", "b", "c", "d", "e"]) == ["b", "e"]
    assert Shard.parse("3/3").select(["a", "b"]) == []
    for bad in ("0/2", "3/2", "x"):
        with pytest.raises(KvbenchError):
            Shard.parse(bad)


def test_run_repeat_and_shard_write_folded_records(tmp_path: Path) -> None:
    suite, base = load_suite("quick-sim")
    suite.workload.num_requests = 12
    plan = plan_run(suite, base, tmp_path, "kvbench run quick-sim", repeats=3,
                    shard=Shard(2, 2))
    assert [name for name, _ in plan.engines] == ["contiguous"]
    (record,) = execute_plan(plan)
    stored = load_record(tmp_path / "contiguous.json")
    assert not (tmp_path / "paged.json").exists()
    repeats = stored.summary[REPEATS_KEY]
    assert len(repeats["wall_time_s"]) == 3
    # The virtual clock makes the KV numbers identical in every repeat.
    assert len(set(repeats["peak_kv_reserved_bytes"])) == 1
    assert stored.summary == record.summary
