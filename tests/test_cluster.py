"""Replicas behind a router on one virtual clock, and disaggregated prefill/decode."""

from __future__ import annotations

import json

import pytest

from helpers import make_workload, run_cli, text_request
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.cluster.engine import ClusterEngine, ClusterSection
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sim.costmodel import CostModel
from kvbench.results.cluster import cluster_summary
from kvbench.results.metric_table import METRIC_BY_NAME, METRICS, curve_spec
from kvbench.results.metrics import summarize
from kvbench.run.clocks import VirtualClock
from kvbench.run.devices import parse_device
from kvbench.run.harness import run_engine
from kvbench.workloads.model import Request, Segment


def _settings(kv_tokens: int = 20000, prefix: bool = True) -> EngineSettings:
    preset = get_preset("llama-3-8b")
    return EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=kv_tokens * preset.kv_bytes_per_token, block_size=16, prefix_caching=prefix,
        scheduler=SchedulerConfig(4096, 64, 2048, True),
    )


def _cost(s: EngineSettings) -> CostModel:
    return CostModel(s.preset, s.device.hardware, s.device.tp)


def _cluster(workload, section: ClusterSection, engine: str = "paged", **kw):
    s = _settings(**kw)
    config = engine_config(engine, NAMED_ENGINES[engine], s)
    replicas = [build_engine(config) for _ in range(section.num_replicas)]
    cluster = ClusterEngine(engine, replicas, section, _cost(s),  # type: ignore[arg-type]
                            [r.arrival_s for r in workload.requests])
    run = run_engine(cluster, workload, VirtualClock(_cost(s)))
    assert run.status == "ok", run.error
    run.cluster = cluster.log
    return run, cluster


def _mixed(n: int = 48, gap: float = 0.02):
    return make_workload([text_request(f"r{i}", 100 + 37 * (i % 11), 20 + 7 * (i % 5),
                                       arrival=gap * i) for i in range(n)])


def _shared_prefixes(n: int = 64, groups: int = 4, gap: float = 0.05):
    """Requests sharing one of ``groups`` 512-token system prompts."""
    reqs = [Request(f"r{i}", gap * i, (Segment("text", 512, f"sys/{i % groups}"),
                                       Segment("text", 40 + i % 7, f"q/{i}")), 16)
            for i in range(n)]
    return make_workload(reqs)


def test_one_replica_cluster_times_requests_as_the_engine_alone() -> None:
    wl = _mixed()
    s = _settings()
    alone = run_engine(build_engine(engine_config("paged", NAMED_ENGINES["paged"], s)), wl,
                       VirtualClock(_cost(s)))
    run, _ = _cluster(wl, ClusterSection(replicas=1))
    for rid, t in alone.timings.items():
        c = run.timings[rid]
        assert c.status == t.status == "ok"
        assert c.first_token_s == pytest.approx(t.first_token_s, abs=1e-9)
        assert c.finish_s == pytest.approx(t.finish_s, abs=1e-9)
        assert c.first_scheduled_s == pytest.approx(t.first_scheduled_s, abs=1e-9)


@pytest.mark.parametrize("router", ["round-robin", "least-outstanding", "least-kv",
                                    "prefix-aware", "session-affinity"])
def test_every_router_completes_every_request_with_its_tokens(router: str) -> None:
    wl = _mixed()
    run, cluster = _cluster(wl, ClusterSection(replicas=3, router=router))
    for t in run.timings.values():
        assert t.status == "ok" and t.output_tokens_emitted == t.request.output_tokens
    assert sum(cluster.log.routed) == len(wl)
    summary = summarize(run)
    assert summary["peak_kv_reserved_bytes"] <= summary["kv_capacity_bytes"]
    assert summary["kv_capacity_bytes"] == 3 * cluster._reps[0].kv.capacity_bytes
    assert summary["kv_retained_bytes"] == 0
    extra = cluster_summary(run, cluster.log)
    assert extra["replicas"] == 3 and extra["load_imbalance"] >= 1.0


