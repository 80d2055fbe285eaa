"""Decode fast-forward inside a cluster: replicas taking their runs of decode-only steps in
one go write the same records, bit for bit, as the cluster stepping every replica one step
at a time (host metrics aside), for every router, disaggregated prefill/decode, and a slice
of the Mooncake trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvbench.engines.cluster.engine import ROUTERS, ClusterSection
from kvbench.run.execute import record_of, start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_synthetic_trace_head300.jsonl"
HOST_SUMMARY = {"wall_time_s", "peak_rss_bytes", "rss_growth_pct", "telemetry_overhead_pct"}


def _record(tmp: Path, fast_forward: bool, workload: WorkloadSection, model: str,
            engine: str, cluster: ClusterSection, **run: Any) -> dict:
    suite = Suite(
        name="ffc", workload=workload, model=ModelSection(preset=model), cluster=cluster,
        run=RunSection(device="sim:a100-80gb", engines=[engine], fast_forward=fast_forward,
                       **run),
    )
    plan = plan_run(suite, None, tmp / ("ff" if fast_forward else "steps"), "test")
    [(_, config)] = plan.engines
    r, described = start_and_run(plan, config, None)
    return record_of(plan, r, described).model_dump()


def _strip(record: dict) -> dict:
    record = dict(record)
    record.pop("created_utc")
    record.pop("run_id")
    record["summary"] = {k: v for k, v in record["summary"].items() if k not in HOST_SUMMARY}
    record["curves"] = {k: v for k, v in record["curves"].items()
                        if not k.endswith("rss_bytes")}
    record["engine_config"] = {k: v for k, v in record["engine_config"].items()
                               if k != "fast_forward"}
    return record


def _check(tmp: Path, workload: WorkloadSection, cluster: ClusterSection,
           model: str = "llama-2-7b", engine: str = "paged", **run: Any) -> dict:
    fast = _record(tmp, True, workload, model, engine, cluster, **run)
    slow = _record(tmp, False, workload, model, engine, cluster, **run)
    assert slow["engine_config"]["fast_forward"] == {"mode": "off", "steps": 0}
    assert fast["status"] == slow["status"] == "ok"
    assert _strip(fast) == _strip(slow)
    mode = fast["engine_config"]["fast_forward"]
    assert mode["mode"] == "on"
    assert mode["steps"] > 0
    return fast


# Mixed lengths arriving fast enough that replicas run several requests at once, in a KV
# budget small enough to preempt.
MIXED = WorkloadSection(preset="mixed-text", num_requests=40, seed=4)
FAST = {"request_rate": 40.0}


@pytest.mark.parametrize(("engine", "router"), [
    *[("paged", r) for r in ROUTERS], ("contiguous", "least-kv"), ("contiguous", "prefix-aware"),
])
def test_every_router_matches_step_by_step(tmp_path: Path, router: str, engine: str) -> None:
    _check(tmp_path, MIXED, ClusterSection(replicas=3, router=router), engine=engine,
           kv_memory="2GiB", **FAST)


@pytest.mark.parametrize("router", ["prefix-aware", "session-affinity"])
def test_multi_turn_sessions_and_prefix_routing(tmp_path: Path, router: str) -> None:
    workload = WorkloadSection(preset="multi-turn", num_requests=30, seed=2)
    _check(tmp_path, workload, ClusterSection(replicas=3, router=router), kv_memory="4GiB")


@pytest.mark.parametrize("router", ["round-robin", "least-kv"])
def test_disaggregated_prefill_decode(tmp_path: Path, router: str) -> None:
    fast = _check(tmp_path, MIXED, ClusterSection(prefill_replicas=1, decode_replicas=2,
                                                  router=router, link="roce-100g"),
                  kv_memory="2GiB", **FAST)
    assert fast["summary"]["completed"] == 40


def test_mooncake_slice_colocated_and_disaggregated(tmp_path: Path) -> None:
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=30)
    for k, cluster in enumerate((ClusterSection(replicas=2, router="prefix-aware"),
                                 ClusterSection(prefill_replicas=1, decode_replicas=1))):
        _check(tmp_path / str(k), workload, cluster, model="qwen2.5-7b", kv_memory="6GiB",
               max_model_len=32768)


def test_concurrency_limit_steps_one_at_a_time(tmp_path: Path) -> None:
    cluster = ClusterSection(replicas=2)
    fast = _record(tmp_path, True, MIXED, "llama-2-7b", "paged", cluster, max_concurrency=4)
    slow = _record(tmp_path, False, MIXED, "llama-2-7b", "paged", cluster, max_concurrency=4)
    assert fast["engine_config"]["fast_forward"]["mode"].startswith("unsupported")
    assert _strip(fast) == _strip(slow)


def test_replicas_with_offload_tiers_and_swap(tmp_path: Path) -> None:
    record = _check(tmp_path, MIXED, ClusterSection(replicas=2, router="least-kv"),
                    kv_memory="2GiB", kv_offload="cpu:4GiB", kv_preemption="swap", **FAST)
    summary = record["summary"]
    assert summary["preemptions"] > 0 and summary["offload_swapped_out_bytes"] > 0
    assert summary["offload_stored_bytes"] >= summary["offload_swapped_out_bytes"]
