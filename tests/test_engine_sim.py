"""The built-in engine (scheduler + KV managers) under the sim executor and virtual clock."""

from __future__ import annotations

import pytest

from helpers import make_workload, text_request
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSection, EngineSettings, engine_config
from kvbench.engines.kv.contiguous import ContiguousPolicy
from kvbench.engines.kv.paged import PagedPolicy
from kvbench.engines.kv.paged_mixed import PagedMixedPolicy
from kvbench.engines.kv.segmented import SegmentedPolicy
from kvbench.engines.kv.vattention import VAttentionPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine


def _opts(kv_tokens: int, *, max_len: int = 4096, seqs: int = 64, batched: int = 2048,
          chunked: bool = True, block_size: int = 16, prefix: bool = True) -> EngineSettings:
    preset = get_preset("llama-3-8b")
    return EngineSettings(
        preset=preset,
        device=parse_device("sim:a100-80gb"),
        kv_bytes=kv_tokens * preset.kv_bytes_per_token,
        block_size=block_size,
        prefix_caching=prefix,
        scheduler=SchedulerConfig(max_len, seqs, batched, chunked),
    )


def _run(engine_name: str, workload, opts: EngineSettings, section: EngineSection | None = None):
    engine = build_engine(engine_config(engine_name, section or NAMED_ENGINES[engine_name], opts))
    clock = VirtualClock(CostModel(opts.preset, opts.device.hardware, opts.device.tp))
    return run_engine(engine, workload, clock)


def _mixed(n: int = 40):
    return make_workload(
        [text_request(f"r{i}", 100 + 37 * (i % 11), 20 + 7 * (i % 5), arrival=0.01 * i)
         for i in range(n)]
    )


@pytest.mark.parametrize("name", ["paged", "contiguous", "contiguous-request", "contiguous-pow2",
                                  "paged-mixed", "paged-mixed-migrate", "paged-lfu", "segmented",
                                  "vattention", "vattention-64k", "vattention-prewarm"])
def test_every_request_gets_exactly_its_tokens(name: str) -> None:
    wl = _mixed()
    run = _run(name, wl, _opts(8192))
    assert run.status == "ok", run.error
    for t in run.timings.values():
        assert t.status == "ok"
        assert t.output_tokens_emitted == t.request.output_tokens
        assert t.request.arrival_s <= t.first_scheduled_s <= t.first_token_s <= t.finish_s
    s = summarize(run)
    assert s["completed"] == len(wl) and s["rejected"] == 0
    assert s["peak_kv_reserved_bytes"] <= s["kv_capacity_bytes"]


def test_virtual_clock_runs_are_identical() -> None:
    wl = _mixed()
    runs = [summarize(_run("paged", wl, _opts(4096))) for _ in range(2)]
    # Host metrics (process memory, the harness's own wall time) are the only
    # machine-dependent figures; the simulated device's memory is exact.
    machine = ("wall", "rss", "telemetry")
    a, b = ({k: v for k, v in s.items() if not any(m in k for m in machine)} for s in runs)
    assert a == b
    assert a["completed"] == len(wl)


def test_paged_admits_more_than_contiguous_max_model_len() -> None:
    wl = _mixed()
    opts = _opts(8192, max_len=4096)
    paged = summarize(_run("paged", wl, opts))
    contig = summarize(_run("contiguous", wl, opts))
    assert contig["max_concurrent_requests"] == 2  # 8192 tokens / 4096 reserved each
    assert paged["max_concurrent_requests"] > 4 * contig["max_concurrent_requests"]
    assert paged["kv_waste_pct"] < contig["kv_waste_pct"]


def test_paged_preempts_and_recomputes_under_pressure() -> None:
    wl = make_workload([text_request(f"r{i}", 200, 300) for i in range(8)])
    run = _run("paged", wl, _opts(1024, max_len=1024))
    s = summarize(run)
    assert s["preemptions"] > 0
    assert s["completed"] == 8
    assert all(t.output_tokens_emitted == 300 for t in run.timings.values())


def test_never_fitting_requests_are_rejected_not_dropped() -> None:
    wl = make_workload([text_request("ok", 100, 10), text_request("huge", 5000, 10)])
    run = _run("paged", wl, _opts(8192, max_len=4096))
    assert run.timings["huge"].status == "rejected"
    assert "max_model_len" in run.timings["huge"].rejected
    assert run.timings["ok"].status == "ok"
    run = _run("contiguous", make_workload([text_request("big", 3000, 10)]), _opts(2048))
    assert run.timings["big"].status == "rejected"


