"""Metric definitions on hand-made runs, and curves that agree with the summary."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import make_workload, text_request
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.errors import KvbenchError
from kvbench.results.curves import build_curves
from kvbench.results.gaps import GapLog
from kvbench.results.metrics import itl_samples, latency_samples, memory_metrics, summarize
from kvbench.results.runlog import EngineRun, ProbeSamples, RequestTiming, StepLog
from kvbench.results.slo import SLO, parse_slo
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import follows, run_engine
from kvbench.run.telemetry import Telemetry


def _timed_run() -> EngineRun:
    """Two completed requests with known token times, one rejected (clock: seconds): a
    emits in steps 0-2 (ending at 0.5, 0.7, 1.1 s), b in step 3 (1.2 s)."""
    a, b, c = text_request("a", 10, 3, 0.0), text_request("b", 10, 1, 1.0), text_request("c", 9, 2)
    timings = {
        "a": RequestTiming(a, first_scheduled_s=0.1, first_token_s=0.5, finish_s=1.1),
        "b": RequestTiming(b, first_scheduled_s=1.0, first_token_s=1.2, finish_s=1.2),
        "c": RequestTiming(c, rejected="too long"),
    }
    run = EngineRun("x", make_workload([a, b, c]), "virtual", timings, StepLog())
    steps = run.steps
    for step, (rid, t0, t1) in enumerate([("a", 0.0, 0.5), ("a", 0.5, 0.7), ("a", 0.7, 1.1),
                                          ("b", 1.1, 1.2)]):
        steps.t_s.append(t1)
        steps.dt_s.append(t1 - t0)
        for column in (steps.num_tokens, steps.running):
            column.append(1)
        steps.waiting.append(0)
        steps.preempted.append(0)
        on = follows(timings[rid], step, 1, 1, t1, t1, steps.gaps)
        steps.gaps.add(step, step + 1, on)
    run.duration_s = 2.0
    return run


def test_latency_definitions() -> None:
    run = _timed_run()
    lat = latency_samples(run)
    assert lat["ttft"] == pytest.approx([0.5, 0.2])
    assert lat["e2el"] == pytest.approx([1.1, 0.2])
    assert lat["tpot"] == pytest.approx([(1.1 - 0.5) / 2])  # b has one output token: no TPOT
    values, weights = itl_samples(run)
    assert np.repeat(values, weights) == pytest.approx([0.2, 0.4])  # pooled gaps of a
    s = summarize(run)
    assert s["completed"] == 2 and s["rejected"] == 1
    assert s["mean_ttft_ms"] == pytest.approx(350.0)
    assert s["median_tpot_ms"] == pytest.approx(300.0)
    assert s["p99_itl_ms"] == pytest.approx(200 + 0.99 * 200)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["request_goodput"] is None and s["slo_attainment_pct"] is None


def test_goodput_counts_requests_within_every_limit() -> None:
    run = _timed_run()
    s = summarize(run, SLO(ttft_ms=300))
    assert s["request_goodput"] == pytest.approx(0.5)  # only b; a's TTFT is 500 ms
    assert s["slo_attainment_pct"] == pytest.approx(100 / 3)  # the rejected request misses
    s = summarize(run, SLO(ttft_ms=600, tpot_ms=250))
    assert s["request_goodput"] == pytest.approx(0.5)  # a's TPOT is 300 ms
    s = summarize(run, SLO(ttft_ms=600, tpot_ms=300, e2el_ms=2000))
    assert s["request_goodput"] == pytest.approx(1.0)


def test_parse_slo() -> None:
    assert parse_slo("ttft:500, tpot:50") == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo("e2el:1e4").e2el_ms == 10_000
    for bad in ("ttft=5", "itl:5", "ttft:x", "tpot:0"):
        with pytest.raises(KvbenchError):
            parse_slo(bad)


def test_memory_growth_from_end_of_warmup() -> None:
    run = _timed_run()
    run.steps.t_s.extend([0.1 * i for i in range(6)])
    tel = Telemetry([], {"rss": "ok"})
    tel.samples["rss"] = ProbeSamples(("rss_bytes",), [0, 2, 5, 9], [(50,), (100,), (110,), (125,)])
    run.telemetry, run.warmup_step = tel, 3
    m = memory_metrics(run)
    assert m["peak_rss_bytes"] == 125
    # Warm-up ended at step 3: the reading then is the one taken at step 2 (100).
    assert m["rss_growth_pct"] == pytest.approx(25.0)
    assert m["memory_growth_pct"] == pytest.approx(25.0)
    assert m["device_growth_pct"] is None and m["peak_device_bytes"] is None


def test_device_memory_prefers_nvml_process_reading() -> None:
    run = _timed_run()
    run.steps.t_s.extend([0.0, 1.0, 2.0])
    tel = Telemetry([], {})
    cols = ("cuda_allocated_bytes", "cuda_reserved_bytes", "cuda_inactive_split_bytes",
            "cuda_alloc_retries", "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes")
    rows = [(10, 20, 1, 0, 15, 30), (10, 40, 3, 1, 25, 45)]
    tel.samples["cuda"] = ProbeSamples(cols, [0, 2], rows)
    run.telemetry, run.warmup_step = tel, 0
    m = memory_metrics(run)
    assert m["peak_device_bytes"] == 45  # the allocator's own peak, exact between readings
    assert m["device_growth_pct"] == pytest.approx(100.0)
    assert m["peak_cuda_inactive_split_bytes"] == 3 and m["cuda_alloc_retries"] == 1
    tel.samples["nvml"] = ProbeSamples(
        ("nvml_device_used_bytes", "nvml_process_used_bytes"), [0, 2], [(500, 100), (600, 120)]
    )
    m = memory_metrics(run)
    assert m["peak_device_bytes"] == 120
    assert m["device_growth_pct"] == pytest.approx(20.0)
    assert m["memory_growth_pct"] == pytest.approx(20.0)


def _sim_run(engine: str, kv_tokens: int = 6144):
    preset = get_preset("llama-3-8b")
    opts = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=kv_tokens * preset.kv_bytes_per_token, block_size=16, prefix_caching=True,
        scheduler=SchedulerConfig(2048, 64, 1024, True),
    )
    wl = make_workload(
        [text_request(f"r{i}", 100 + 53 * (i % 7), 10 + 9 * (i % 4), arrival=0.02 * i,
                      key="shared/system" if i % 3 == 0 else None)
         for i in range(40)]
    )
    clock = VirtualClock(CostModel(preset, opts.device.hardware, opts.device.tp))
    return run_engine(build_engine(engine_config(engine, NAMED_ENGINES[engine], opts)), wl, clock)


@pytest.mark.parametrize("engine", ["paged", "contiguous"])
def test_curves_agree_with_summary(engine: str) -> None:
    run = _sim_run(engine)
    assert run.status == "ok", run.error
    s = summarize(run)
    for max_points in (1000, 37):  # exact and downsampled
        c = build_curves(run.steps, run.telemetry, max_points=max_points)
        assert max(c["kv_reserved_bytes"]) == s["peak_kv_reserved_bytes"]
        assert max(c["kv_used_bytes"]) == s["peak_kv_used_bytes"]
        assert max(c["running"]) == s["max_concurrent_requests"]
        assert sum(c["preempted"]) == s["preemptions"]
        assert min(c["frag_index"]) == pytest.approx(s["min_frag_index"])
        assert max(c["rss_bytes"]) == s["peak_rss_bytes"]
        for used, res, cap in zip(
            c["kv_used_bytes"], c["kv_reserved_bytes"], c["kv_capacity_bytes"], strict=True
        ):
            assert 0 <= used <= res <= cap == s["kv_capacity_bytes"]
        assert c["t_s"][-1] == pytest.approx(s["duration_s"])
        turnover = (c["block_allocs"][-1] + c["block_frees"][-1]) / s["duration_s"]
        assert turnover == pytest.approx(s["page_turnover_per_s"])
        assert max(c["page_table_entries"]) == s["peak_page_table_entries"]
        assert c["kv_copied_bytes"][-1] == s["kv_copied_bytes"]
    assert s["kv_waste_pct"] == pytest.approx(100 * (1 - s["mean_kv_utilization"]))
    if s["kv_reservation_waste_pct"] is not None:
        assert s["kv_reservation_waste_pct"] + s["kv_internal_waste_pct"] == pytest.approx(
            s["kv_waste_pct"]
        )
        assert s["kv_reservation_waste_pct"] >= 0 and s["kv_internal_waste_pct"] >= -1e-9
    assert s["kv_retained_bytes"] == 0
    assert 0 < s["mean_page_table_entries"] <= s["peak_page_table_entries"]
    assert s["peak_page_table_bytes"] == 8 * s["peak_page_table_entries"]


def test_page_tables_cost_more_entries_than_extents() -> None:
    paged, contig = summarize(_sim_run("paged")), summarize(_sim_run("contiguous"))
    # One entry per 16-token block vs one descriptor per request.
    assert contig["peak_page_table_entries"] <= contig["max_concurrent_requests"]
    assert paged["peak_page_table_entries"] > 5 * paged["max_concurrent_requests"]
    assert paged["kv_evictions"] is not None and contig["kv_evictions"] is None
    assert paged["kv_merges"] is None and contig["kv_map_ops"] is None


def test_paged_wastes_less_and_shares_prefixes() -> None:
    paged, contig = summarize(_sim_run("paged")), summarize(_sim_run("contiguous"))
    assert paged["kv_waste_pct"] < 5 < 50 < contig["kv_waste_pct"]
    assert paged["min_frag_index"] == 1.0 and contig["min_frag_index"] < 1.0
    assert paged["prefix_hit_rate"] > 0 and paged["shared_block_ratio"] > 0
    assert contig["prefix_hit_rate"] is None and contig["shared_block_ratio"] == 0
    assert paged["max_concurrent_requests"] > contig["max_concurrent_requests"]


def test_tokens_following_on_count_per_step_and_other_gaps_are_values() -> None:
    """A request's gap to a token of the step before is that step's length, counted per
    step; after a pause (a preemption) its gap is kept as a value; several samples' tokens
    in one step are one emission."""
    gaps = GapLog()
    t = RequestTiming(text_request("a", 10, 9, 0.0))
    assert not follows(t, 3, 1, 1, 1.5, 1.5, gaps)  # the first token: no gap
    assert follows(t, 4, 3, 1, 2.0, 3.0, gaps)  # steps 4-6 follow on from step 3
    assert follows(t, 7, 1, 2, 3.5, 3.5, gaps)  # two samples' tokens in step 7
    assert not follows(t, 10, 1, 2, 5.0, 5.0, gaps)  # after a pause
    assert t.output_tokens_emitted == 8
    assert gaps.samples == [5.0 - 3.5]
    gaps.add(4, 8)
    assert gaps.weights(12).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
