"""Mixed page granularity: buddy pool invariants under random operations, merges, migration,
splits and coalescing, fallback to smaller pages, the largest-class fragmentation index."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_driver import KVDriver, make_seq, random_operations

from kvbench.engines.kv.buddy import BuddyPool
from kvbench.engines.kv.paged_mixed import PagedMixedKVManager, PagedMixedPolicy

BPT = 8  # bytes per token
UNIT = 2  # tokens per unit: classes of 2, 8 and 32 tokens with ratio 4


def mixed(num_units: int = 64, **kw) -> PagedMixedKVManager:
    kw.setdefault("class_limits", (7, 31))
    return PagedMixedKVManager(num_units, UNIT, BPT, max_model_len=1 << 20, **kw)


def pieces(kv: PagedMixedKVManager, driver: KVDriver) -> tuple[Counter, dict]:
    """References per live page, and every live page's class."""
    refs: Counter[int] = Counter()
    cls: dict[int, int] = {}
    for seq in driver.running:
        for start, c in kv.page_table(seq):
            refs[start] += 1
            assert cls.setdefault(start, c) == c  # sharers agree on a page's class
    return refs, cls


def check_invariants(kv: PagedMixedKVManager, driver: KVDriver) -> None:
    pool, sizes = kv.pool, kv.pool.sizes
    refs, cls = pieces(kv, driver)
    assert dict(refs) == kv._ref and all(r > 0 for r in kv._ref.values())
    free = [(s, k) for k in range(pool.top + 1) for s in pool._free[k]]
    owner = [0] * pool.num_units
    for start, k in [*free, *cls.items()]:
        assert start % sizes[k] == 0  # naturally aligned
        for u in range(start, start + sizes[k]):
            owner[u] += 1
    assert owner == [1] * pool.num_units  # live and free pages tile the units exactly once
    assert pool.free_units == sum(sizes[k] for _, k in free)
    s = kv.stats()
    unit_bytes = UNIT * BPT
    assert s.free_bytes + s.reserved_bytes == s.capacity_bytes == pool.num_units * unit_bytes
    assert 0 <= s.used_bytes <= s.reserved_bytes
    assert 0 <= s.largest_free_bytes <= s.free_bytes
    fill: dict[int, int] = {}
    for seq in driver.running:
        pos, n = 0, seq.num_computed_tokens
        for start, c in kv.page_table(seq):
            size = sizes[c] * UNIT
            f = min(max(n - pos, 0), size)
            assert fill.setdefault(start, f) == f  # sharers hold the same KV
            pos += size
    assert s.used_bytes == sum(fill.values()) * BPT
    assert s.page_table_entries == sum(len(kv.page_table(q)) for q in driver.running)
    assert 0 <= s.reserved_ahead_bytes <= s.reserved_bytes - s.used_bytes
    driver.check_contents()


@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    num_units=st.integers(8, 80),
    migrate=st.booleans(),
    prewarm=st.sampled_from([0, 0, 3]),
    seed=st.integers(0, 2**16),
)
def test_random_operations_keep_invariants(data, num_units, migrate, prewarm, seed):
    kv = mixed(num_units, migrate=migrate, prewarm_pages=prewarm)
    d = KVDriver(kv, seed)
    random_operations(data, d, check_invariants, prompt_max=40, output_max=12, chunk_max=40,
                      step_max=12, background=True)
    s = kv.stats()
    assert s.free_bytes == s.capacity_bytes and s.used_bytes == 0 and not kv._ref
    if not prewarm:  # everything coalesced back into the fresh pool's pages
        assert kv.pool.free_units == num_units
        fresh = BuddyPool(num_units, 4, 2)
        assert [sorted(f) for f in kv.pool._free] == [sorted(f) for f in fresh._free]


def test_length_picks_the_class_and_four_adjacent_pages_merge():
    kv = mixed()
    d = KVDriver(kv)
    seq = make_seq(1, 1, 40)  # grows one token at a time
    assert d.admit(seq, 1)
    for _ in range(7):  # 8 tokens: four 2-token pages, adjacent and aligned: one 8-token page
        assert d.step(seq, 1)
    assert kv.page_table(seq) == [(0, 1)]
    assert kv.stats().merges == 1 and kv.stats().page_table_entries == 1
    assert d.step(seq, 1)  # 9 tokens: an 8..31-token sequence takes 8-token pages
    assert kv.page_table(seq) == [(0, 1), (4, 1)]
    for _ in range(24):  # 33 tokens: four adjacent 8-token pages merged, then a 32-token page
        assert d.step(seq, 1)
    assert kv.page_table(seq) == [(0, 2), (16, 2)]
    assert kv.stats().merges == 2 and kv.stats().splits == 2  # one 32-unit page split twice
    d.check_contents()


