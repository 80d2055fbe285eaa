"""CPU threads with vLLM in the same process: what vLLM does to them, and that a run holds
every engine, vLLM included, at one measured count."""

from __future__ import annotations

import pytest
import torch
from vllm_helpers import tiny_opts

from kvbench.engines.config import engine_config
from kvbench.engines.external.vllm import OMP_BIND_ENV, VllmSection
from kvbench.engines.registry import build_engine
from kvbench.errors import KvbenchError
from kvbench.run.execute import execute_plan
from kvbench.run.plan import plan_run
from kvbench.run.suite import RunSection, Suite, WorkloadSection
from kvbench.run.threads import set_cpu_threads, torch_threads

VLLM = VllmSection()


def test_a_binding_that_only_workers_apply_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(OMP_BIND_ENV, "0-1")
    config = engine_config("vllm", VLLM, tiny_opts(64))
    with pytest.raises(KvbenchError, match="--cpu-threads N"):
        config.section.check(config)


def test_vllm_keeps_the_process_threads_and_freezes_them() -> None:
    """Started in-process, vLLM binds nothing and computes at the process's count, but turns
    torch.set_num_threads into a no-op: a later count cannot be set, and kvbench says so."""
    before = torch_threads()
    engine = build_engine(engine_config("vllm", VLLM, tiny_opts(64)))
    try:
        assert torch_threads() == before
        assert engine.describe()["omp_threads_bind"] == "nobind"
        torch.set_num_threads(before + 1)
        assert torch_threads() == before
        with pytest.raises(KvbenchError, match=r"fixed at .* vLLM"):
            set_cpu_threads(before + 1)
        set_cpu_threads(before)  # the count in force is no error
    finally:
        engine.close()


def test_interleaved_repeats_run_every_engine_at_the_runs_threads(tmp_path) -> None:
    """paged, vllm, paged, vllm: each record says the count its engine ran at, the same for
    all (the count vLLM's earlier start froze, since no other can be set after it)."""
    count = torch_threads()
    suite = Suite(
        name="t",
        workload=WorkloadSection(preset="mixed-text", num_requests=4, seed=0),
        run=RunSection(device="cpu", engines=["paged", "vllm"], kv_memory="4MiB",
                       max_model_len=1024, cpu_threads=count, request_rate=float("inf")),
    )
    records = execute_plan(plan_run(suite, None, tmp_path / "out", "test", repeats=2))
    assert [r.status for r in records] == ["ok", "ok"]
    for record in records:
        assert record.engine_config["cpu_threads"] == {
            "requested": count, "at_start": count, "at_end": count,
        }