def test_round_robin_spreads_requests_evenly() -> None:
    _, cluster = _cluster(_mixed(48), ClusterSection(replicas=4))
    assert cluster.log.routed == [12, 12, 12, 12]


def test_three_replicas_finish_sooner_than_one_under_load() -> None:
    wl = _mixed(60, gap=0.0)
    one, _ = _cluster(wl, ClusterSection(replicas=1))
    three, _ = _cluster(wl, ClusterSection(replicas=3, router="least-outstanding"))
    assert three.duration_s < 0.6 * one.duration_s


def test_prefix_aware_routing_raises_the_cluster_hit_rate() -> None:
    wl = _shared_prefixes(groups=7)
    rates = {}
    for router in ("round-robin", "prefix-aware"):
        run, cluster = _cluster(wl, ClusterSection(replicas=4, router=router, load_cap=4.0))
        rates[router] = cluster_summary(run, cluster.log)["cluster_prefix_hit_rate"]
    assert rates["prefix-aware"] > rates["round-robin"] + 0.1


def test_the_load_cap_moves_requests_off_the_best_prefix_replica() -> None:
    # Every request shares one prefix, arriving faster than a replica finishes them.
    wl = _shared_prefixes(n=40, groups=1, gap=0.001)
    run, cluster = _cluster(wl, ClusterSection(replicas=4, router="prefix-aware",
                                               load_cap=1.0))
    moved = cluster_summary(run, cluster.log)["requests_moved_by_load_cap"]
    assert moved > 0
    assert min(cluster.log.routed) > 0
    run, cluster = _cluster(wl, ClusterSection(replicas=4, router="prefix-aware",
                                               load_cap=100.0))
    assert cluster_summary(run, cluster.log)["requests_moved_by_load_cap"] == 0


def test_session_affinity_keeps_a_session_on_one_replica() -> None:
    reqs = [Request(f"s{k}-t{j}", 0.3 * j + 0.01 * k, (Segment("text", 80 + 50 * j, f"s{k}"),),
                    12, session_id=f"s{k}") for k in range(5) for j in range(4)]
    _, cluster = _cluster(make_workload(reqs), ClusterSection(replicas=3,
                                                              router="session-affinity"))
    routes = cluster.log.routes
    for k in range(5):
        assert len({routes[f"s{k}-t{j}"] for j in range(4)}) == 1
    assert len(set(routes.values())) == 3


def test_disaggregated_prefill_sends_kv_and_decodes_elsewhere() -> None:
    wl = _mixed(30)
    section = ClusterSection(prefill_replicas=1, decode_replicas=2, link="ib-hdr")
    run, cluster = _cluster(wl, section)
    for t in run.timings.values():
        assert t.status == "ok" and t.output_tokens_emitted == t.request.output_tokens
    log = cluster.log
    bpt = cluster._reps[0].engine.kv.bytes_per_token
    assert {tr.request.id for tr in log.transfers} == set(run.timings)
    assert sum(tr.nbytes for tr in log.transfers) == bpt * sum(r.prompt_tokens
                                                                for r in wl.requests)
    for tr in log.transfers:
        assert tr.ready_s <= tr.start_s < tr.end_s <= tr.admitted_s
        assert tr.end_s - tr.start_s == pytest.approx(5e-6 + tr.nbytes / 25e9)
        # The client's first token comes with the decode replica's receipt.
        assert run.timings[tr.request.id].first_token_s == pytest.approx(tr.admitted_s)
        assert cluster.log.roles[tr.target] == "decode"
    s = cluster_summary(run, log)
    assert s["kv_transfers"] == 30 and 0 < s["kv_transfer_share_of_ttft_pct"] < 100
    assert s["peak_prefill_kv_reserved_bytes"] > 0 and s["peak_decode_kv_reserved_bytes"] > 0
    assert s["peak_kv_held_for_transfer_bytes"] > 0
    # No prompt shares a prefix: holding and receiving KV are no prefix-cache hits.
    assert s["cluster_prefix_hit_rate"] == 0
    # Nothing stays held or reserved once everything is decoded.
    assert [r.engine.kv.stats().reserved_bytes for r in cluster._reps] == [0, 0, 0]


