"""Paged KV manager: block pool invariants under random operations, prefix cache, CoW, leaks."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import KVDriver, make_seq

from kvbench.engines.kv.hashing import ROOT_HASH, BlockHasher
from kvbench.engines.kv.paged import PagedKVManager
from kvbench.workloads.model import Request, Segment

BPT = 8  # bytes per token


def paged(num_blocks: int = 16, block_size: int = 4, **kw) -> PagedKVManager:
    return PagedKVManager(num_blocks, block_size, BPT, max_model_len=1 << 20, **kw)


class WindowDriver(KVDriver):
    """A driver for a manager releasing blocks outside a sliding window."""

    def held_from(self, seq) -> int:
        return (len(self.kv.block_table(seq)) - len(self.kv.held_blocks(seq))) * self.kv.block_size


def check_invariants(kv: PagedKVManager, driver: KVDriver) -> None:
    pool, bs = kv.pool, kv.block_size
    refs: Counter[int] = Counter()
    fill: dict[int, int] = {}
    for seq in driver.running:
        table = kv.held_blocks(seq)
        released = len(kv.block_table(seq)) - len(table)
        refs.update(table)
        n = seq.num_computed_tokens - released * bs
        if kv.sliding_window is not None:  # nothing a future query can see was released
            assert released * bs <= max(seq.num_computed_tokens - kv.sliding_window + 1, 0)
        for i, b in enumerate(table):
            f = min(bs, max(n - i * bs, 0))
            # Sharers of a block agree on how much of it holds KV (it is the same KV).
            assert fill.setdefault(b, f) == f
    assert all(r >= 0 for r in pool.ref)
    assert {b: r for b, r in enumerate(pool.ref) if r} == dict(refs)
    free_plain, free_cached = pool._free_plain, list(pool._free_cached)
    free = free_plain + free_cached
    assert len(set(free)) == len(free) == pool.num_free
    assert set(free).isdisjoint(refs)
    assert pool.num_free + len(refs) == kv.num_blocks
    assert all(pool._hash[b] is None for b in free_plain)
    assert all(pool._hash[b] is not None for b in free_cached)
    for h, b in pool._by_hash.items():
        assert pool._hash[b] == h
    s = kv.stats()
    block_bytes = bs * BPT
    assert s.free_bytes + s.reserved_bytes == s.capacity_bytes == kv.num_blocks * block_bytes
    assert 0 <= s.used_bytes <= s.reserved_bytes <= s.capacity_bytes
    assert s.used_bytes == sum(fill.values()) * BPT
    assert s.block_allocs - s.block_frees == s.reserved_bytes // block_bytes
    assert s.shared_bytes >= sum(1 for r in refs.values() if r > 1) * block_bytes
    assert s.largest_free_bytes == s.free_bytes
    assert s.page_table_entries == sum(len(kv.held_blocks(seq)) for seq in driver.running)
    assert 0 <= s.reserved_ahead_bytes <= s.reserved_bytes - s.used_bytes
    if s.prefix_hit_tokens is not None:
        assert 0 <= s.prefix_hit_tokens <= s.prefix_query_tokens
    driver.check_contents()


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_blocks=st.integers(3, 16),
    block_size=st.sampled_from([1, 2, 4, 16]),
    caching=st.booleans(),
    eviction=st.sampled_from(["lru", "lfu"]),
    window=st.sampled_from([None, None, 3, 9]),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_invariants(
    data, num_blocks, block_size, caching, eviction, window, seed
):
    kv = paged(num_blocks, block_size, enable_prefix_caching=caching, eviction=eviction,
               sliding_window=window)
    d = WindowDriver(kv, seed)
    waiting = []
    for i in range(data.draw(st.integers(1, 60), label="ops")):
        op = data.draw(st.sampled_from(["new", "admit", "step", "step", "step", "preempt"]))
        if op == "new":
            prefix = data.draw(
                st.none() | st.tuples(st.sampled_from("abc"), st.integers(1, 3 * block_size))
            )
            waiting.append(
                make_seq(
                    i,
                    data.draw(st.integers(0 if prefix else 1, 2 * block_size + 3)),
                    data.draw(st.integers(1, 6)),
                    prefix=prefix,
                    n=data.draw(st.integers(1, 3)),
                )
            )
        elif op == "admit" and waiting:
            seq = waiting[0]
            if kv.never_fits(seq.request) is None:
                if d.admit(seq, data.draw(st.integers(1, 3 * block_size))):
                    waiting.pop(0)
            else:
                waiting.pop(0)
        elif op == "step" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            if not d.step(seq, data.draw(st.integers(1, 2 * block_size))):
                victim = d.running[-1]  # as the scheduler would: the newest one
                d.preempt(victim)
                waiting.append(victim)
        elif op == "preempt" and d.running:
            seq = data.draw(st.sampled_from(d.running))
            d.preempt(seq)
            waiting.append(seq)
        check_invariants(kv, d)
    for seq in list(d.running):
        d.free(seq)
    check_invariants(kv, d)
    s = kv.stats()
    assert s.free_bytes == s.capacity_bytes and s.used_bytes == 0 and s.shared_bytes == 0
    assert kv.pool.num_free == kv.num_blocks


def test_prefix_hit_for_two_sequences_with_the_same_first_blocks():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    a = make_seq(1, 3, 2, prefix=("sys", 8))
    b = make_seq(2, 5, 2, prefix=("sys", 8))
    assert kv.lookup_prefix(a) == 0
    assert d.admit(a, 100)
    assert kv.lookup_prefix(b) == 8
    assert d.admit(b, 100)
    assert kv.block_table(b)[:2] == kv.block_table(a)[:2]
    assert kv.block_table(b)[2] != kv.block_table(a)[2]
    s = kv.stats()
    assert (s.prefix_hit_tokens, s.prefix_query_tokens) == (8, 11 + 13)
    assert s.shared_bytes == 2 * 4 * BPT
    d.check_contents()


def test_reserved_ahead_counts_slots_still_to_be_written():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    seq = make_seq(1, 6, 4)  # writes KV for 6 + 4 - 1 = 9 positions in all
    assert d.admit(seq, 100)  # 2 blocks, 6 slots written
    assert kv.stats().reserved_ahead_bytes == 2 * BPT
    assert d.step(seq, 1) and d.step(seq, 1)  # 8 written, blocks full
    assert kv.stats().reserved_ahead_bytes == 0
    assert kv.grow(seq, 1)  # a third block: 1 slot still to write, 3 never
    s = kv.stats()
    assert s.reserved_ahead_bytes == 1 * BPT and s.reserved_bytes - s.used_bytes == 4 * BPT


def test_lookup_leaves_one_token_to_compute():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    assert d.admit(make_seq(1, 0, 3, prefix=("p", 8)), 100)
    again = make_seq(2, 0, 3, prefix=("p", 8))
    assert kv.lookup_prefix(again) == 4  # 8 cached, but the last token's logits are needed


def test_cached_blocks_survive_free_and_are_evicted_lru():
    kv = paged(num_blocks=6, block_size=4)
    d = KVDriver(kv)
    old, new = make_seq(1, 0, 1, prefix=("old", 8)), make_seq(2, 0, 1, prefix=("new", 8))
    assert d.admit(old, 100) and d.admit(new, 100)  # output 1: both finish and are freed
    assert kv.stats().free_bytes == kv.stats().capacity_bytes
    assert kv.lookup_prefix(make_seq(3, 1, 1, prefix=("old", 8))) == 8
    # Three fresh blocks: the two plain ones, then the least recently freed cached block,
    # which is the tail of the sequence freed first.
    assert kv.stats().evictions == 0
    assert d.admit(make_seq(4, 9, 1), 100)
    assert kv.stats().evictions == 1
    assert kv.lookup_prefix(make_seq(5, 1, 1, prefix=("old", 8))) == 4
    assert kv.lookup_prefix(make_seq(6, 1, 1, prefix=("new", 8))) == 8


def test_lfu_evicts_the_least_hit_block_first_and_breaks_ties_by_recency():
    kv = paged(num_blocks=6, block_size=4, eviction="lfu")
    d = KVDriver(kv)
    popular, rare = make_seq(1, 0, 1, prefix=("popular", 4)), make_seq(2, 0, 1, prefix=("rare", 4))
    assert d.admit(popular, 100) and d.admit(rare, 100)  # one cached block each, freed
    for i in range(3):  # the popular block serves three hits, freed again each time
        assert d.admit(make_seq(10 + i, 1, 1, prefix=("popular", 4)), 100)
    # One hit on "rare" makes it the most recently freed: LRU would now evict "popular".
    assert d.admit(make_seq(20, 1, 1, prefix=("rare", 4)), 100)
    hungry = make_seq(30, 19, 1)  # 5 blocks: the 4 plain ones and one cached
    assert d.admit(hungry, 100)
    assert kv.stats().evictions == 1
    assert kv.lookup_prefix(make_seq(31, 1, 1, prefix=("popular", 4))) == 4
    assert kv.lookup_prefix(make_seq(32, 1, 1, prefix=("rare", 4))) == 0


def test_lru_evicts_the_least_recently_freed_block_whatever_its_hits():
    kv = paged(num_blocks=6, block_size=4)
    d = KVDriver(kv)
    assert d.admit(make_seq(1, 0, 1, prefix=("popular", 4)), 100)
    assert d.admit(make_seq(2, 0, 1, prefix=("rare", 4)), 100)
    for i in range(3):
        assert d.admit(make_seq(10 + i, 1, 1, prefix=("popular", 4)), 100)
    assert d.admit(make_seq(20, 1, 1, prefix=("rare", 4)), 100)
    assert d.admit(make_seq(30, 19, 1), 100)
    assert kv.stats().evictions == 1
    assert kv.lookup_prefix(make_seq(31, 1, 1, prefix=("popular", 4))) == 0
    assert kv.lookup_prefix(make_seq(32, 1, 1, prefix=("rare", 4))) == 4


def test_sliding_window_release_frees_blocks_no_query_can_see():
    kv = paged(num_blocks=8, block_size=4, sliding_window=6)
    d = WindowDriver(kv)
    seq = make_seq(1, 9, 8)
    assert d.admit(seq, 9)  # 9 computed: queries from position 9 see 4..9: block 0 goes
    assert len(kv.held_blocks(seq)) == 2 and kv.block_table(seq)[0] == 0
    s = kv.stats()
    assert s.reserved_bytes == 2 * 4 * BPT and s.used_bytes == 5 * BPT
    assert s.page_table_entries == 2 and s.block_frees == 1
    for _ in range(4):  # 13 computed: queries see 8.. on, so block 1 goes too
        assert d.step(seq, 1)
    assert kv.held_blocks(seq) == kv.block_table(seq)[2:]
    d.check_contents()
    with pytest.raises(RuntimeError):
        kv.slots(seq, 0, 4)  # released positions have no slots any more


def test_without_release_a_window_model_keeps_every_block():
    kv = paged(num_blocks=8, block_size=4)
    d = KVDriver(kv)
    seq = make_seq(1, 9, 8)
    assert d.admit(seq, 9)
    for _ in range(4):
        assert d.step(seq, 1)
    assert len(kv.held_blocks(seq)) == 4 and kv.stats().block_frees == 0


def test_free_queues_tail_blocks_first():
    kv = paged(num_blocks=3, block_size=2)
    d = KVDriver(kv)
    assert d.admit(make_seq(1, 0, 1, prefix=("x", 6)), 100)
    # The prefix head is evicted last, so a shorter reuse still hits.
    assert d.admit(make_seq(2, 1, 1), 100)
    assert kv.lookup_prefix(make_seq(3, 1, 1, prefix=("x", 4))) == 4


def test_fork_copy_on_write_queues_the_partial_block():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    parent = make_seq(1, 6, 4, n=2)
    assert d.admit(parent, 100)  # prefill 6 tokens, sample, fork one child
    child = next(s for s in d.running if s is not parent)
    assert kv.block_table(child) == kv.block_table(parent) == [0, 1]
    assert kv.stats().shared_bytes == 2 * 4 * BPT
    assert d.step(child, 1)
    copied = kv.stats().copied_bytes
    assert copied == 4 * BPT
    assert kv.block_table(child) == [0, 2]
    assert kv.block_table(parent) == [0, 1]
    # The parent now owns block 1 alone: it writes in place, no copy.
    assert d.step(parent, 1)
    assert kv.block_table(parent) == [0, 1]
    assert kv.stats().copied_bytes == copied
    d.check_contents()


def test_cow_copy_slots():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    parent = make_seq(1, 5, 3, n=2)
    assert d.admit(parent, 100)
    child = next(s for s in d.running if s is not parent)
    assert kv.grow(child, 1)
    (copy,) = kv.take_copies()
    assert (copy.src, copy.dst, copy.num_slots) == (1 * 4, 2 * 4, 4)


def test_grow_fails_without_room_and_changes_nothing():
    kv = paged(num_blocks=2, block_size=4)
    d = KVDriver(kv)
    seq = make_seq(1, 8, 4)
    assert d.admit(seq, 8)
    before = kv.stats()
    assert not kv.grow(seq, 1)
    assert kv.stats() == before and kv.block_table(seq) == [0, 1]


def test_allocate_counts_cached_free_blocks_against_room():
    kv = paged(num_blocks=3, block_size=4)
    d = KVDriver(kv)
    assert d.admit(make_seq(1, 0, 1, prefix=("p", 8)), 100)
    holder = make_seq(2, 4, 4)
    assert d.admit(holder, 4)  # takes the one plain block; two cached blocks stay free
    reuse = make_seq(3, 5, 1, prefix=("p", 8))
    assert kv.lookup_prefix(reuse) == 8
    before = kv.stats()
    assert not kv.allocate(reuse, 8, 5)  # 2 cached + 2 fresh blocks > 2 free
    assert not kv.allocate(reuse, 8, 1)  # 2 cached + 1 fresh block > 2 free
    assert kv.stats() == before


def test_leak_option_keeps_finished_blocks():
    kv = paged(num_blocks=8, block_size=4, leak_finished=True)
    d = KVDriver(kv)
    done = make_seq(1, 6, 1, prefix=("p", 4))
    assert d.admit(done, 100)  # finishes after one token and is freed
    s = kv.stats()
    assert s.reserved_bytes == 3 * 4 * BPT and s.used_bytes == 0
    assert kv.lookup_prefix(make_seq(2, 6, 1, prefix=("p", 4))) == 0  # leaked: never reused
    preempted = make_seq(3, 6, 5)
    assert d.admit(preempted, 100)
    d.preempt(preempted)
    assert kv.stats().reserved_bytes == 3 * 4 * BPT
    assert kv.stats().block_frees == 2  # only the preempted sequence's blocks came back


def test_never_fits_says_why_and_what_to_do():
    kv = PagedKVManager(4, 16, 1024, max_model_len=100)
    long = Request("a", 0.0, (Segment("text", 90, "k"),), 20)
    assert "max_model_len is 100" in kv.never_fits(long)
    big = Request("b", 0.0, (Segment("text", 70, "k"),), 10)
    msg = kv.never_fits(big)
    assert "5 blocks" in msg and "holds 4 blocks" in msg and "--kv-memory" in msg
    assert kv.never_fits(Request("c", 0.0, (Segment("text", 60, "k"),), 4, n=8)) is None


def test_slots_map_positions_through_the_table():
    kv = paged(block_size=4)
    d = KVDriver(kv)
    d.admit(make_seq(1, 3, 1), 100)  # block 0 (then freed: output 1)
    seq = make_seq(2, 10, 5)
    assert d.admit(seq, 10)
    table = kv.block_table(seq)
    want = [table[p // 4] * 4 + p % 4 for p in range(2, 10)]
    assert kv.slots(seq, 2, 10).tolist() == want
    with pytest.raises(RuntimeError):
        kv.slots(seq, 0, 13)


def test_hashes_chain_the_whole_prefix_and_vectorise_exactly():
    h = BlockHasher(16)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=16 * 50 + 3)
    whole = h.chain(ROOT_HASH, ids)
    assert len(whole) == 50
    assert whole == h._chain_py(ROOT_HASH, ids[: 16 * 50].tolist())  # numpy == scalar path
    split = h.chain(ROOT_HASH, ids[:32])
    assert split + h.chain(split[-1], ids[32:]) == whole
    other = ids.copy()
    other[0] += 1  # a change in block 0 changes every later hash
    assert all(a != b for a, b in zip(h.chain(ROOT_HASH, other), whole, strict=True))
    # A leading block of token 0 must still count (splitmix64 alone maps 0 to 0).
    for n in (1, 8):  # scalar and numpy paths
        tail = ids[: 16 * n]
        zeros_then_tail = np.concatenate([np.zeros(16, np.int64), tail])
        assert h.chain(ROOT_HASH, zeros_then_tail)[-1] != h.chain(ROOT_HASH, tail)[-1]
