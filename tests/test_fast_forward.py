"""Decode fast-forward: a simulated engine taking runs of decode-only steps in one go writes
the same records, bit for bit, as stepping one at a time (host metrics aside), for every
named built-in engine and on workloads that exercise preemption, prefix caching, forks,
sliding windows, tensor parallelism and the device-memory models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvbench.engines.base import BatchShape
from kvbench.engines.kv import key_queue
from kvbench.engines.kv.paged import PagedPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import KINDS, NAMED_ENGINES
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import CostCoefficients, get_gpu
from kvbench.engines.sim.replay import EventReplay
from kvbench.engines.sim.replay import engine as replay_engine
from kvbench.engines.sim.replay import pool as replay_pool
from kvbench.results import stepstats
from kvbench.run.execute import record_of, start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection

FIXTURES = Path(__file__).parent / "fixtures"
MOONCAKE = FIXTURES / "mooncake_synthetic_trace_head300.jsonl"
HOST_SUMMARY = {"wall_time_s", "peak_rss_bytes", "rss_growth_pct", "telemetry_overhead_pct"}
BUILTIN = sorted(n for n, s in NAMED_ENGINES.items() if KINDS[s.kind].is_policy)


def _records(tmp: Path, fast_forward: bool, workload: WorkloadSection, model: str,
             engines: list[str], **run: Any) -> dict[str, dict]:
    suite = Suite(
        name="ff", workload=workload, model=ModelSection(preset=model),
        engines=run.pop("sections", {}),
        run=RunSection(device=run.pop("device", "sim:a100-80gb"), engines=engines,
                       fast_forward=fast_forward, **run),
    )
    plan = plan_run(suite, None, tmp / ("ff" if fast_forward else "steps"), "test")
    out = {}
    for name, config in plan.engines:
        r, described = start_and_run(plan, config, None)
        record = record_of(plan, r, described).model_dump()
        out[name] = record
    return out


def _strip(record: dict) -> dict:
    record = dict(record)
    record.pop("created_utc")
    record.pop("run_id")
    record["summary"] = {k: v for k, v in record["summary"].items() if k not in HOST_SUMMARY}
    record["curves"] = {k: v for k, v in record["curves"].items() if k != "rss_bytes"}
    record["engine_config"] = {k: v for k, v in record["engine_config"].items()
                               if k != "fast_forward"}
    if record.get("error"):  # its traceback names the path's own code
        record["error"] = record["error"].splitlines()[0]
    return record


def _check(tmp: Path, workload: WorkloadSection, model: str, engines: list[str],
           expect_bulk: bool = True, **run: Any) -> dict[str, dict]:
    fast = _records(tmp, True, workload, model, engines, **dict(run))
    slow = _records(tmp, False, workload, model, engines, **dict(run))
    for name in engines:
        a, b = fast[name], slow[name]
        assert b["engine_config"]["fast_forward"] == {"mode": "off", "steps": 0}
        mode = a["engine_config"]["fast_forward"]
        assert a["status"] == b["status"]
        assert _strip(a) == _strip(b), name
        if expect_bulk and mode["mode"] == "on":
            assert mode["steps"] > 0, name
    return fast


MIXED = WorkloadSection(preset="mixed-text", num_requests=16, seed=1)


@pytest.mark.parametrize("engine", BUILTIN)
def test_every_builtin_engine_preemption_heavy(tmp_path: Path, engine: str) -> None:
    """A KV budget small enough that paged preempts and contiguous waits for extents."""
    fast = _check(tmp_path, MIXED, "llama-2-7b", [engine], kv_memory="3GiB")
    mode = fast[engine]["engine_config"]["fast_forward"]["mode"]
    # vattention-prewarm maps pages between steps; hybrid defines no decode_room.
    if engine == "vattention-prewarm" or engine.startswith("hybrid"):
        assert mode.startswith("unsupported")
    else:
        assert mode == "on"


@pytest.mark.parametrize("engine", BUILTIN)
def test_every_builtin_engine_mooncake_slice(tmp_path: Path, engine: str) -> None:
    """The Mooncake trace's first requests: long prompts, shared prefix blocks, chunked
    prefill, prefix caching with eviction in a tight pool."""
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=24)
    _check(tmp_path, workload, "qwen2.5-7b", [engine], kv_memory="6GiB",
           max_model_len=32768)


@pytest.mark.parametrize("kv_memory", ["3GiB", "6GiB"])
def test_the_replay_without_a_c_compiler(tmp_path: Path, monkeypatch: Any,
                                         kv_memory: str) -> None:
    """Where the replay's C helpers cannot be built, it runs BlockPool and numpy prompt
    digests, with the same records as step by step (a Mooncake slice: evictions, shared
    prefixes; preempting where KV is tightest)."""
    monkeypatch.setattr(replay_pool, "_library", lambda: None)
    assert isinstance(replay_pool.new_pool(4, 16), replay_pool.ListPool)
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=24)
    _check(tmp_path, workload, "qwen2.5-7b", ["paged"], kv_memory=kv_memory,
           max_model_len=32768)


@pytest.mark.parametrize("preset", ["multimodal-reuse", "mixed-multimodal"])
def test_modal_page_classes_with_images_and_reuse(tmp_path: Path, preset: str) -> None:
    """Text and vision page classes (int8 vision, 512-token vision pages, split pools) with
    cached images and preemption: decoded text pages split off the buddy pool's blocks."""
    engines = ["modal-int8", "modal-pages", "modal-pages-split"]
    workload = WorkloadSection(preset=preset, num_requests=40)
    fast = _check(tmp_path, workload, "qwen2.5-7b", engines, kv_memory="512MiB",
                  request_rate=40.0)
    assert sum(fast[e]["summary"]["preemptions"] for e in engines) > 0
    assert all(fast[e]["engine_config"]["fast_forward"]["steps"] > 0 for e in engines)


