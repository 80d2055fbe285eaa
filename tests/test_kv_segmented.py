"""Segmented layout: arena invariants under random operations, contiguous heads, paged
tails, external fragmentation of heads, forks."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import KVDriver, make_seq, random_operations

from kvbench.engines.kv.segmented import SegmentedKVManager
from kvbench.errors import KvbenchError

BPT = 8  # bytes per token
BS = 2  # tokens per block


def segmented(num_blocks: int = 32, head_tokens: int = 8) -> SegmentedKVManager:
    return SegmentedKVManager(num_blocks, BS, BPT, max_model_len=1 << 20,
                              head_tokens=head_tokens)


def check_invariants(kv: SegmentedKVManager, driver: KVDriver) -> None:
    heads = [kv.head(s) for s in driver.running]
    heads += [(sp.head, sp.head_blocks) for spares in kv._spare.values() for sp in spares]
    tails: Counter[int] = Counter()
    for seq in driver.running:
        tails.update(kv.block_table(seq)[kv.head(seq)[1]:])
    assert dict(tails) == kv._ref and all(r > 0 for r in kv._ref.values())
    assert kv._shared == sum(1 for r in kv._ref.values() if r > 1)
    owner = [0] * kv.num_blocks
    for start, n in [*heads, *kv.arena.holes]:
        for b in range(start, start + n):
            owner[b] += 1
    for b in tails:
        owner[b] += 1
    assert owner == [1] * kv.num_blocks  # heads, tail blocks and holes tile the arena
    s = kv.stats()
    block_bytes = BS * BPT
    assert s.free_bytes + s.reserved_bytes == s.capacity_bytes == kv.num_blocks * block_bytes
    assert s.free_bytes == sum(n for _, n in kv.arena.holes) * block_bytes
    assert s.largest_free_bytes == max((n for _, n in kv.arena.holes), default=0) * block_bytes
    fill: dict[int, int] = {}
    for seq in driver.running:
        n = seq.num_computed_tokens
        for i, b in enumerate(kv.block_table(seq)):
            f = min(max(n - i * BS, 0), BS)
            assert fill.setdefault(b, f) == f  # sharers of a tail block hold the same KV
    assert s.used_bytes == sum(fill.values()) * BPT
    assert s.page_table_entries == len(heads) + sum(tails.values())
    assert 0 <= s.reserved_ahead_bytes <= s.reserved_bytes - s.used_bytes
    driver.check_contents()


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(4, 48),
    head_blocks=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_invariants(data, num_blocks, head_blocks, seed):
    kv = segmented(num_blocks, head_blocks * BS)
    d = KVDriver(kv, seed)
    random_operations(data, d, check_invariants, prompt_max=24, output_max=10, chunk_max=16,
                      step_max=8, admit_any=True)
    s = kv.stats()
    assert s.free_bytes == s.largest_free_bytes == s.capacity_bytes and s.used_bytes == 0
    assert kv.arena.holes == [(0, num_blocks)]


def test_head_is_one_run_at_the_low_end_and_the_tail_grows_from_the_high_end():
    kv = segmented(32, head_tokens=8)
    d = KVDriver(kv)
    seq = make_seq(1, 9, 4)  # 13 tokens: a 4-block head, then tail blocks
    assert d.admit(seq, 9)
    assert kv.head(seq) == (0, 4)
    assert kv.block_table(seq) == [0, 1, 2, 3, 31]
    assert d.step(seq, 1) and d.step(seq, 1)
    assert kv.block_table(seq) == [0, 1, 2, 3, 31, 30]
    assert kv.stats().page_table_entries == 3  # one head descriptor, two tail blocks
    d.check_contents()


def test_short_requests_reserve_only_what_they_will_hold():
    kv = segmented(32, head_tokens=8)
    d = KVDriver(kv)
    seq = make_seq(1, 3, 2)  # 5 tokens: a head of 3 blocks, never a tail
    assert d.admit(seq, 3)
    assert kv.head(seq) == (0, 3)
    s = kv.stats()
    assert s.reserved_bytes == 3 * BS * BPT
    # 3 prompt slots written, 1 more will be (the last sampled token gets no KV), 2 never.
    assert s.reserved_ahead_bytes == 1 * BPT and s.used_bytes == 3 * BPT


def test_scattered_tail_blocks_keep_a_head_out_although_enough_blocks_are_free():
    kv = segmented(12, head_tokens=8)  # heads of up to 4 blocks
    d = KVDriver(kv)
    a, b = make_seq(1, 7, 9), make_seq(2, 7, 9)
    assert d.admit(a, 8) and d.admit(b, 8)  # heads [0, 4) and [4, 8)
    for _ in range(4):  # one token each per step: their tail blocks interleave 11, 10, 9, 8
        assert d.step(a, 1) and d.step(b, 1)
    assert kv.block_table(a)[4:] == [11, 9] and kv.block_table(b)[4:] == [10, 8]
    d.free(a)
    s = kv.stats()
    assert s.free_bytes == 6 * BS * BPT and s.largest_free_bytes == 4 * BS * BPT
    assert d.admit(make_seq(3, 5, 3), 5)  # a 4-block head: the hole at 0
    wide = make_seq(4, 3, 1)  # a 2-block head; blocks 9 and 11 are free, not adjacent
    assert kv.stats().free_bytes == 2 * BS * BPT
    assert not kv.allocate(wide, 0, 1)
    d.check_contents()


def test_fork_copies_the_head_and_shares_the_tail():
    kv = segmented(32, head_tokens=4)
    d = KVDriver(kv)
    parent = make_seq(1, 7, 3, n=2)  # heads of 2 blocks for both samples, reserved together
    assert kv.stats().reserved_bytes == 0
    assert d.admit(parent, 100)
    child = next(s for s in d.running if s is not parent)
    assert kv.head(child) != kv.head(parent)
    assert kv.block_table(child)[2:] == kv.block_table(parent)[2:]  # 7 tokens: 2 tail blocks
    s = kv.stats()
    assert s.copied_bytes == 4 * BPT and s.shared_bytes == 2 * BS * BPT
    assert d.step(child, 1)  # writes into the shared partial tail block: copied first
    assert kv.stats().copied_bytes == 4 * BPT + 1 * BPT
    d.check_contents()


def test_head_must_be_whole_blocks():
    with pytest.raises(KvbenchError, match="multiple"):
        SegmentedKVManager(8, 16, BPT, 1024, head_tokens=100)


def test_would_admit_says_what_allocate_does():
    """The decode fast-forward trusts a refusal it is told of ahead; it must be allocate's."""
    kv = segmented(12, head_tokens=8)
    d = KVDriver(kv)
    a, b = make_seq(1, 7, 9), make_seq(2, 7, 9)
    assert d.admit(a, 8) and d.admit(b, 8)
    for _ in range(4):
        assert d.step(a, 1) and d.step(b, 1)
    asked = [(make_seq(3, 5, 3), 5), (make_seq(4, 7, 9), 8), (make_seq(5, 3, 2, n=2), 3)]
    said = {}
    for freed in (False, True):
        if freed:
            d.free(a)  # 6 blocks free: a 4-block hole and two single tail blocks
        for seq, num_new in asked:
            said[seq.seq_id, freed] = kv.would_admit(seq, 0, num_new)
            assert said[seq.seq_id, freed] == kv.allocate(seq, 0, num_new)
            kv.free(seq)
    assert said == {(3, False): False, (4, False): False, (5, False): False,
                    (3, True): True, (4, True): True, (5, True): False}
