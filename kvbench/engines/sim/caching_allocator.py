"""A model of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``, its
default configuration: no ``max_split_size_mb``, no expandable segments, no garbage
collection threshold), at the level of blocks and segments, with no memory behind it.

The rules it keeps, with the allocator's constants:

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the
  large pool; a pool serves a request from its smallest free block that fits (best fit,
  lowest address on ties);
- with no fitting free block a new segment is mapped: 2 MiB (``kSmallBuffer``) for a small
  request, 20 MiB (``kLargeBuffer``) for one under 10 MiB (``kMinLargeAlloc``), else the
  request rounded up to 2 MiB (``kRoundLarge``);
- a block larger than the request is split when the remainder is at least 512 bytes (small
  pool) or more than 1 MiB (large pool); otherwise the request gets the whole block;
- a freed block merges with free neighbours of its segment and stays reserved: segments go
  back to the device only when a mapping fails (``release_cached_blocks``: every segment that
  is entirely free), which :meth:`CachingAllocator.release_free_segments` performs.

``reserved`` is what the process holds from the device (``memory_reserved``), ``allocated``
what its tensors hold, rounded (``memory_allocated``); their difference is the allocator's
overhead: rounding, split remainders too small to reuse, and freed blocks kept for reuse.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
LARGE_BUFFER = 20 << 20
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20


def round_size(size: int) -> int:
    """A request's block size."""
    return max(MIN_BLOCK, -(-size // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment mapped for a (rounded) request no cached block can serve."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(slots=True, eq=False)
class _Block:
    address: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass(slots=True)
class _Pool:
    """Free blocks ordered by (size, address), the allocator's best-fit order."""

    keys: list[tuple[int, int]] = field(default_factory=list)
    blocks: dict[int, _Block] = field(default_factory=dict)

    def add(self, block: _Block) -> None:
        bisect.insort(self.keys, (block.size, block.address))
        self.blocks[block.address] = block

    def remove(self, block: _Block) -> None:
        del self.keys[bisect.bisect_left(self.keys, (block.size, block.address))]
        del self.blocks[block.address]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        return self.blocks[self.keys[i][1]] if i < len(self.keys) else None


class CachingAllocator:
    """Blocks handed out by id; ``allocate`` returns one, ``free`` takes it back."""

    def __init__(self) -> None:
        self._small, self._large = _Pool(), _Pool()
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, int] = {}  # first address -> size
        self._next_address = 0
        self._next_id = 0
        self.reserved = 0
        self.allocated = 0
        self.peak_reserved = 0

    def allocate(self, size: int) -> int:
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self._small if small else self._large
        block = pool.best_fit(size)
        if block is None:
            block = self._map(segment_size(size), small)
        else:
            pool.remove(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.address + size, remaining, block.segment, small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            pool.add(rest)
        block.allocated = True
        self.allocated += block.size
        handle = self._next_id
        self._next_id += 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        pool = self._small if block.small else self._large
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                pool.remove(neighbour)
                if neighbour is block.prev:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.prev = block
        pool.add(block)

    def release_free_segments(self) -> int:
        """Unmap every segment that holds no allocated block; returns the bytes released."""
        released = 0
        for pool in (self._small, self._large):
            for block in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
                pool.remove(block)
                del self._segments[block.segment]
                released += block.size
        self.reserved -= released
        return released

    @property
    def free_cached(self) -> int:
        """Reserved bytes no tensor holds."""
        return self.reserved - self.allocated

    def _map(self, size: int, small: bool) -> _Block:
        address = self._next_address
        self._next_address += size
        self._segments[address] = size
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return _Block(address, size, address, small)
