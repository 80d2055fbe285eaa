"""vAttention: page-group invariants under random operations, tokens per page from the model
shape, synchronous vs background mapping, deferred reclamation, hints, forks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import KVDriver, make_seq, random_operations

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.vattention import VAttentionKVManager, VAttentionPolicy
from kvbench.engines.model.presets import get_preset
from kvbench.errors import KvbenchError
from kvbench.run.devices import parse_device

BPT = 8  # bytes per token
T = 4  # tokens per page group
OPS = 6  # physical pages per group: 2 x 3 layers


def vattn(num_groups: int = 16, **kw) -> VAttentionKVManager:
    return VAttentionKVManager(num_groups, T, BPT, max_model_len=1 << 20, ops_per_group=OPS,
                               **kw)


def ranges(kv: VAttentionKVManager) -> list:
    return [*kv._ranges.values(), *(r for rs in kv._spare.values() for r in rs),
            *kv._hinted.values(), *kv._idle.values()]


def check_invariants(kv: VAttentionKVManager, driver: KVDriver) -> None:
    held = [g for r in ranges(kv) for g in r.groups]
    assert sorted(held + kv._free) == list(range(kv.num_groups))  # each group once
    assert kv._mapped == len(held)
    live = list(kv._ranges.values())
    assert all(r.need <= len(r.groups) for r in live)
    assert kv._ahead == sum(len(r.groups) - r.need for r in live)
    assert kv._idle_groups == sum(len(r.groups) for r in kv._idle.values())
    assert kv._hint_groups == sum(len(r.groups) for r in kv._hinted.values())
    for seq in driver.running:
        assert kv._ranges[seq.seq_id].num_committed == seq.num_computed_tokens
    s = kv.stats()
    group_bytes = T * BPT
    assert s.free_bytes + s.reserved_bytes == s.capacity_bytes == kv.num_groups * group_bytes
    assert s.used_bytes == sum(q.num_computed_tokens for q in driver.running) * BPT
    assert 0 <= s.reserved_ahead_bytes <= s.reserved_bytes - s.used_bytes
    assert s.map_ops - s.unmap_ops == kv._mapped * OPS == s.page_table_entries
    driver.check_contents()


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_groups=st.integers(2, 24),
    prewarm_pages=st.sampled_from([0, 0, 3]),
    hint=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_invariants(data, num_groups, prewarm_pages, hint, seed):
    kv = vattn(num_groups, prewarm_pages=prewarm_pages, prewarm="hint" if hint else "none")
    d = KVDriver(kv, seed)
    random_operations(data, d, check_invariants, prompt_max=20, output_max=10, chunk_max=16,
                      step_max=8, background=True)
    s = kv.stats()
    assert s.used_bytes == s.reserved_ahead_bytes == 0
    if not prewarm_pages:  # nothing stays mapped
        assert s.free_bytes == s.capacity_bytes and s.map_ops == s.unmap_ops


def test_tokens_per_page_follow_the_model_shape():
    def tokens(model: str, page_bytes: int = 2 << 20, device: str = "sim:a100-80gb") -> int:
        preset = get_preset(model)
        settings = EngineSettings(
            preset=preset, device=parse_device(device), kv_bytes=8 << 30, block_size=16,
            prefix_caching=False, scheduler=SchedulerConfig(max_model_len=4096),
        )
        return engine_config("v", VAttentionPolicy(page_bytes=page_bytes), settings).kv.page_tokens

    assert tokens("llama-3-8b") == 1024  # 8 KV heads x 128 x 2 B = 2 KiB a token per tensor
    assert tokens("qwen2.5-7b") == 2048  # 4 KV heads
    assert tokens("llama-2-7b") == 256  # 32 KV heads
    assert tokens("llama-3-8b", 64 << 10) == 32
    assert tokens("llama-3-8b", device="sim:a100-80gbx2") == 2048  # 4 KV heads a rank
    with pytest.raises(ValueError):
        VAttentionPolicy(page_bytes=1 << 20)


def test_synchronous_mapping_is_charged_to_the_step_and_unmapped_on_free():
    kv = vattn()
    d = KVDriver(kv)
    seq = make_seq(1, 9, 4)  # 9 tokens: 3 groups
    assert d.admit(seq, 9)
    assert kv.take_map_ops() == 3 * OPS and kv.take_map_ops() == 0
    assert d.step(seq, 1)  # the 10th token fits the third group
    assert kv.take_map_ops() == 0
    s = kv.stats()
    assert s.reserved_bytes == 3 * T * BPT and s.page_table_entries == 3 * OPS
    d.free(seq)
    assert kv.take_map_ops() == 3 * OPS and kv.stats().unmap_ops == 3 * OPS


def test_prewarm_maps_ahead_in_the_background_and_keeps_finished_ranges_mapped():
    kv = vattn(prewarm_pages=2)
    d = KVDriver(kv)
    seq = make_seq(1, 3, 6)  # grows past its first group
    assert d.admit(seq, 3)
    kv.take_map_ops()
    kv.background()  # maps its next group ahead, and one more into a parked range
    assert kv.stats().map_ops == 3 * OPS and kv.take_map_ops() == 0
    for _ in range(5):  # the page boundary is crossed into a pre-mapped group; it finishes
        assert d.step(seq, 1)
    assert not d.running
    assert kv.take_map_ops() == 0 and kv.stats().unmap_ops == 0  # kept mapped (deferred)
    again = make_seq(2, 7, 1)
    assert d.admit(again, 7)
    assert kv.take_map_ops() == 0  # a finished range's groups serve the next sequence
    d.check_contents()


def test_reclaiming_idle_ranges_on_demand_is_synchronous():
    kv = vattn(num_groups=4, prewarm_pages=4)
    d = KVDriver(kv)
    a = make_seq(1, 15, 1)  # 4 groups
    assert d.admit(a, 15)  # finishes at once: its range stays mapped, idle
    kv.take_map_ops()
    b = make_seq(2, 3, 9)
    assert d.admit(b, 3)  # reuses the idle range (it covers the need)
    assert kv.take_map_ops() == 0
    kv.background()  # b's 3 groups mapped ahead are within the 4 to keep ready
    assert kv.stats().unmap_ops == 0
    c = make_seq(3, 3, 2)  # every group is b's: one of those ahead is unmapped and mapped
    assert d.admit(c, 3)
    assert kv.take_map_ops() == 2 * OPS and len(kv.mapped_groups(b)) == 3
    d.check_contents()


def test_hint_maps_the_hinted_pages_at_arrival_off_the_critical_path():
    kv = vattn(num_groups=256, prewarm="hint")
    seq = make_seq(1, 500, 20)  # hint: ceil(0.4 x 500 / 512) = 1 page of 512 tokens
    kv.arrive(seq)
    assert kv.stats().reserved_bytes == 128 * T * BPT and kv.take_map_ops() == 0
    assert kv.stats().reserved_ahead_bytes == 128 * T * BPT
    d = KVDriver(kv)
    assert d.admit(seq, 500)
    assert kv.take_map_ops() == 0  # 125 groups needed, all mapped at arrival
    d.check_contents()


def test_fork_copies_the_prompt_into_a_range_reserved_at_admission():
    kv = vattn()
    d = KVDriver(kv)
    parent = make_seq(1, 6, 3, n=2)
    assert d.admit(parent, 100)  # 2 groups each for parent and child, mapped together
    child = next(s for s in d.running if s is not parent)
    assert kv.mapped_groups(child) != kv.mapped_groups(parent)
    assert kv.stats().copied_bytes == 6 * BPT
    assert d.step(child, 1) and d.step(parent, 1)
    d.check_contents()


def test_resolution_refuses_a_page_that_holds_no_whole_tokens():
    preset = get_preset("tiny")  # 2 KV heads x 32 x 4 B = 256 B a token per tensor
    settings = EngineSettings(
        preset=preset, device=parse_device("cpu"), kv_bytes=1 << 24, block_size=16,
        prefix_caching=False, scheduler=SchedulerConfig(max_model_len=1024),
    )
    assert engine_config("v", VAttentionPolicy(page_bytes=64 << 10), settings).kv.page_tokens == 256
    with pytest.raises(KvbenchError, match="holds no"):  # 2 MiB x 8 tensors > 1 MiB
        engine_config("v", VAttentionPolicy(), replace(settings, kv_bytes=1 << 20))


def test_would_admit_says_what_allocate_does():
    """The decode fast-forward trusts a refusal it is told of ahead; it must be allocate's."""
    kv = vattn(num_groups=6, prewarm_pages=2)
    d = KVDriver(kv)
    a, b = make_seq(1, 7, 9), make_seq(2, 7, 9)
    assert d.admit(a, 7) and d.admit(b, 7)
    d.free(b)  # its 2 groups stay mapped in an idle range; 2 groups are free
    asked = [(make_seq(3, 5, 3), 5), (make_seq(4, 23, 1), 23), (make_seq(5, 3, 2, n=3), 3)]
    said = {}
    for seq, num_new in asked:
        said[seq.seq_id] = kv.would_admit(seq, 0, num_new)
        assert said[seq.seq_id] == kv.allocate(seq, 0, num_new)
        kv.free(seq)
    assert said == {3: True, 4: False, 5: True}


def test_decode_room_ends_where_a_group_must_be_mapped():
    kv = vattn()
    d = KVDriver(kv)
    a, b = make_seq(1, 6, 20), make_seq(2, 3, 20)  # 2 groups and 1 group mapped
    assert d.admit(a, 6) and d.admit(b, 3)
    assert kv.decode_room([a, b], 100) == 0  # the step still owes the admissions' map calls
    kv.take_map_ops()
    assert kv.decode_room([a, b], 100) == 1  # b's next token but one needs a second group
    assert kv.decode_room([a], 100) == 2