@pytest.mark.parametrize("preset", ["multi-turn", "shared-prefix", "parallel-sampling"])
def test_prefix_caching_sessions_and_forks(tmp_path: Path, preset: str) -> None:
    workload = WorkloadSection(preset=preset, num_requests=20, seed=2)
    fast = _check(tmp_path, workload, "llama-2-7b", ["paged", "contiguous"], kv_memory="6GiB")
    assert fast["paged"]["summary"]["completed"] > 0


def test_sliding_window_model_and_release(tmp_path: Path) -> None:
    """Windowed attention changes each decode's keys read; releasing blocks outside the
    window is an event the paged policy takes step by step."""
    workload = WorkloadSection(preset="long-context", num_requests=12, seed=3)
    fast = _check(tmp_path, workload, "mistral-7b-v0.1", ["paged", "contiguous", "swa"],
                  kv_memory="8GiB", expect_bulk=False,
                  sections={"swa": PagedPolicy(sliding_window_release=True)})
    assert fast["paged"]["engine_config"]["fast_forward"]["mode"] == "on"
    assert fast["swa"]["engine_config"]["fast_forward"]["mode"].startswith("unsupported")


@pytest.mark.parametrize("impl", ["sdpa-dense-mask", "cpu-reference", "eager"])
def test_tensor_parallel_and_unfused_attention(tmp_path: Path, impl: str) -> None:
    """Unfused kernels' workspace grows with the longest decode's context, step by step."""
    _check(tmp_path, MIXED, "llama-2-7b", ["paged", "contiguous"],
           device="sim:a100-80gbx2", kv_memory="6GiB", attention_impl=impl)


def test_on_demand_kv_steps_one_at_a_time(tmp_path: Path) -> None:
    fast = _check(tmp_path / "od", MIXED, "llama-2-7b", ["paged"], kv_memory="4GiB",
                  kv_allocation="on-demand", expect_bulk=False)
    assert fast["paged"]["engine_config"]["fast_forward"]["mode"].startswith("unsupported")


def test_folded_step_log_keeps_the_metrics(tmp_path: Path, monkeypatch: Any) -> None:
    """A run whose step log folds its oldest steps (as a long one does) reports the
    metrics of the whole log: counts, extremes, worst cases and percentiles exactly, sums
    and means to a float's rounding; its curves keep every peak, trough and total."""
    workload = WorkloadSection(preset="mixed-text", num_requests=48, seed=1)
    engines = ["paged", "contiguous"]
    whole = _records(tmp_path / "whole", True, workload, "llama-2-7b", engines,
                     kv_memory="3GiB")
    monkeypatch.setattr(stepstats, "FOLD_STEPS", 128)
    monkeypatch.setattr(stepstats, "FINE_STEPS", 8)
    # Stepped one at a time, it folds at the same steps: the records are the same.
    folded = _check(tmp_path / "folded", workload, "llama-2-7b", engines, kv_memory="3GiB")
    for name in engines:
        a, b = _strip(whole[name]), _strip(folded[name])
        assert a["summary"]["num_steps"] > 4 * 128  # it folded
        assert a["summary"]["preemptions"] > 0 or name == "contiguous"
        assert a["summary"].keys() == b["summary"].keys()
        for key, value in a["summary"].items():
            assert b["summary"][key] == (value if not isinstance(value, float)
                                         else pytest.approx(value, rel=1e-12)), key
        ca, cb = a["curves"], b["curves"]
        assert ca.keys() == cb.keys()
        assert cb["t_s"][-1] == ca["t_s"][-1]
        for key in ca.keys() - {"t_s"}:
            keep = (min if key in (*stepstats.MIN_CURVES, "frag_index")
                    else sum if key in stepstats.SUM_CURVES else max)
            assert keep(cb[key]) == keep(ca[key]), key
        assert {k: v for k, v in a.items() if k not in ("summary", "curves")} \
            == {k: v for k, v in b.items() if k not in ("summary", "curves")}