def test_a_slower_link_takes_a_larger_share_of_ttft() -> None:
    wl = _mixed(20)
    shares = []
    for link in ("nvlink-a100", "roce-100g"):
        run, cluster = _cluster(wl, ClusterSection(prefill_replicas=1, decode_replicas=1,
                                                   link=link))
        shares.append(cluster_summary(run, cluster.log)["kv_transfer_share_of_ttft_pct"])
    assert shares[1] > 2 * shares[0]


def test_cluster_metrics_and_curves_are_declared() -> None:
    run, cluster = _cluster(_mixed(12), ClusterSection(prefill_replicas=1, decode_replicas=1))
    summary = cluster_summary(run, cluster.log)
    for key in summary:
        assert key in METRIC_BY_NAME, key
    for spec in METRICS:
        if spec.needs in (("cluster",), ("disaggregated",)):
            assert summary[spec.name] is not None, spec.name
    from kvbench.results.cluster import cluster_curves

    for name in cluster_curves(cluster.log):
        assert curve_spec(name) is not None, name


def _record(out) -> dict:
    data = json.loads((out / "paged.json").read_text())
    for key in ("created_utc", "run_id", "machine", "git_commit", "command", "telemetry"):
        data.pop(key)
    for key in ("wall_time_s", "peak_rss_bytes", "rss_growth_pct", "telemetry_overhead_pct"):
        data["summary"].pop(key, None)
    data["curves"].pop("rss_bytes", None)
    return data


def test_cluster_runs_are_deterministic(tmp_path, capsys) -> None:
    args = ["run", "quick-sim", "--num-requests", "40", "--engines", "paged",
            "--replicas", "3", "--router", "prefix-aware", "--force"]
    records = []
    for k in range(2):
        out = tmp_path / f"r{k}"
        code, text = run_cli([*args, "--out", str(out)], capsys)
        assert code == 0, text
        records.append(_record(out))
    assert records[0] == records[1]
    summary = records[0]["summary"]
    assert summary["replicas"] == 3 and summary["completed"] == 40
    assert "replica2_running" in records[0]["curves"]
    assert records[0]["engine_config"]["cluster"]["router"] == "prefix-aware"


def test_suite_cluster_table_and_disaggregated_flags(tmp_path, capsys) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text('[workload]\npreset = "mixed-text"\nnum_requests = 16\n'
                     '[model]\npreset = "llama-2-7b"\n'
                     '[run]\ndevice = "sim:a100-80gb"\nkv_memory = "8GiB"\nengines = ["paged"]\n'
                     '[cluster]\nprefill_replicas = 1\ndecode_replicas = 2\nlink = "ib-ndr"\n')
    code, text = run_cli(["run", str(suite), "--out", str(tmp_path / "o")], capsys)
    assert code == 0, text
    data = json.loads((tmp_path / "o" / "paged.json").read_text())
    assert data["summary"]["kv_transfers"] == 16
    assert data["engine_config"]["cluster"]["roles"] == ["prefill", "decode", "decode"]


@pytest.mark.parametrize("args, message", [
    (["--replicas", "2", "--device", "cpu", "--model", "tiny"], "virtual clock"),
    (["--prefill-replicas", "2"], "give both prefill_replicas and decode_replicas"),
    (["--replicas", "2", "--router", "random"], "--router 'random'"),
    (["--prefill-replicas", "1", "--decode-replicas", "1", "--link", "pcie"], "unknown link"),
])
def test_bad_cluster_options_are_clear_errors(args, message, tmp_path, capsys) -> None:
    code, text = run_cli(["run", "quick-sim", "--num-requests", "4", *args,
                          "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and message in text, text
