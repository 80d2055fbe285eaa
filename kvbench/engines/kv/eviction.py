"""Which free cached block a prefix cache gives up first when it needs room.

A free block that still holds a cached full block waits in an eviction queue until a
prefix hit takes it back (``remove``) or the pool needs a fresh block (``evict``). ``lru``
evicts the least recently freed block; ``lfu`` the one whose content served the fewest
prefix hits, the least recently freed among equals (so with no hits at all it is ``lru``).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator
from itertools import islice, repeat
from typing import Literal

Eviction = Literal["lru", "lfu"]
EVICTIONS: tuple[str, ...] = ("lru", "lfu")


class LRUQueue(OrderedDict[int, None]):
    """Blocks in the order they were freed; an ``OrderedDict`` so that bulk adds and the
    common removals stay C-level operations."""

    def add(self, block: int) -> None:
        self[block] = None

    def add_many(self, blocks: Iterable[int]) -> None:
        self.update(zip(blocks, repeat(None)))

    def remove(self, block: int) -> None:
        del self[block]

    def evict(self, n: int) -> list[int]:
        """Take out the ``n`` least recently freed blocks (caller checked there are ``n``)."""
        out = list(islice(self, n))
        deque(map(self.__delitem__, out), maxlen=0)
        return out


class LFUQueue:
    """Blocks by (prefix hits of their content, order freed). ``hits`` is the pool's per-block
    hit count; a block's count cannot change while it waits (a hit takes it out first).

    A heap with lazy deletion: a removed block's entry stays until it surfaces, and the heap
    is rebuilt once stale entries outnumber live ones, so every operation is O(log n)
    amortised.
    """

    __slots__ = ("_heap", "_live", "_stamp", "hits")

    def __init__(self, hits: list[int]) -> None:
        self.hits = hits
        self._heap: list[tuple[int, int, int]] = []
        self._live: dict[int, int] = {}  # block -> stamp of its current entry
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def __contains__(self, block: object) -> bool:
        return block in self._live

    def add(self, block: int) -> None:
        self._stamp += 1
        self._live[block] = self._stamp
        heapq.heappush(self._heap, (self.hits[block], self._stamp, block))

    def add_many(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            self.add(b)

    def remove(self, block: int) -> None:
        del self._live[block]
        if len(self._heap) > 2 * len(self._live) + 64:
            live = self._live
            self._heap = [e for e in self._heap if live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def evict(self, n: int) -> list[int]:
        """Take out the ``n`` blocks with the fewest hits, least recently freed first."""
        heap, live = self._heap, self._live
        out: list[int] = []
        while len(out) < n:
            _, stamp, b = heapq.heappop(heap)
            if live.get(b) == stamp:
                del live[b]
                out.append(b)
        return out


def eviction_queue(policy: Eviction, hits: list[int]) -> LRUQueue | LFUQueue:
    """An empty queue of ``policy`` reading per-block hit counts from ``hits``."""
    return LRUQueue() if policy == "lru" else LFUQueue(hits)
