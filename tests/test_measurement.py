"""Numbers that survive a busy machine: machine state in wall-clock records, each engine in
its own process, interleaved repeats, CPU-time throughput, noise-aware findings, the run
folder's lock and manifest, and a failed write that loses nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ballast_engine import BALLAST_BYTES, HELD, BallastPaged
from record_factory import make_record

from helpers import REPO, run_cli
from kvbench.report.findings import run_findings
from kvbench.results.schema import MachineState, RunRecord
from kvbench.run.execute import execute_plan, round_order
from kvbench.run.machine_state import noisy_reason, noisy_summary
from kvbench.run.outdir import OutDirLock
from kvbench.run.overrides import RunFlags, resolve_suite
from kvbench.run.plan import plan_run

# Real compute on the CPU, small enough for a test: 3 short requests.
WALL = ["--num-requests", "3", "--kv-memory", "2MiB", "--max-model-len", "512",
        "--cpu-threads", "1"]
SIM = ["--device", "sim:a100-80gb", "--model", "llama-3-8b", "--num-requests", "4"]


def _records(out: Path) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}


# --- the noisy-machine rule -------------------------------------------------------------------

@pytest.mark.parametrize(("load", "steal", "noisy"), [
    (1.0, 0.0, False), (2.0, 5.0, False), (2.01, 0.0, True), (0.5, 5.1, True), (7.5, None, True),
])
def test_the_noisy_machine_rule_fires_on_either_side(load, steal, noisy) -> None:
    state = MachineState(load_before=(0.5, 0.5, 0.5), load_after=(load, 1.0, 1.0),
                         cpu_count=2, steal_pct=steal)
    reason = noisy_reason(state)
    assert (reason is not None) == noisy
    if noisy:
        assert reason.startswith("noisy-machine") and f"{load:.2f}" in reason
        state.noisy = reason
        [summary] = noisy_summary([make_record().model_copy(update={"machine_state": [state]})])
        assert "1 of 1 engine runs" in summary


def test_rounds_alternate_the_engine_order() -> None:
    engines = [("A", None), ("B", None), ("C", None)]
    orders = ["".join(n for n, _ in round_order(engines, k, True)) for k in range(7)]
    assert orders == ["ABC", "CBA", "BCA", "ACB", "CAB", "BAC", "ABC"]
    assert {"".join(n for n, _ in round_order(engines, k, False)) for k in range(4)} == {"ABC"}


# --- wall-clock records ---------------------------------------------------------------------

def test_a_wall_clock_run_records_the_machine_and_cpu_time(capsys, tmp_path) -> None:
    out = tmp_path / "out"
    code, text = run_cli(["run", *WALL, "--engines", "paged,contiguous", "--repeat", "2",
                          "--out", str(out)], capsys)
    assert code == 0, text
    records = _records(out)
    manifest = json.loads((out / "run.manifest").read_text())
    assert manifest["status"] == "ok"
    assert sorted(manifest["engines_finished"]) == ["contiguous", "paged"]
    for rec in records.values():
        assert rec["run_id"] == manifest["run_id"]
        assert len(rec["machine_state"]) == 2  # one per repeat
        for state in rec["machine_state"]:
            assert state["cpu_count"] == os.cpu_count()
            assert len(state["load_before"]) == 3 and len(state["load_after"]) == 3
            assert state["user_cpu_s"] + state["system_cpu_s"] > 0
        per_cpu = rec["summary"]["repeats"]["output_throughput_per_cpu_s"]
        assert len(per_cpu) == 2 and all(v > 0 for v in per_cpu)
        # A run's CPU time is at most its wall time (one thread) plus what the OS adds.
        cpu_s = rec["machine_state"][0]["user_cpu_s"] + rec["machine_state"][0]["system_cpu_s"]
        assert cpu_s < 2 * rec["summary"]["repeats"]["wall_time_s"][0] + 1
    summary = (out / "summary.md").read_text()
    assert "The machine while the engines ran" in summary and "1-min load" in summary
    page = (out / "index.html").read_text()
    assert "machine load" in page and "output tokens per CPU-second" in page


def test_virtual_clock_records_have_no_machine_state(capsys, tmp_path) -> None:
    code, text = run_cli(["run", *SIM, "--engines", "paged", "--out", str(tmp_path / "o")],
                         capsys)
    assert code == 0, text
    rec = _records(tmp_path / "o")["paged"]
    assert rec["machine_state"] == [] and rec["summary"]["output_throughput_per_cpu_s"] is None


# --- each engine in its own process ---------------------------------------------------------

def _ballast_plan(out: Path, in_process: bool):
    suite, base = resolve_suite(None, RunFlags(
        engines="paged,contiguous", num_requests=2, kv_memory="2MiB", max_model_len=512,
        in_process=in_process, cpu_threads=1))
    plan = plan_run(suite, base, out, "test", repeats=1)
    name, config = plan.engines[0]
    ballast = BallastPaged(**config.section.model_dump())
    plan.engines[0] = (name, dataclasses.replace(config, section=ballast))
    return plan


def test_a_second_engine_does_not_inherit_the_firsts_memory(tmp_path) -> None:
    """The first engine holds 256 MiB from its start to its process's end. Run in one
    process, the second engine's peak RSS includes it; each in its own, it does not."""
    try:
        together = {r.engine: r.summary["peak_rss_bytes"]
                    for r in execute_plan(_ballast_plan(tmp_path / "one", True), plots=False)}
    finally:
        HELD.clear()
    apart = {r.engine: r.summary["peak_rss_bytes"]
             for r in execute_plan(_ballast_plan(tmp_path / "two", False), plots=False)}
    assert not HELD  # the ballast lived in the engine's process, not this one
    assert apart["paged"] > apart["contiguous"] + BALLAST_BYTES * 0.8
    assert together["contiguous"] > apart["contiguous"] + BALLAST_BYTES * 0.8