def test_chunked_prefill_splits_long_prompts() -> None:
    wl = make_workload([text_request("long", 1000, 4)])
    run = _run("paged", wl, _opts(8192, batched=256))
    assert max(run.steps.num_tokens) == 256
    assert run.timings["long"].output_tokens_emitted == 4
    with pytest.raises(Exception, match="chunked prefill"):
        _opts(8192, batched=256, chunked=False).scheduler.validate()


def test_prefix_caching_hits_shared_prefixes() -> None:
    reqs = [
        text_request(f"r{i}", 512, 4, arrival=float(i), key="shared/system-prompt")
        for i in range(4)
    ]
    run = _run("paged", make_workload(reqs), _opts(8192))
    s = summarize(run)
    # The first request computes 512 tokens; the others reuse 31 full blocks (1 token recomputed).
    assert s["prefix_hit_rate"] == pytest.approx(3 * 496 / (4 * 512), abs=0.01)
    off = summarize(_run("paged", make_workload(reqs), _opts(8192, prefix=False)))
    assert off["prefix_hit_rate"] in (None, 0.0)


def test_parallel_samples_fork_and_finish_together() -> None:
    wl = make_workload([text_request("p", 100, 10, n=4)])
    for name in ("paged", "contiguous-request"):
        run = _run(name, wl, _opts(4096))
        assert run.status == "ok", run.error
        assert run.timings["p"].output_tokens_emitted == 40
        assert run.timings["p"].status == "ok"


def test_leaking_option_keeps_blocks() -> None:
    wl = _mixed(10)
    leaky = PagedPolicy(leak_finished=True)
    run = _run("paged", wl, _opts(65536), leaky)
    assert run.last_kv.reserved_bytes > 0
    clean = _run("paged", wl, _opts(65536))
    assert clean.last_kv.reserved_bytes == 0


def test_reserved_memory_holds_back_its_share_of_the_budget() -> None:
    opts = _opts(8192)
    full = engine_config("paged", PagedPolicy(), opts)
    held = engine_config("paged", PagedPolicy(reserved_memory=0.25), opts)
    assert held.num_pages == 3 * full.num_pages // 4 and held.kv_bytes == full.kv_bytes
    wl = _mixed()
    a = summarize(_run("paged", wl, opts))
    b = summarize(_run("paged", wl, opts, PagedPolicy(reserved_memory=0.25)))
    assert b["kv_capacity_bytes"] == 3 * a["kv_capacity_bytes"] // 4
    assert b["completed"] == len(wl) and b["peak_kv_reserved_bytes"] <= b["kv_capacity_bytes"]


@pytest.mark.parametrize("section", [
    ContiguousPolicy(reservation="request", compaction=True),
    ContiguousPolicy(reservation="request", auto_defrag=0.7, align_bytes=128),
    PagedMixedPolicy(migrate=True, prewarm_pages=16),
    SegmentedPolicy(head_tokens=256),
    VAttentionPolicy(page_bytes=64 << 10, prewarm_pages=8, prewarm="hint"),
    PagedPolicy(eviction="lfu", reserved_memory=0.25),
], ids=["compact", "defrag+align", "mixed-migrate+prewarm", "segmented-256", "vattention-hint",
        "lfu+headroom"])
def test_policy_options_run_every_request_to_its_tokens(section: EngineSection) -> None:
    wl = _mixed()
    run = _run("option", wl, _opts(4096), section)
    assert run.status == "ok", run.error
    assert all(t.output_tokens_emitted == t.request.output_tokens for t in run.timings.values())
    s = summarize(run)
    assert s["completed"] == len(wl) and s["peak_kv_reserved_bytes"] <= s["kv_capacity_bytes"]


def test_mistral_v01_window_release_runs_more_at_once_in_the_simulator() -> None:
    # Mistral-7B v0.1's 4096-token window; 6000-token requests outgrow it, and four of them
    # fit in 16384 slots only when the blocks behind the window are released.
    preset = get_preset("mistral-7b-v0.1")
    assert preset.sliding_window == 4096
    opts = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=16384 * preset.kv_bytes_per_token, block_size=16, prefix_caching=True,
        scheduler=SchedulerConfig(8192, 8, 2048, True),
    )
    wl = make_workload([text_request(f"r{i}", 5000, 1000, arrival=0.1 * i) for i in range(4)])
    kept, freed = (summarize(_run("paged", wl, opts, PagedPolicy(sliding_window_release=r)))
                   for r in (False, True))
    assert kept["completed"] == freed["completed"] == 4
    assert kept["max_concurrent_requests"] == 3 and freed["max_concurrent_requests"] == 4
