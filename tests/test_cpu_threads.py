"""One torch CPU thread count for every engine of a CPU run, measured into each record."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvbench.errors import KvbenchError
from kvbench.run import execute
from kvbench.run.plan import plan_run
from kvbench.run.suite import RunSection, Suite, WorkloadSection
from kvbench.run.threads import set_cpu_threads, torch_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _plan(out: Path, cpu_threads: int | None, repeats: int = 1, in_process: bool = True):
    suite = Suite(
        name="threads",
        workload=WorkloadSection(preset="mixed-text", num_requests=2, seed=0),
        run=RunSection(device="cpu", engines=["paged", "contiguous"], kv_memory="2MiB",
                       max_model_len=1024, cpu_threads=cpu_threads, request_rate=float("inf"),
                       in_process=in_process),
    )
    return plan_run(suite, None, out, "test", repeats=repeats)


@pytest.mark.parametrize("in_process", [True, False])
def test_every_record_says_the_threads_its_engine_ran_at(tmp_path: Path, in_process) -> None:
    torch.set_num_threads(2)
    records = execute.execute_plan(_plan(tmp_path / "one", 1, repeats=2, in_process=in_process))
    # In this process only when the engines ran in it.
    assert torch_threads() == (1 if in_process else 2)
    for record in records:
        assert record.status == "ok"
        assert record.engine_config["cpu_threads"] == {"requested": 1, "at_start": 1, "at_end": 1}
    # Without a count every engine runs at torch's, as found when the run was planned.
    torch.set_num_threads(1)
    (record, _) = execute.execute_plan(_plan(tmp_path / "default", None, in_process=in_process))
    assert record.engine_config["cpu_threads"] == {"requested": None, "at_start": 1, "at_end": 1}


def test_an_engine_whose_threads_change_fails_and_the_next_starts_at_the_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = execute.run_engine
    calls = []

    def changing(engine, *args, **kw):
        calls.append(torch_threads())
        run = real(engine, *args, **kw)
        if engine.name == "paged":
            torch.set_num_threads(2)
        return run

    monkeypatch.setattr(execute, "run_engine", changing)
    paged, contiguous = execute.execute_plan(_plan(tmp_path / "out", 1, in_process=True))
    assert paged.status == "failed" and "not comparable" in (paged.error or "")
    assert paged.engine_config["cpu_threads"]["at_end"] == 2
    assert contiguous.status == "ok" and calls == [1, 1]


def test_a_count_the_process_cannot_take_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after vLLM started in the process: torch.set_num_threads does nothing."""
    count = torch_threads()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    set_cpu_threads(count)
    with pytest.raises(KvbenchError, match=f"fixed at {count} in this process"):
        set_cpu_threads(count + 1)
