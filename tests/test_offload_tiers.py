"""KV offload tiers below device memory in the built-in paged engine."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import make_workload
from kvbench.engines.base import BatchShape, causal_pairs
from kvbench.engines.builtin.host_kv import HostKV
from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.offload import TIER_KINDS, OffloadSpec, OffloadTiers
from kvbench.engines.kv.paged import PagedKVManager, PagedPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES, build_engine
from kvbench.engines.sequence import Sequence
from kvbench.engines.sim.costmodel import CostModel
from kvbench.engines.sim.hardware import get_gpu
from kvbench.errors import KvbenchError
from kvbench.results.curves import build_curves
from kvbench.results.metric_table import OFFLOAD_TIER_KINDS
from kvbench.results.metrics import summarize
from kvbench.run.clocks import WallClock
from kvbench.run.devices import parse_device
from kvbench.run.execute import start_and_run
from kvbench.run.harness import run_engine
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


def _manager(tiers: str, num_blocks: int = 12, host: bool = False) -> PagedKVManager:
    spec = OffloadSpec.model_validate(tiers)
    offload = OffloadTiers(spec, BS, BS * 8, None, lambda depth: 1e-3 * (depth + 1),
                           host_in_flight=4096 // BS if host else None)
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
    for tier, keys in zip(offload.tiers, held, strict=True):
        assert len(keys) == len(tier.queue) <= tier.capacity_blocks - tier.pinned
        assert all(k in tier.queue for k in keys)
        assert offload.run(list(keys)[:1]) == min(len(keys), 1)
        assert not keys & device
    for a in range(len(held)):
        for b in range(a + 1, len(held)):
            assert not held[a] & held[b]


class _Contents:
    """What each device block and host slot holds, following the queued copies as an
    executor makes them: a cached block must hold its own key's content."""

    def __init__(self, kv: PagedKVManager) -> None:
        self.kv, self.device, self.host = kv, {}, {}

    def step(self, seq: Sequence, num_cached: int) -> None:
        host = self.kv.offload.host
        for block, slot, to_host in host.take_moves():
            if to_host:
                self.host[slot] = self.device[block]
            else:
                self.device[block] = self.host[slot]
        # The step computes the rest of the prompt.
        table, keys = self.kv._seqs[seq.seq_id].table, self.kv._hashes[seq.seq_id]
        for i in range(num_cached // BS, len(table)):
            self.device[table[i]] = keys[i] if i < len(keys) else None

    def check(self) -> None:
        host = self.kv.offload.host
        assert all(self.device[b] == key for key, b in self.kv.pool._by_hash.items())
        assert all(self.host[slot] == key for key, slot in host.slot.items())
        assert len(set(host.slot.values())) == len(host.slot) <= host.count


@pytest.mark.parametrize("tiers, host", [
    ("cpu:256B", False), ("cpu:128B,disk:320B:lfu", False),
    ("cxl:160B:cost,disk:224B:cost", False),
    ("cpu:256B", True),  # real copies: every block keeps its content
])
def test_blocks_are_conserved_across_tiers(tiers: str, host: bool) -> None:
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    kv = _manager(tiers, host=host)
    contents = _Contents(kv) if host else None
    live: list[Sequence] = []
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
                if contents is not None:
                    contents.step(seq, cached)
                seq.num_computed_tokens = seq.num_tokens
                kv.commit(seq)
                live.append(seq)
        _check_tiers(kv)
        if contents is not None:
            contents.check()
    for seq in live:
        kv.free(seq)
    assert sum(t.loaded_blocks for t in kv.offload.tiers) > 0  # the tiers served hits
    # Real copies are timed by the executor, not priced.
    assert (kv.take_load_s() == 0) == host
    assert kv.pool.num_free == kv.num_blocks  # everything returned after drain
    stats = kv.stats()
    assert stats.offload_used_bytes == sum(len(t.queue) for t in kv.offload.tiers) * BS * 8
    assert stats.offload_hit_tokens == sum(
        t["hit_tokens"] for t in stats.offload_tiers.values())


def _summary(tmp: Path, sections: dict | None = None, **run: Any) -> dict:
    run.setdefault("engines", ["paged"])
    suite = Suite(
        name="offload", workload=WorkloadSection(trace="mooncake", path=str(MOONCAKE),
                                                 num_requests=60),
        model=ModelSection(preset="qwen2.5-7b"), engines=sections or {},
        run=RunSection(device="sim:a100-80gb", kv_memory="3GiB", max_model_len=32768, **run),
    )
    plan = plan_run(suite, None, tmp, "test", force=True)
    r, _ = start_and_run(plan, plan.engines[0][1], None, 1)
    return {**summarize(r), "curves": build_curves(r.steps)}


def test_a_cpu_tier_serves_hits_the_device_evicted(tmp_path: Path) -> None:
    base = _summary(tmp_path)
    off = _summary(tmp_path, kv_offload="cpu:16GiB")
    assert base["offload_hit_rate"] is None and base["oracle_hit_rate_cpu"] is None
    assert off["offload_hit_rate"] > 0 and off["offload_loaded_bytes"] > 0
    assert off["offload_cpu_hit_rate"] == off["offload_hit_rate"]
    assert off["offload_cpu_loaded_bytes"] == off["offload_loaded_bytes"]
    assert off["offload_cpu_stored_bytes"] == off["offload_stored_bytes"] > 0
    assert off["offload_disk_stored_bytes"] is None
    assert off["prefix_hit_rate"] > base["prefix_hit_rate"]
    # PCIe 4.0 x16 on an A100: every load moves at the link's rate.
    assert off["offload_load_gbps"] == pytest.approx(31.5)
    assert off["prefix_hit_rate"] <= off["oracle_hit_rate_cpu"] <= off["unbounded_hit_rate"]
    assert off["oracle_hit_rate"] <= off["oracle_hit_rate_cpu"]
    assert off["hit_rate_vs_oracle_offload"] == pytest.approx(
        off["prefix_hit_rate"] / off["oracle_hit_rate_cpu"])
    # Recomputing a block of Qwen2.5-7B on an A100 takes longer than moving its 896 KiB.
    assert off["offload_prefill_saved_s"] > 0
    assert base["offload_prefill_saved_s"] is None


def test_a_load_saves_the_recompute_of_its_depth_less_the_move() -> None:
    tiers = OffloadTiers(OffloadSpec(tiers="cpu:1KiB@1GBps"), BS, 32, None,
                         lambda depth: 1e-3 * (depth + 1))
    tiers.store([0, 1], [10, 11], [0, 0])
    assert tiers.load([10, 11], first_depth=3) == [0, 0]
    move = 32 / 1e9
    assert tiers.take_load_s() == pytest.approx(2 * move)
    assert tiers.stats()["cpu"]["saved_s"] == pytest.approx(4e-3 + 5e-3 - 2 * move)


def test_slower_links_stall_prefills_longer(tmp_path: Path) -> None:
    slow = _summary(tmp_path, kv_offload="cpu:16GiB@2GBps")
    fast = _summary(tmp_path, kv_offload="cpu:16GiB@200GBps")
    assert slow["offload_load_s"] > fast["offload_load_s"] > 0
    assert slow["mean_ttft_ms"] > fast["mean_ttft_ms"]


def test_layerwise_loads_stall_steps_less_than_they_take(tmp_path: Path) -> None:
    stalled = _summary(tmp_path, kv_offload="cpu:16GiB")
    assert stalled["offload_stall_s"] == pytest.approx(stalled["offload_load_s"])
    layered = _summary(tmp_path, engines=["layered"], sections={"layered": PagedPolicy(
        offload=OffloadSpec(tiers="cpu:16GiB", overlap="layerwise"))})
    assert 0 < layered["offload_stall_s"] < layered["offload_load_s"]
    assert _summary(tmp_path)["offload_stall_s"] is None


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
    curves = jumped.pop("curves")
    assert stepped.pop("curves") == curves
    for name, value in jumped.items():
        if "wall" not in name and "rss" not in name and "overhead" not in name:
            assert stepped[name] == value, name
    # Tier occupancy over time: within each tier's size, and what it holds at the end.
    for kind, size in (("cpu", 2 << 30), ("disk", 8 << 30)):
        held = curves[f"offload_{kind}_used_bytes"]
        assert 0 < max(held) <= size
    assert sum(curves[f"offload_{k}_used_bytes"][-1] for k in ("cpu", "disk")) == \
        jumped["offload_used_bytes"]


def test_swap_preemption_copies_preempted_kv_out_and_back(tmp_path: Path) -> None:
    recompute = _summary(tmp_path, kv_offload="cpu:16GiB")
    swap = _summary(tmp_path, kv_offload="cpu:16GiB", kv_preemption="swap")
    assert recompute["preemptions"] > 0 and recompute["offload_swapped_out_bytes"] == 0
    out, back = swap["offload_swapped_out_bytes"], swap["offload_swapped_in_bytes"]
    # Leading blocks still cached on the device when a sequence resumes are not copied.
    assert 0 < back < out
    assert swap["offload_cpu_stored_bytes"] - out == pytest.approx(
        recompute["offload_cpu_stored_bytes"], rel=0.01)
    # Both copies stall the step at the link's rate (PCIe 4.0 x16 on an A100); the loads'
    # seconds include the copies back.
    assert swap["offload_stall_s"] == pytest.approx(swap["offload_load_s"] + out / 31.5e9)
    assert swap["offload_load_s"] > recompute["offload_load_s"]
    stepped = _summary(tmp_path, kv_offload="cpu:16GiB", kv_preemption="swap",
                       fast_forward=False)
    assert stepped.pop("curves") == swap.pop("curves")
    for name, value in swap.items():
        if "wall" not in name and "rss" not in name and "overhead" not in name:
            assert stepped[name] == value, name


def test_swap_preemption_needs_a_tier(tmp_path: Path) -> None:
    with pytest.raises(KvbenchError, match=r"--kv-offload cpu:SIZE"):
        _summary(tmp_path, kv_preemption="swap")
    suite = Suite(name="swap", workload=WorkloadSection(preset="shared-prefix", num_requests=2),
                  run=RunSection(device="sim:a100-80gb", engines=["paged", "contiguous"],
                                 kv_offload="cpu:1GiB", kv_preemption="swap"))
    plan = plan_run(suite, None, tmp_path, "test", force=True)
    assert any("--kv-preemption swap: engine contiguous" in w for w in plan.warnings)


def test_real_compute_offloads_to_one_cpu_tier(tmp_path: Path) -> None:
    suite = Suite(
        name="offload", workload=WorkloadSection(preset="shared-prefix", num_requests=2),
        run=RunSection(device="cpu", engines=["paged"], kv_offload="cpu:1MiB,disk:1GiB"),
    )
    with pytest.raises(KvbenchError, match="one cpu tier in host memory"):
        plan_run(suite, None, tmp_path, "test", force=True)
    suite = suite.model_copy(update={
        "run": RunSection(device="cpu", engines=["layered"]),
        "engines": {"layered": PagedPolicy(offload=OffloadSpec(tiers="cpu:1MiB",
                                                                overlap="layerwise"))}})
    with pytest.raises(KvbenchError, match="simulated devices only"):
        plan_run(suite, None, tmp_path, "test", force=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CPU variant runs instead"))]


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_comes_back_from_host_memory_bit_identical(device: str) -> None:
    preset = get_preset("tiny")
    tiers = OffloadTiers(OffloadSpec(tiers="cpu:1MiB"), 16, 16 * preset.kv_bytes_per_token,
                         None, lambda depth: 1.0, host_in_flight=4)
    pool = torch.randn((preset.num_layers, 2, 8 * 16, preset.num_kv_heads, preset.head_dim),
                       device=device)
    host = HostKV(pool, tiers)
    block2 = pool[:, :, 32:48].clone()
    tiers.store([2], [7], [0])
    host.apply(pool)
    pool[:, :, 32:48] = 0  # the device block is written again
    tiers.load([7])
    tiers.host.place([5])
    host.apply(pool)
    assert torch.equal(pool[:, :, 80:96], block2)
    assert host.buffer.is_pinned() == (device == "cuda")
    stats = tiers.stats()["cpu"]
    assert stats["load_s"] > 0 and stats["store_s"] > 0 and stats["loaded_bytes"] == 16 * 2048


def _real_run(offload: str | None, prefix: bool = True, device: str = "cpu") -> dict:
    """The tiny model for real, one request at a time in a pool of 40 blocks: the shared
    prefix's blocks are evicted by the two long prompts between its two uses."""
    preset = get_preset("tiny")
    shared = Segment("text", 128, "shared/system")
    requests = [
        Request("r0", 0.0, (shared, Segment("text", 20, "user/0")), 6),
        Request("r1", 0.0, (Segment("text", 300, "long/1"),), 4),
        Request("r2", 0.0, (Segment("text", 300, "long/2"),), 4),
        Request("r3", 0.0, (shared, Segment("text", 30, "user/3")), 6),
    ]
    settings = EngineSettings(
        preset=preset, device=parse_device(device), kv_bytes=640 * preset.kv_bytes_per_token,
        block_size=16, prefix_caching=prefix,
        scheduler=SchedulerConfig(max_model_len=1024, max_num_seqs=1,
                                  max_num_batched_tokens=512),
        offload=OffloadSpec.model_validate(offload) if offload else None)
    engine = build_engine(engine_config("paged", NAMED_ENGINES["paged"], settings))
    run = run_engine(engine, make_workload(requests), WallClock())
    assert run.status == "ok", run.error
    return {"tokens": {rid: t.output_digest for rid, t in run.timings.items()},
            **summarize(run)}


@pytest.mark.parametrize("device", DEVICES)
def test_real_offload_reads_back_the_same_kv(device: str) -> None:
    plain, cold = _real_run(None, False, device), _real_run(None, True, device)
    warm = _real_run("cpu:1MiB", True, device)
    assert cold["offload_hit_rate"] is None
    # Without the tier the evicted part of the prefix is recomputed; with it, those blocks
    # come back from host memory, and every token is the same.
    assert warm["offload_cpu_hit_rate"] > 0 and warm["prefix_hit_rate"] > cold["prefix_hit_rate"]
    block_bytes = 16 * get_preset("tiny").kv_bytes_per_token
    assert warm["offload_loaded_bytes"] > 0 and warm["offload_loaded_bytes"] % block_bytes == 0
    assert warm["offload_load_gbps"] > 0 and warm["offload_store_gbps"] > 0  # measured copies
    assert warm["tokens"] == cold["tokens"] == plain["tokens"]


def _check_swaps(kv: PagedKVManager) -> None:
    """Swapped blocks are held in the first tier beside its keys, within its size, and
    real ones each in a slot of their own."""
    offload = kv.offload
    tier = offload.tiers[0]
    assert tier.pinned == sum(offload._swapped.values())
    assert len(tier) == len(tier.queue) + tier.pinned <= tier.capacity_blocks
    if offload.host is not None:
        held = offload.host.swapped
        assert {k: len(s) for k, s in held.items()} == offload._swapped
        slots = [*offload.host.slot.values(), *(s for n in held.values() for s in n)]
        assert len(set(slots)) == len(slots) <= offload.host.count


@pytest.mark.parametrize("tiers, host", [
    ("cpu:384B", False), ("cpu:192B,disk:320B:lfu", False), ("cpu:384B", True),
])
def test_swapped_sequences_come_back_whole(tiers: str, host: bool) -> None:
    rng = random.Random(11)
    prefixes = [[rng.randrange(1000) for _ in range(48)] for _ in range(3)]
    spec = OffloadSpec.model_validate(tiers)
    offload = OffloadTiers(spec, BS, BS * 8, None, lambda depth: 1e-3,
                           host_in_flight=4096 // BS if host else None)
    kv = PagedKVManager(16, BS, 8, 4096, offload=offload, swap=True)
    contents = _Contents(kv) if host else None
    live: list[Sequence] = []
    swapped: dict[int, tuple[Sequence, list[object]]] = {}
    out = fallbacks = 0
    for i in range(600):
        op = rng.random()
        if live and op < 0.3:  # preempted: swapped out, or freed where the tier is full
            seq = live.pop(rng.randrange(len(live)))
            before = [contents.device[b] for b in kv._seqs[seq.seq_id].table] if contents \
                else []
            if kv.swap_out(seq):
                out += 1
                swapped[seq.seq_id] = (seq, before)
            else:
                fallbacks += 1
                kv.free(seq)
        elif swapped and op < 0.6:  # resumed where it stopped, nothing recomputed
            seq, before = swapped[rng.choice(list(swapped))]
            cached = kv.lookup_prefix(seq)
            assert cached == seq.num_computed_tokens == seq.num_tokens
            if kv.allocate(seq, cached, 0):
                del swapped[seq.seq_id]
                live.append(seq)
                if contents is not None:
                    table = kv._seqs[seq.seq_id].table
                    contents.step(seq, len(table) * BS)  # copies only: nothing to compute
                    assert [contents.device[b] for b in table] == before
        elif live and op < 0.75:
            seq = live.pop(rng.randrange(len(live)))
            seq.output_ids = [0] * seq.request.output_tokens  # finished
            kv.free(seq)
        elif len(live) < 4:
            seq = _seq(rng, i, prefixes)
            cached = kv.lookup_prefix(seq)
            if kv.allocate(seq, cached, seq.num_tokens - cached):
                if contents is not None:
                    contents.step(seq, cached)
                    # The unhashed tail block: content only its sequence knows.
                    table = kv._seqs[seq.seq_id].table
                    if seq.num_tokens % BS:
                        contents.device[table[-1]] = ("tail", seq.seq_id)
                seq.num_computed_tokens = seq.num_tokens
                kv.commit(seq)
                live.append(seq)
        _check_tiers(kv)
        _check_swaps(kv)
        if contents is not None:
            contents.check()
    for seq, _ in swapped.values():  # drain: the rest come back, then everyone finishes
        assert kv.allocate(seq, kv.lookup_prefix(seq), 0)
        live.append(seq)
    for seq in live:
        kv.free(seq)
    tier = kv.offload.tiers[0]
    assert out > 20 and fallbacks > 0 and tier.swapped_in_blocks > 0
    assert tier.pinned == 0 and not kv.offload._swapped
    assert kv.pool.num_free == kv.num_blocks
    if host:
        assert len(kv.offload.host._free) == kv.offload.host.count - len(kv.offload.host.slot)
