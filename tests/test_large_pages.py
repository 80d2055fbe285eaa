"""Large pages carved by pools of different block sizes (Jenga's two-level allocator)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.large_pages import LargePages


def _pages(num_pages: int, sizes: tuple[int, ...] = (2, 3)) -> LargePages:
    """Pools of ``sizes``-byte blocks carving ``num_pages`` pages of 6 bytes."""
    pools = [BlockPool(num_pages * 6 // s, 1) for s in sizes]
    return LargePages(pools, list(sizes), 6)


def test_a_pool_fills_its_partly_used_page_before_taking_another() -> None:
    pages = _pages(3)
    first = pages.take(0, 2)
    assert [b // 3 for b in first] == [0, 0]
    more = pages.take(0, 2)
    assert sorted(b // 3 for b in more) == [0, 1]  # page 0's last block, then page 1
    assert pages.reserved_bytes() == 8 and pages.largest_free_bytes() == 6
    pages.release(0, more, 0)
    pages.release(0, first, 0)
    assert pages.reserved_bytes() == 0 and len(pages.free_pages) == 3


def test_free_blocks_in_another_pools_page_are_fragmentation() -> None:
    """Pool 0 holds one 2-byte block in each page: 8 of 12 bytes are free, yet pool 1
    cannot place one 3-byte block."""
    pages = _pages(2)
    held = pages.take(0, 4)  # page 0 whole, one block of page 1
    pages.release(0, held[:2], 0)  # page 0 keeps one block
    assert pages.free_bytes() == 8 and pages.largest_free_bytes() == 0
    assert not pages.room([0, 1], [[], []])
    assert pages.room([2, 0], [[], []])  # pool 0 itself can use them


def test_an_idle_page_is_reclaimed_with_its_cache_evicted() -> None:
    pages = _pages(1)
    pool = pages.pools[0]
    blocks = pages.take(0, 3)
    pool.cache(blocks, [11, 12, 13], 0, 3)
    pages.release(0, blocks, 6)
    assert list(pages.idle) == [0] and pool.lookup([11, 12, 13]) == blocks
    hit = pool.lookup([11])
    assert pages.room([0, 0], [hit, []])
    pages.touch(0, hit)  # a hit wakes the page: pool 1 has no room now
    assert not pages.room([0, 1], [[], []])
    pages.release(0, hit, 2)
    assert pages.room([0, 1], [[], []])
    got = pages.take(1, 1)
    assert got == [0] and pages.owner == [1]
    assert pool.lookup([11]) == [] and pool.num_evictions == 3


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["take", "free", "hit"]), st.integers(0, 1),
                              st.integers(1, 7)), max_size=60))
def test_room_is_exact_for_take_and_pages_stay_consistent(ops) -> None:
    """Whenever ``room`` says yes, ``take`` delivers; blocks in use lie only in pages their
    pool owns; everything returns once released."""
    pages = _pages(4)
    held: list[list[tuple[int, int]]] = []  # tables of (pool, block)
    key = 0
    for op, i, n in ops:
        if op == "take" and pages.room([n if j == i else 0 for j in range(2)], [[], []]):
            blocks = pages.take(i, n)
            assert len(set(blocks)) == n
            held.append([(i, b) for b in blocks])
        elif op == "free" and held:
            table = held.pop(n % len(held))
            for j in (0, 1):
                blocks = [b for p, b in table if p == j]
                fresh = [b for b in blocks if pages.pools[j]._hash[b] is None]
                if fresh and n % 2:  # cache them first: they stay findable
                    keys = list(range(key, key + len(fresh)))
                    key += len(fresh)
                    pages.pools[j].cache(fresh, keys, 0, len(fresh))
                pages.release(j, blocks, 0)
        elif op == "hit":
            pool = pages.pools[i]
            found = [b for b in pool.cached(range(key)) if b is not None][:n]
            if pages.room([0, 0], [found if j == i else [] for j in range(2)]):
                pages.touch(i, found)
                held.append([(i, b) for b in found])
        _check(pages)
    for table in held:
        for j in (0, 1):
            pages.release(j, [b for p, b in table if p == j], 0)
    _check(pages)
    assert pages.reserved_bytes() == 0


def _check(pages: LargePages) -> None:
    owner: dict[int, int] = {}
    for i, (pool, per) in enumerate(zip(pages.pools, pages.per, strict=True)):
        for b in range(pool.num_blocks):
            if pool.ref[b] or pool._hash[b] is not None:
                assert owner.setdefault(b // per, i) == i, "a page used by two pools"
                assert pages.owner[b // per] == i
        assert pages.cached_active[i] + sum(pages.cached[p] for p in pages.idle
                                             if pages.owner[p] == i) == len(pool._free_cached)
    assert sum(o >= 0 for o in pages.owner) + len(pages.free_pages) == len(pages.owner)