_SPLIT = {"attention_flops_efficiency": 0.3, "attention_bandwidth_efficiency": 0.5}


@pytest.mark.parametrize("coef", [
    None, CostCoefficients(overlap=False), CostCoefficients(**_SPLIT),
    CostCoefficients(overlap=False, **_SPLIT)], ids=["step-roofline", "step-sum",
                                                   "operator-roofline", "operator-sum"])
def test_decode_step_times_equal_one_step_times(coef: CostCoefficients | None) -> None:
    rng = np.random.default_rng(0)
    for preset, hw, tp in (("llama-2-7b", "a100-80gb", 1), ("qwen2.5-7b", "h200", 2),
                           ("llama-3-8b", "h100-sxm", 4)):
        cost = CostModel(get_preset(preset), get_gpu(hw), tp, coef)
        for _ in range(20):
            n = int(rng.integers(1, 300))
            context = np.cumsum(rng.integers(n, 40 * n, size=50))
            pairs = context - rng.integers(0, n, size=50)
            times = cost.decode_step_times(n, context, pairs)
            assert times is not None
            one = [cost.step_time_s(BatchShape(num_seqs=n, decode_tokens=n,
                                               context_tokens=int(c), attn_pairs=int(p)))
                   for c, p in zip(context, pairs, strict=True)]
            assert times.tolist() == one


def test_offload_tiers_fill_during_decode_jumps(tmp_path: Path) -> None:
    """Sequences growing in a jump evict cached blocks into the tiers: each step's tier
    occupancy is the one a step-by-step run records."""
    fast = _check(tmp_path, MIXED, "llama-2-7b", ["paged"], kv_memory="3GiB",
                  kv_offload="cpu:4GiB")
    held = fast["paged"]["curves"]["offload_cpu_used_bytes"]
    assert len(set(held)) > 2