def _start_run(out: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvbench.cli", "run", "--engines", "paged,contiguous",
         "--num-requests", "400", "--cpu-threads", "1", "--out", str(out), *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_sigterm_reaches_the_engine_process_and_keeps_the_records(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _start_run(out)
    try:
        _wait_for(out / "run.manifest", proc)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, text
    assert "Traceback" not in text
    records = _records(out)
    assert set(records) == {"paged", "contiguous"}
    assert records["paged"]["status"] == "interrupted" and "SIGTERM" in records["paged"]["error"]
    assert "not started" in records["contiguous"]["error"]
    assert json.loads((out / "run.manifest").read_text())["status"] == "interrupted"


def _engine_process(run: subprocess.Popen, not_this: int | None = None):
    """The engine process the run has started (a child of its fork server), once it has."""
    import psutil

    parent = psutil.Process(run.pid)
    deadline = time.monotonic() + 120
    while True:
        found = [p for p in parent.children(recursive=True)
                 if p.ppid() != run.pid and p.pid != not_this and p.is_running()]
        if found:
            return found[0]
        assert time.monotonic() < deadline and run.poll() is None
        time.sleep(0.05)


def test_a_killed_engine_process_fails_its_engine_only(tmp_path) -> None:
    """The first engine's process is killed: its record says so, and the next engine starts
    (it is interrupted here, to end the test)."""
    out = tmp_path / "out"
    proc = _start_run(out)
    try:
        first = _engine_process(proc)
        first.kill()
        _engine_process(proc, not_this=first.pid)
        proc.send_signal(signal.SIGTERM)
        text = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 143, text
    records = _records(out)
    assert records["paged"]["status"] == "failed"
    assert "killed by signal SIGKILL" in records["paged"]["error"]
    assert records["contiguous"]["status"] == "interrupted"
    assert "not started" not in records["contiguous"]["error"]


# --- the output folder ----------------------------------------------------------------------

def test_a_second_writer_is_refused(capsys, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom pathlib import Path\n"
         "from kvbench.run.outdir import OutDirLock\nlock = OutDirLock(Path(sys.argv[1]))\n"
         "print('locked', flush=True)\ntime.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, text = run_cli(["run", *SIM, "--engines", "paged", "--out", str(out)], capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2 and "Traceback" not in text
    assert "another kvbench run" in text and f"process {holder.pid}" in text
    assert not list(out.glob("*.json"))
    # The lock dies with its process: the folder is free again.
    OutDirLock(out).release()


def test_readers_refuse_a_folder_mixing_two_runs_and_flag_an_unfinished_one(
        capsys, tmp_path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    for out in (one, two):
        code, text = run_cli(["run", *SIM, "--engines", "paged,contiguous", "--out", str(out)],
                             capsys)
        assert code == 0, text
    (one / "contiguous.json").write_bytes((two / "contiguous.json").read_bytes())
    code, text = run_cli(["report", str(one), "-o", str(tmp_path / "r1")], capsys)
    assert code == 2 and "mixes runs" in text and "contiguous.json" in text
    for command in (["compare", str(one), str(two)], ["publish", str(one), "-o",
                                                       str(tmp_path / "p1")]):
        code, text = run_cli(command, capsys)
        assert code == 2 and "mixes runs" in text and "Traceback" not in text, command
    # A run killed after its first engine: the manifest still says running.
    manifest = json.loads((two / "run.manifest").read_text())
    manifest.update(status="running", engines_finished=["paged"])
    (two / "run.manifest").write_text(json.dumps(manifest))
    (two / "contiguous.json").unlink()
    (two / ".contiguous.json.x1.tmp").write_text("{")
    code, text = run_cli(["report", str(two), "-o", str(tmp_path / "r2")], capsys)
    assert code == 0, text
    assert "never finished" in text and "no records of contiguous" in text
    assert "half-written" in text
    assert "never finished" in (tmp_path / "r2" / "report.md").read_text()
    # A new run in the folder clears what the killed writer left.
    code, text = run_cli(["run", *SIM, "--engines", "paged", "--out", str(two), "--force"],
                         capsys)
    assert code == 0 and not list(two.glob(".*.tmp"))


def test_a_full_disk_keeps_the_records_written(capsys, tmp_path, monkeypatch) -> None:
    """ENOSPC while the third engine's record is written: exit 2 saying so, no traceback,
    the first two records whole."""
    real, writes = RunRecord.write, []

    def write(self, path):
        writes.append(path)
        if len(writes) == 3:
            raise OSError(28, "No space left on device")
        return real(self, path)

    monkeypatch.setattr(RunRecord, "write", write)
    out = tmp_path / "out"
    code, text = run_cli(["run", *SIM, "--engines", "paged,contiguous,contiguous-request",
                          "--out", str(out)], capsys)
    assert code == 2 and "Traceback" not in text
    assert "No space left on device" in text and "paged.json" in text
    records = _records(out)
    assert {n: r["status"] for n, r in records.items()} == {"paged": "ok", "contiguous": "ok"}


# --- publishing and findings ----------------------------------------------------------------

def _noisy(record: RunRecord) -> RunRecord:
    state = MachineState(load_before=(6.0, 3.0, 1.0), load_after=(6.5, 3.1, 1.0), cpu_count=2)
    state.noisy = noisy_reason(state)
    return record.model_copy(update={"machine_state": [state], "warnings": [state.noisy]})


def test_publish_refuses_noisy_records_unless_allowed(capsys, tmp_path) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    _noisy(make_record("paged", clock="wall")).write(runs / "paged.json")
    make_record("contiguous", clock="wall").write(runs / "contiguous.json")
    code, text = run_cli(["publish", str(runs), "-o", str(tmp_path / "p")], capsys)
    assert code == 2 and "noisy machine" in text and "--allow-noisy" in text
    assert not (tmp_path / "p").exists() or not list((tmp_path / "p").iterdir())
    code, text = run_cli(["publish", str(runs), "-o", str(tmp_path / "p"), "--allow-noisy"],
                         capsys)
    assert code == 0, text
    for name in ("tables.md", "index.html"):
        page = (tmp_path / "p" / name).read_text()
        assert "noisy-machine" in page and "6.00" in page and "2026-11-01" in page


def _repeats(engine: str, throughput: list[float], ttft: list[float]) -> RunRecord:
    rec = make_record(engine, clock="wall")
    summary = {**rec.summary, "output_throughput": sorted(throughput)[1],
               "median_ttft_ms": sorted(ttft)[1],
               "repeats": {"output_throughput": throughput, "median_ttft_ms": ttft}}
    return rec.model_copy(update={"summary": summary})


def _queued(record: RunRecord) -> RunRecord:
    from kvbench.results.schema import RequestRow

    row = RequestRow(id="r0", arrival_s=0.0, prompt_tokens=10, output_tokens=10,
                     status="ok")
    return record.model_copy(update={"requests": [row]})


def test_speed_findings_are_stated_only_beyond_the_noise() -> None:
    apart = [_queued(_repeats("paged", [900, 950, 1000], [100, 110, 120])),
             _queued(_repeats("contiguous", [500, 520, 540], [300, 310, 320]))]
    overlap = [_queued(_repeats("paged", [500, 560, 620], [100, 110, 120])),
               _queued(_repeats("contiguous", [480, 520, 600], [300, 310, 320]))]
    single = [_queued(make_record("paged", clock="wall")),
              _queued(make_record("contiguous", clock="wall"))]
    said = " ".join(run_findings(apart))
    assert "more output tokens/s" in said and "noise" not in said
    said = " ".join(run_findings(overlap))
    assert "within this machine's noise" in said and "more output tokens/s" not in said
    assert "480.0-600.0" in said
    said = " ".join(run_findings(single))
    assert "from one repeat" in said or "within" in said


@pytest.mark.parametrize("command", [
    ["run", *SIM, "--engines", "paged", "--out"], ["report", "-o", "r", "--"],
])
def test_a_path_the_file_system_refuses_is_said_plainly(capsys, tmp_path, command) -> None:
    long = str(tmp_path / ("x" * 300))
    code, text = run_cli([*command, long], capsys)
    assert code == 2 and "Traceback" not in text and "File name too long" in text
