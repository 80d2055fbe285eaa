"""Server metrics into KVStats: a real vLLM page, several engines, SGLang, and absences."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.engines.external.openai.server_metrics import ServerKV, parse_metrics, relevant_lines

pytest.importorskip("prometheus_client")

VLLM_PAGE = (Path(__file__).parent / "fixtures" / "vllm_metrics_busy.txt").read_text()
BPT = 2048  # the tiny preset's KV bytes per token
BLOCK = 32 * BPT


def test_a_real_vllm_page() -> None:
    s = parse_metrics(VLLM_PAGE)
    assert s.flavor == "vllm"
    assert (s.running, s.waiting, s.preemptions) == (6.0, 0.0, 0.0)
    assert s.usage == pytest.approx(18 / 63)
    assert (s.capacity_blocks, s.block_size) == (64, 32)
    assert (s.prefix_queries, s.prefix_hits) == (2965.0, 1504.0)
    assert (s.mm_cache_queries, s.mm_cache_hits) == (0.0, 0.0)
    # The pool was sized by a block-count override, so the configured budget says nothing.
    assert s.kv_cache_memory_bytes is None
    assert s.used_tokens is None and s.cache_hit_rate is None


def test_only_the_families_read_are_parsed() -> None:
    kept = relevant_lines(VLLM_PAGE).splitlines()
    assert 10 < len(kept) < len(VLLM_PAGE.splitlines()) / 10
    assert not any("histogram" in line or "_bucket" in line for line in kept)


def test_vllm_usage_becomes_whole_blocks_of_the_usable_pool() -> None:
    start = parse_metrics(VLLM_PAGE.replace("1504.0", "1000.0").replace("2965.0", "2000.0"))
    s = parse_metrics(VLLM_PAGE)
    kv = ServerKV.of(s, BPT)
    # vLLM keeps one null block back from requests.
    assert (kv.capacity_bytes, kv.usable_bytes) == (64 * BLOCK, 63 * BLOCK)
    stats = kv.stats(s, start)
    assert stats.capacity_bytes == 64 * BLOCK
    assert stats.reserved_bytes == 18 * BLOCK
    assert stats.free_bytes == stats.largest_free_bytes == 45 * BLOCK
    assert (stats.prefix_hit_tokens, stats.prefix_query_tokens) == (504, 965)
    assert stats.used_bytes is None and stats.shared_bytes is None
    assert stats.block_allocs is None and stats.evictions is None


def _two_engines(usage: tuple[float, float]) -> str:
    lines = ["# TYPE vllm:kv_cache_usage_perc gauge"]
    lines += [f'vllm:kv_cache_usage_perc{{engine="{i}"}} {u}' for i, u in enumerate(usage)]
    lines += ["# TYPE vllm:num_requests_running gauge"]
    lines += [f'vllm:num_requests_running{{engine="{i}"}} 3.0' for i in range(2)]
    lines += ["# TYPE vllm:cache_config_info gauge"]
    lines += [f'vllm:cache_config_info{{block_size="16",engine="{i}",num_gpu_blocks="101",'
              f'kv_cache_memory_bytes="None",num_gpu_blocks_override="None"}} 1.0'
              for i in range(2)]
    return "\n".join(lines) + "\n"


def test_data_parallel_engines_sum_pools_and_average_usage() -> None:
    s = parse_metrics(_two_engines((0.5, 0.25)))
    assert s.running == 6.0 and s.capacity_blocks == 202 and s.block_size == 16
    assert s.usage == pytest.approx(0.375)
    assert s.kv_cache_memory_bytes is None


def test_sglang_tokens_and_capacity() -> None:
    page = (
        "# TYPE sglang:num_used_tokens gauge\nsglang:num_used_tokens{model_name=\"m\"} 1200\n"
        "# TYPE sglang:max_total_num_tokens gauge\n"
        "sglang:max_total_num_tokens{model_name=\"m\"} 4000\n"
        "# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name=\"m\"} 0.3\n"
        "# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name=\"m\"} 7\n"
    )
    s = parse_metrics(page)
    assert s.flavor == "sglang" and s.waiting == 7.0 and s.running is None
    stats = ServerKV.of(s, BPT).stats(s, s)
    assert stats.capacity_bytes == 4000 * BPT
    assert stats.reserved_bytes == 1200 * BPT and stats.free_bytes == 2800 * BPT
    # SGLang has no prefix-cache counters: absent, not zero.
    assert stats.prefix_hit_tokens is None and stats.prefix_query_tokens is None


def test_unknown_metrics_and_unknown_capacity() -> None:
    assert parse_metrics("# TYPE up gauge\nup 1\n").flavor == "unknown"
    s = parse_metrics("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc 0.5\n")
    kv = ServerKV.of(s, BPT)
    assert kv.capacity_bytes is None
    assert kv.stats(s, s) is None  # a fraction of an unknown pool is no byte count


# Pages holding the offload families, rendered from the servers' own metric definitions
# (names, types, labels): vLLM 0.32's offloading connector with LMCache 0.5.6 beside a
# recorded vLLM page, and SGLang 0.5.23 with HiCache.
OFFLOAD_PAGE = (Path(__file__).parent / "fixtures" / "vllm_offload_metrics.txt").read_text()
HICACHE_PAGE = (Path(__file__).parent / "fixtures" / "sglang_hicache_metrics.txt").read_text()


def _grown(page: str, **values: str) -> str:
    """``page`` with each sample line whose name starts with a key set to its value."""
    out = []
    for line in page.splitlines():
        for name, value in values.items():
            if line.startswith(name):
                line = f"{line.rsplit(' ', 1)[0]} {value}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_vllm_offloading_connector_and_lmcache() -> None:
    s = parse_metrics(OFFLOAD_PAGE)
    assert s.flavor == "vllm"  # LMCache's families do not make it another server
    assert (s.offload_loaded_bytes, s.offload_stored_bytes) == (3 << 30, 8 << 30)
    assert (s.offload_load_s, s.offload_store_s) == (0.25, 0.5)
    assert s.offload_hits == s.lmcache_hits == 12288.0
    assert (s.lmcache_cpu_bytes, s.lmcache_disk_bytes) == (5 << 30, 20 << 30)
    start = parse_metrics(_grown(OFFLOAD_PAGE, **{
        "vllm:external_prefix_cache_hits_total": "2288.0",
        "vllm:kv_offload_load_bytes_total": "1073741824",
        "vllm:kv_offload_load_time_total": "0.05",
    }))
    stats = ServerKV.of(s, BPT).stats(s, start)
    # Counters count from the run's start; the connector's hits, not LMCache's again.
    assert stats.offload_hit_tokens == 10000
    assert stats.offload_loaded_bytes == 2 << 30
    assert stats.offload_load_s == pytest.approx(0.2)
    assert stats.offload_stored_bytes == 0
    assert stats.offload_used_bytes == 25 << 30
    assert stats.offload_tiers == {"cpu": {"used_bytes": 5 << 30},
                                   "disk": {"used_bytes": 20 << 30}}


def test_sglang_hicache() -> None:
    s = parse_metrics(HICACHE_PAGE)
    assert s.flavor == "sglang"
    # Cached tokens from host memory and storage, not from the device nor the total.
    assert s.offload_hits == 24000.0
    assert (s.offload_loaded_bytes, s.offload_stored_bytes) == (2 << 30, 6 << 30)
    assert (s.offload_load_s, s.offload_store_s) == (0.1, 0.3)
    stats = ServerKV.of(s, BPT).stats(s, parse_metrics(_grown(
        HICACHE_PAGE, **{'sglang:cached_tokens_total{cache_source="host"': "0.0"})))
    assert stats.offload_hit_tokens == 20000
    assert stats.offload_used_bytes == 300000 * BPT
    assert stats.offload_tiers == {"cpu": {"used_bytes": 300000 * BPT}}


def test_offload_absent_is_none_not_zero() -> None:
    s = parse_metrics(VLLM_PAGE)
    stats = ServerKV.of(s, BPT).stats(s, s)
    # The recorded page's connector counters read 0: a connector was asked, none found.
    assert stats.offload_hit_tokens == 0
    for name in ("offload_loaded_bytes", "offload_stored_bytes", "offload_load_s",
                 "offload_used_bytes", "offload_tiers"):
        assert getattr(stats, name) is None, name
    bad = parse_metrics(_grown(HICACHE_PAGE, **{"sglang:load_back_bytes_total": "-5"}))
    assert bad.offload_loaded_bytes is None and "offload_loaded_bytes" in bad.dropped


HYBRID_PAGE = (Path(__file__).parent / "fixtures" / "sglang_hybrid_metrics.txt").read_text()


def test_sglang_pools_of_a_hybrid_model_are_layer_groups() -> None:
    s = parse_metrics(HYBRID_PAGE)
    assert s.flavor == "sglang"
    # Two engines' fractions are averaged, their token counts summed.
    assert s.full_usage == pytest.approx(0.25) and s.mamba_usage == pytest.approx(0.58)
    assert s.swa_usage is None and s.used_tokens == 50000.0
    stats = ServerKV.of(s, BPT).stats(s, s)
    assert stats.groups == {"full": {"kind": "full", "usage": pytest.approx(0.25)},
                            "state": {"kind": "state", "usage": pytest.approx(0.58)}}
    # A pool the page lacks, or whose value is no fraction, is absent, never 0.
    bad = parse_metrics(_grown(HYBRID_PAGE, **{"sglang:mamba_usage": "1.5"}))
    assert bad.mamba_usage is None and "mamba_usage" in bad.dropped
    assert set(ServerKV.of(bad, BPT).stats(bad, bad).groups) == {"full"}
    plain = parse_metrics(HICACHE_PAGE)
    assert ServerKV.of(plain, BPT).stats(plain, plain).groups is None


def test_group_columns_stay_aligned_when_a_scrape_lacks_a_pool() -> None:
    from kvbench.results.runlog import StepLog
    from kvbench.run.harness import _log_groups

    s = StepLog()
    for groups in ({}, {"full": {"kind": "full", "usage": 0.5}},
                   {"state": {"kind": "state", "usage": 0.25}}):
        s.kv_used_bytes.append(None)
        _log_groups(s, groups)
    assert s.kv_groups["full_usage"].head(3)[1].tolist() == [True, False, True]
    assert s.kv_groups["state_usage"].head(3)[1].tolist() == [True, True, False]