@pytest.mark.parametrize(("offload", "native"), [
    ("cpu:1GiB", True), ("cpu:512MiB@pcie5,disk:1GiB", True), ("cpu:512MiB,disk:1GiB", False),
    ("cpu:1GiB/layerwise", True), ("cpu:512MiB:lfu,disk:1GiB:cost", True),
    ("cpu:512MiB:cost,disk:1GiB:lfu", False), ("cpu:2GiB/swap", True),
    ("cpu:1GiB:cost,disk:1GiB/swap", False), ("cpu:1GiB/lfu", True),
    ("cpu:512MiB:lfu,disk:1GiB/lfu", False),
])
def test_offload_tiers_in_the_event_replay(tmp_path: Path, monkeypatch: Any, offload: str,
                                           native: bool) -> None:
    """The event replay keeps offload tiers of every eviction rule: blocks evicted (at
    admissions and along quiet stretches) go down, ranked by their hits and depth where a
    tier asks, lookups find them there, admissions load them and stall on the loads, and
    with swap preemption a preempted request's blocks go out and come back; the records are
    those of steps taken one at a time."""
    if not native:  # BlockPool and the Python key queue
        monkeypatch.setattr(replay_pool, "_library", lambda: None)
        monkeypatch.setattr(key_queue, "_library", lambda: None)
    advanced = []
    advance = EventReplay.advance
    monkeypatch.setattr(EventReplay, "advance",
                        lambda self, *a: advanced.append(1) or advance(self, *a))
    tiers, _, option = offload.partition("/")
    swap = option == "swap"
    sections = {"tiered": {"kind": "paged", "preemption": "swap" if swap else "recompute",
                           "eviction": "lfu" if option == "lfu" else "lru",
                           "offload": {"tiers": tiers, "overlap": option if option == "layerwise"
                                       else "none"}}}
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=60)
    fast = _check(tmp_path, workload, "qwen2.5-7b", ["tiered"],
                  kv_memory="2GiB" if swap else "6GiB", max_model_len=32768,
                  sections=sections)
    assert advanced
    summary = fast["tiered"]["summary"]
    assert summary["offload_stall_s"] > 0
    if swap:
        assert summary["preemptions"] > 0
        assert 0 < summary["offload_swapped_in_bytes"] <= summary["offload_swapped_out_bytes"]
        return
    assert summary["offload_cpu_hit_rate"] > 0
    assert len(set(fast["tiered"]["curves"]["offload_cpu_used_bytes"])) > 2


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("engine", ["paged-lfu", "paged-leaky"])
@pytest.mark.parametrize("kv_memory", ["3GiB", "6GiB"])
def test_lfu_and_leaks_in_the_event_replay(tmp_path: Path, monkeypatch: Any, kv_memory: str,
                                           engine: str, native: bool) -> None:
    """``paged-lfu`` and ``paged-leaky`` are replayed by events, in the C pool and in
    BlockPool: cached blocks evicted by the prefix hits they served; finished sequences'
    blocks never free again. The records are those of steps taken one at a time."""
    if not native:
        monkeypatch.setattr(replay_pool, "_library", lambda: None)
    advanced = []
    advance = EventReplay.advance
    monkeypatch.setattr(EventReplay, "advance",
                        lambda self, *a: advanced.append(1) or advance(self, *a))
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=60)
    fast = _check(tmp_path, workload, "qwen2.5-7b", [engine], kv_memory=kv_memory,
                  max_model_len=32768)
    assert advanced
    summary = fast[engine]["summary"]
    assert summary["kv_evictions"] > 0 if engine == "paged-lfu" else summary["completed"] > 0


@pytest.mark.parametrize("preset", ["multi-turn", "shared-prefix"])
def test_lfu_eviction_above_offload_tiers_in_the_replay(tmp_path: Path, monkeypatch: Any,
                                                        preset: str) -> None:
    """Device blocks evicted by LFU go down with their hits, and come back up with them
    (plus the hit that loads them): the replay ranks them as steps taken one at a time do."""
    advanced = []
    advance = EventReplay.advance
    monkeypatch.setattr(EventReplay, "advance",
                        lambda self, *a: advanced.append(1) or advance(self, *a))
    sections = {"tiered": {"kind": "paged", "eviction": "lfu", "offload": "cpu:1GiB"}}
    workload = WorkloadSection(preset=preset, num_requests=200, seed=2)
    fast = _check(tmp_path, workload, "llama-2-7b", ["tiered"], kv_memory="2GiB",
                  sections=sections)
    assert advanced
    assert fast["tiered"]["summary"]["offload_cpu_hit_rate"] > 0


def test_a_stuck_engine_waits_for_arrivals_then_fails(tmp_path: Path) -> None:
    """Leaked KV leaves requests waiting that no step can admit while more are still to
    arrive: after 1,000 steps without progress the engine waits for the next arrival, and
    with none left the run fails, by steps and by the replay alike (the clock used to stand
    still and the run never ended)."""
    workload = WorkloadSection(trace="mooncake", path=str(MOONCAKE), num_requests=60)
    fast = _check(tmp_path, workload, "qwen2.5-7b", ["paged-leaky"], kv_memory="6GiB",
                  max_model_len=32768)
    record = fast["paged-leaky"]
    assert record["status"] == "failed"
    assert "made no progress for 1000 steps (49 waiting, 0 running)" in record["error"]
    assert record["curves"]["t_s"][-1] >= max(r["arrival_s"] for r in record["requests"])


@pytest.mark.parametrize("engine", ["paged", "swap"])
def test_replay_blocks_of_one_event_each(tmp_path: Path, monkeypatch: Any, engine: str) -> None:
    """The replay hands its steps over in blocks whose ends fall where its wall time runs
    out; a record cannot depend on where. With one event to a block, preemptions land on
    blocks' first steps, and the records are still the step-by-step ones."""
    monkeypatch.setattr(replay_engine, "BLOCK_WALL_S", 0.0)
    sections = {"swap": {"kind": "paged", "preemption": "swap", "offload": "cpu:4GiB"}}
    fast = _check(tmp_path, MIXED, "llama-2-7b", [engine], kv_memory="3GiB", sections=sections)
    assert fast[engine]["summary"]["preemptions"] > 0