def interleaved(kv: PagedMixedKVManager) -> tuple[KVDriver, list]:
    """Two sequences growing by turns, so their small pages alternate in memory."""
    d = KVDriver(kv)
    a, b = make_seq(1, 1, 40), make_seq(2, 1, 40)
    assert d.admit(a, 1) and d.admit(b, 1)
    for _ in range(9):
        assert d.step(a, 1) and d.step(b, 1)
    return d, [a, b]


def test_scattered_small_pages_stay_unmerged_without_migration():
    kv = mixed()
    _, (a, _) = interleaved(kv)
    assert [c for _, c in kv.page_table(a)] == [0, 0, 0, 0, 1]
    assert kv.stats().merges == 0 and kv.stats().migrated_bytes == 0


def test_migration_moves_scattered_pages_into_one_large_page_and_keeps_the_kv():
    kv = mixed(migrate=True)
    d, (a, _) = interleaved(kv)
    # At 9 tokens each sequence's class is 8-token pages: its four 2-token pages, not
    # adjacent, move into one fresh 8-token page; the copies are real and counted.
    assert [c for _, c in kv.page_table(a)] == [1, 1]
    s = kv.stats()
    assert s.merges == 2 and s.migrated_bytes == 2 * 8 * BPT
    assert s.copied_bytes == s.migrated_bytes
    d.check_contents()


def test_fallback_to_smaller_pages_when_no_large_page_is_free():
    kv = mixed(num_units=16)  # one 32-token page of 16 units
    d = KVDriver(kv)
    small = [make_seq(i, 1, 8) for i in range(4)]
    for s in small:
        assert d.admit(s, 1)  # four 2-token pages: the only 16-unit page is split
    big = make_seq(9, 19, 4)  # 20 tokens: 8-token pages, of which three are still free
    assert d.admit(big, 20)
    classes = [c for _, c in kv.page_table(big)]
    assert sum(kv.pool.sizes[c] * UNIT for c in classes) >= 20
    assert 1 in classes and kv.stats().largest_free_bytes == 0
    d.check_contents()


def test_fragmentation_index_is_the_longest_free_run_of_large_pages():
    kv = mixed(num_units=64)  # four 32-token pages
    d = KVDriver(kv)
    seqs = [make_seq(i, 31, 2) for i in range(4)]  # 32 tokens each: one large page each
    for s in seqs:
        assert d.admit(s, 32)
    d.free(seqs[0])
    d.free(seqs[2])
    s = kv.stats()
    assert s.free_bytes == 2 * 32 * BPT and s.largest_free_bytes == 32 * BPT  # not adjacent
    d.free(seqs[1])
    assert kv.stats().largest_free_bytes == 3 * 32 * BPT


def test_fork_shares_pages_and_copies_the_partial_one_on_write():
    kv = mixed()
    d = KVDriver(kv)
    parent = make_seq(1, 5, 4, n=2)  # 5 prompt tokens: pages of 2, 2, 2 (the last partial)
    assert d.admit(parent, 100)
    child = next(s for s in d.running if s is not parent)
    assert kv.page_table(child) == kv.page_table(parent)
    assert kv.stats().shared_bytes > 0
    assert d.step(child, 1)
    assert kv.stats().copied_bytes == 1 * BPT  # the one written slot of the shared page
    assert kv.page_table(child)[:2] == kv.page_table(parent)[:2]
    assert kv.page_table(child)[2] != kv.page_table(parent)[2]
    d.check_contents()


def test_prewarm_keeps_small_pages_split_ahead_of_demand():
    kv = mixed(prewarm_pages=5)
    kv.background()
    assert kv.pool.free_pages(0) >= 5
    splits = kv.stats().splits
    d = KVDriver(kv)
    seq = make_seq(1, 1, 3)
    assert d.admit(seq, 1)
    assert kv.stats().splits == splits  # served from the pre-split pages
    d.free(seq)
    assert kv.pool.free_pages(0) >= 5  # freed small pages stay split for the next ones


def test_policy_validates_and_labels_its_classes():
    assert PagedMixedPolicy().label() == "paged-mixed/16/64/256"
    assert PagedMixedPolicy(class_limits=(511, 2048, 8192)).label() == "paged-mixed/16/64/256/1024"
    with pytest.raises(ValueError, match="increasing"):
        PagedMixedPolicy(class_limits=(2048, 511))
    with pytest.raises(ValueError):
        PagedMixedPolicy(colour="red")


def test_longest_free_run_matches_a_scan_under_random_flips():
    import random

    from kvbench.engines.kv.buddy import _RunTree

    rng = random.Random(0)
    for n in (1, 5, 16, 37):
        tree, flags = _RunTree(n), [False] * n
        for _ in range(300):
            for _ in range(rng.randint(1, 4)):  # several flips between questions
                i = rng.randrange(n)
                flags[i] = rng.random() < 0.6
                tree.set(i, flags[i])
            longest = run = 0
            for f in flags:
                run = run + 1 if f else 0
                longest = max(longest, run)
            assert tree.longest == longest
