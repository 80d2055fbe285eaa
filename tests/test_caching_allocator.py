"""The caching-allocator model keeps PyTorch's rounding, segment sizes, best-fit reuse,
splitting, coalescing and release rules."""

from __future__ import annotations

from kvbench.engines.sim.caching_allocator import (
    LARGE_BUFFER,
    MIN_BLOCK,
    SMALL_BUFFER,
    CachingAllocator,
    round_size,
    segment_size,
)

MiB = 2**20


def test_rounding_and_segment_sizes() -> None:
    assert round_size(1) == MIN_BLOCK == 512
    assert round_size(513) == 1024
    assert segment_size(MiB) == SMALL_BUFFER == 2 * MiB
    assert segment_size(MiB + 512) == LARGE_BUFFER == 20 * MiB
    assert segment_size(10 * MiB) == 10 * MiB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(11 * MiB) == 12 * MiB


def test_small_requests_share_a_segment_and_freed_blocks_stay_reserved() -> None:
    a = CachingAllocator()
    handles = [a.allocate(100 * 1024) for _ in range(10)]
    assert a.reserved == 2 * MiB and a.allocated == 10 * 100 * 1024
    for h in handles:
        a.free(h)
    assert a.allocated == 0 and a.reserved == 2 * MiB  # cached, not returned
    assert a.release_free_segments() == 2 * MiB and a.reserved == 0


def test_large_pool_splits_only_beyond_one_mib() -> None:
    a = CachingAllocator()
    a.allocate(3 * MiB)  # maps 20 MiB, the remaining 17 MiB is split off
    assert a.reserved == 20 * MiB and a.allocated == 3 * MiB
    a.allocate(int(16.5 * MiB))  # 0.5 MiB would remain: the whole 17 MiB block is handed out
    assert a.reserved == 20 * MiB and a.allocated == 20 * MiB


def test_best_fit_reuses_the_smallest_block_that_fits() -> None:
    a = CachingAllocator()
    big = a.allocate(12 * MiB)  # own 12 MiB segment
    small = a.allocate(4 * MiB)  # in a 20 MiB segment
    a.free(big)
    a.free(small)
    a.allocate(4 * MiB)  # best fit: the 12 MiB block, not the merged 20 MiB one
    a.allocate(12 * MiB)  # no 12 MiB block left whole: the 20 MiB one, split
    assert a.reserved == 32 * MiB


def test_freed_neighbours_coalesce() -> None:
    a = CachingAllocator()
    x, y, z = (a.allocate(5 * MiB) for _ in range(3))  # one 20 MiB segment
    a.allocate(5 * MiB)
    a.free(x)
    a.free(z)
    a.free(y)  # x, y and z merge into one free 15 MiB block
    a.allocate(14 * MiB)
    assert a.reserved == 20 * MiB
    assert a.release_free_segments() == 0  # the segment still holds blocks


def test_growing_tensors_fragment_the_cache() -> None:
    """A tensor grown by concatenation (longer one allocated, shorter one freed) leaves
    freed blocks the next, longer request cannot use: reserved outgrows allocated."""
    a = CachingAllocator()
    handle = a.allocate(2 * MiB)
    for size in range(3, 40):
        grown = a.allocate(size * MiB)
        a.free(handle)
        handle = grown
    # The 39 MiB request holds a whole 40 MiB block: 1 MiB left over is too small to split.
    assert a.allocated == 40 * MiB
    assert a.reserved > 1.5 * a.allocated
