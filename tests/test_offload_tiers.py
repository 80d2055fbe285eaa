"""KV offload tiers below device memory in the built-in paged engine."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvbench.engines.base import BatchShape, causal_pairs
from kvbench.engines.kv.offload import TIER_KINDS, OffloadSpec, OffloadTiers
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.engines.model.presets import get_preset
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import get_gpu
from kvbench.errors import KvbenchError
from kvbench.results.metric_table import OFFLOAD_TIER_KINDS
from kvbench.results.metrics import summarize
from kvbench.run.execute import start_and_run
from kvbench.run.plan import plan_run
from kvbench.run.suite import ModelSection, RunSection, Suite, WorkloadSection
from kvbench.workloads.model import Request, Segment

MOONCAKE = Path(__file__).parent / "fixtures" / "mooncake_synthetic_trace_head300.jsonl"
BS = 4


def test_metric_table_names_every_tier_kind() -> None:
    assert OFFLOAD_TIER_KINDS == TIER_KINDS


@pytest.mark.parametrize("text, message", [
    ("cpu", "write KIND:SIZE"), ("gpu:1GiB", "kind 'gpu'"), ("cpu:1GiB:mru", "'mru'"),
    ("cpu:1GiB@pcie9", "unknown offload link"), ("cpu:1GiB,cpu:2GiB", "repeat a kind"),
    ("cpu:12", "needs a unit"),
])
def test_bad_tier_text_says_how_to_write_it(text: str, message: str) -> None:
    with pytest.raises(KvbenchError, match=message):
        OffloadSpec.model_validate(text)


def _manager(tiers: str, num_blocks: int = 12) -> PagedKVManager:
    spec = OffloadSpec.model_validate(tiers)
    offload = OffloadTiers(spec, BS, BS * 8, None, lambda depth: 1e-3 * (depth + 1))
    return PagedKVManager(num_blocks, BS, 8, 4096, offload=offload)


def _seq(rng: random.Random, i: int, prefixes: list[list[int]]) -> Sequence:
    prompt = [*rng.choice(prefixes)[: rng.randrange(2, 40)], rng.randrange(1000)]
    request = Request(f"r{i}", 0.0, (Segment("text", len(prompt), f"t/{i}"),),
                      rng.randrange(1, 6))
    return Sequence(i, request, np.array(prompt, dtype=np.int64))


def _check_tiers(kv: PagedKVManager) -> None:
    """Each key is held in one place: a device block or exactly one tier, within capacity."""
    offload = kv.offload
    assert offload is not None
    device = set(kv.pool._by_hash)
    held = [set(t.queue) for t in offload.tiers]
    assert sum(map(len, held)) == len(offload.where)
    for tier, keys in zip(offload.tiers, held, strict=True):
        assert len(keys) <= tier.capacity_blocks
        assert all(offload.where[k] is tier for k in keys)
        assert not keys & device
    for a in range(len(held)):
        for b in range(a + 1, len(held)):
            assert not held[a] & held[b]


@pytest.mark.parametrize("tiers", ["cpu:256B", "cpu:128B,disk:320B:lfu",
                                   "cxl:160B:cost,disk:224B:cost"])
def test_blocks_are_conserved_across_tiers(tiers: str) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    kv = _manager(tiers)
    live: list[Sequence] = []
    loaded = 0
    for i in range(400):
        if live and (rng.random() < 0.5 or len(live) > 3):
            seq = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.8:  # finished; else preempted, its blocks kept findable
                seq.output_ids = [0] * seq.request.output_tokens
            kv.free(seq)
        else:
            seq = _seq(rng, i, prefixes)
            cached = kv.lookup_prefix(seq)
            if kv.allocate(seq, cached, seq.num_tokens - cached):
                seq.num_computed_tokens = seq.num_tokens
                kv.commit(seq)
                live.append(seq)
                loaded += kv.take_load_s() > 0
        _check_tiers(kv)
    for seq in live:
        kv.free(seq)
    assert loaded > 0  # the tiers served hits
    assert kv.pool.num_free == kv.num_blocks  # everything returned after drain
    stats = kv.stats()
    assert stats.offload_used_bytes == len(kv.offload.where) * BS * 8
    assert stats.offload_hit_tokens == sum(
        t["hit_tokens"] for t in stats.offload_tiers.values())


def _summary(tmp: Path, **run: object) -> dict:
    suite = Suite(
        name="offload", workload=WorkloadSection(trace="mooncake", path=str(MOONCAKE),
                                                 num_requests=60),
        model=ModelSection(preset="qwen2.5-7b"),
        run=RunSection(device="sim:a100-80gb", engines=["paged"], kv_memory="3GiB",
                       max_model_len=32768, **run),
    )
    plan = plan_run(suite, None, tmp, "test", force=True)
    r, _ = start_and_run(plan, plan.engines[0][1], None, 1)
    return summarize(r)


def test_a_cpu_tier_serves_hits_the_device_evicted(tmp_path: Path) -> None:
    base = _summary(tmp_path)
    off = _summary(tmp_path, kv_offload="cpu:16GiB")
    assert base["offload_hit_rate"] is None and base["oracle_hit_rate_cpu"] is None
    assert off["offload_hit_rate"] > 0 and off["offload_loaded_bytes"] > 0
    assert off["offload_cpu_hit_rate"] == off["offload_hit_rate"]
    assert off["prefix_hit_rate"] > base["prefix_hit_rate"]
    # PCIe 4.0 x16 on an A100: every load moves at the link's rate.
    assert off["offload_load_gbps"] == pytest.approx(31.5)
    assert off["prefix_hit_rate"] <= off["oracle_hit_rate_cpu"] <= off["unbounded_hit_rate"]
    assert off["oracle_hit_rate"] <= off["oracle_hit_rate_cpu"]
    assert off["hit_rate_vs_oracle_offload"] == pytest.approx(
        off["prefix_hit_rate"] / off["oracle_hit_rate_cpu"])


def test_slower_links_stall_prefills_longer(tmp_path: Path) -> None:
    slow = _summary(tmp_path, kv_offload="cpu:16GiB@2GBps")
    fast = _summary(tmp_path, kv_offload="cpu:16GiB@200GBps")
    assert slow["offload_load_s"] > fast["offload_load_s"] > 0
    assert slow["mean_ttft_ms"] > fast["mean_ttft_ms"]


def test_layerwise_loads_hide_behind_compute() -> None:
    cost = CostModel(get_preset("qwen2.5-7b"), get_gpu("a100-80gb"))
    shape = BatchShape(num_seqs=1, prefill_tokens=512, context_tokens=4096,
                       attn_pairs=causal_pairs(3584, 512))
    step = cost.step_time_s(shape)
    load = step / 2
    assert cost.step_time_s(replace(shape, load_s=load)) == pytest.approx(step + load)
    layered = cost.step_time_s(replace(shape, load_s=load, load_layerwise=True))
    assert layered == pytest.approx(step + load / 28)
    long = cost.step_time_s(replace(shape, load_s=3 * step, load_layerwise=True))
    assert long == pytest.approx(3 * step * (1 + 1 / 28))


def test_offload_records_are_the_same_stepping(tmp_path: Path) -> None:
    jumped = _summary(tmp_path, kv_offload="cpu:2GiB,disk:8GiB:cost")
    stepped = _summary(tmp_path, kv_offload="cpu:2GiB,disk:8GiB:cost", fast_forward=False)
    assert jumped["offload_disk_hit_rate"] is not None
    for name, value in jumped.items():
        if "wall" not in name and "rss" not in name and "overhead" not in name:
            assert stepped[name] == value, name


def test_offload_needs_a_simulated_device(tmp_path: Path) -> None:
    suite = Suite(
        name="offload", workload=WorkloadSection(preset="shared-prefix", num_requests=2),
        run=RunSection(device="cpu", engines=["paged"], kv_offload="cpu:1GiB"),
    )
    with pytest.raises(KvbenchError, match="simulated only"):
        plan_run(suite, None, tmp_path, "test", force=True)
