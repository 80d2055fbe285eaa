"""How far a prefix cache's hit rate is from the best any cache of its size could do.

A prefix cache records its block accesses in a :class:`BlockTrace`, in the order they
happen: each lookup (the blocks a request asks for, of which the leading run found counts
as hits) and each write that makes a block findable (a computed block cached, or a
preempted sequence's blocks keyed for its return). A lookup that misses caches nothing;
only a write does. :func:`belady` replays the trace on a cache of the same number of blocks
that keeps, among the blocks written, those whose next lookup comes soonest (Belady's MIN).
Keeping a block whose next reference is a write gains nothing, since the write brings it
back; so each write starts a new life of its block, and within lives MIN's exchange argument
holds. Because a block's key names its whole prefix, a lookup asks for a block only after
the blocks before it, so MIN's hits are leading runs; a test checks the count against an
exhaustive search. The engine's own cache is one of the caches this bounds: it holds only
blocks written before and at most its number of blocks (and it also pins the blocks of
running sequences, which the oracle does not).

The unbounded figure is the hit rate of a cache that never evicts: a block hits when it
was written before.

The search runs in C (``oracle.c``) where a compiler is found, else in Python (the same
answer, many times slower). A trace stops recording past :data:`MAX_REFERENCES` (about
300 MB), or when told to (a soak: its trace would grow with every wave and read as a leak
of the process), and its run then reports no oracle.
"""

from __future__ import annotations

import ctypes
import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from kvbench.kernels import native_build

# Kinds of a reference: a write, the first block of a lookup, a later block of it.
WRITE, LOOKUP, MORE = 0, 1, 2
MAX_REFERENCES = 1 << 25


@dataclass(frozen=True, slots=True)
class PrefixOracle:
    """Hit tokens of a run's prefix-cache lookups under MIN at ``capacity_blocks`` blocks
    and with unbounded capacity (blocks of ``block_tokens`` tokens each); ``tiers`` holds,
    per offload tier below device memory, its kind and MIN's hit tokens with the blocks of
    that tier and of every tier above it added to the capacity."""

    capacity_blocks: int
    block_tokens: int
    references: int
    hit_tokens: int
    unbounded_hit_tokens: int
    tiers: tuple[tuple[str, int], ...] = ()


class BlockTrace:
    """A prefix cache's block references, in order (names are its block keys)."""

    __slots__ = ("kinds", "names", "stopped")

    def __init__(self) -> None:
        self.names = array("Q")
        self.kinds = array("b")
        self.stopped = False

    def __len__(self) -> int:
        return len(self.names)

    def lookup(self, keys: Sequence[int] | np.ndarray) -> None:
        """A request looks up ``keys`` (its leading run of cached blocks hits)."""
        if len(keys) and self._room(len(keys)):
            self._add(keys)
            self.kinds.frombytes(b"\x01" + b"\x02" * (len(keys) - 1))

    def write(self, keys: Sequence[int] | np.ndarray) -> None:
        """Blocks holding ``keys`` became findable."""
        if len(keys) and self._room(len(keys)):
            self._add(keys)
            self.kinds.frombytes(bytes(len(keys)))

    def stop(self) -> None:
        """Drop what was recorded and record nothing more."""
        self.names, self.kinds, self.stopped = array("Q"), array("b"), True

    def _room(self, n: int) -> bool:
        if not self.stopped and len(self.names) + n > MAX_REFERENCES:
            self.stop()
        return not self.stopped

    def _add(self, keys: Sequence[int] | np.ndarray) -> None:
        if isinstance(keys, np.ndarray):
            self.names.frombytes(keys.astype(np.uint64, copy=False).tobytes())
        else:
            self.names.extend(keys)

    def oracle(self, capacity_blocks: int, block_tokens: int,
               tiers: Sequence[tuple[str, int]] = ()) -> PrefixOracle | None:
        """MIN and unbounded hits of this trace (None when it stopped), and MIN's hits with
        each of ``tiers`` (kind, blocks) added in turn."""
        if self.stopped:
            return None
        names = np.frombuffer(self.names, dtype=np.uint64)
        kinds = np.frombuffer(self.kinds, dtype=np.int8)
        hits, unbounded = belady(names, kinds, capacity_blocks)
        more, capacity = [], capacity_blocks
        for kind, blocks in tiers:
            capacity += blocks
            more.append((kind, belady(names, kinds, capacity)[0] * block_tokens))
        return PrefixOracle(capacity_blocks, block_tokens, len(names), hits * block_tokens,
                            unbounded * block_tokens, tuple(more))


def belady(names: np.ndarray, kinds: np.ndarray, capacity: int) -> tuple[int, int]:
    """Leading-run hits of the lookups in ``names``/``kinds`` (one reference each) on a
    cache of ``capacity`` blocks kept by MIN, and with unbounded capacity."""
    if len(names) != len(kinds):
        raise ValueError("one kind per name")
    lib = _library()
    if lib is None:
        return _belady_py(names.tolist(), kinds.tolist(), capacity)
    names = np.ascontiguousarray(names, dtype=np.uint64)
    kinds = np.ascontiguousarray(kinds, dtype=np.int8)
    out = np.zeros(2, dtype=np.int64)
    rc = lib.kvo_belady(names.ctypes.data, kinds.ctypes.data, len(names), capacity,
                        out.ctypes.data)
    if rc == -1:
        raise MemoryError("the cache oracle could not get memory for its tables")
    if rc == -2:
        raise ValueError("the cache oracle takes fewer than 2**31 references")
    return int(out[0]), int(out[1])


def _belady_py(names: list[int], kinds: list[int], capacity: int) -> tuple[int, int]:
    """:func:`belady` without C: the same passes over dicts and a heap."""
    n = len(names)
    nxt, last = [n] * n, {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(names[i], n)
        last[names[i]] = i
    at: dict[int, int] = {}  # cached name -> position of its next counted use
    heap: list[tuple[int, int]] = []  # (-position, name), stale while at[] differs
    hits = unbounded = 0
    run = run_all = False
    written: set[int] = set()
    for i, (name, kind) in enumerate(zip(names, kinds, strict=True)):
        if kind == LOOKUP:
            run = run_all = True
        if kind != WRITE:
            run = run and name in at
            run_all = run_all and name in written
            hits += run
            unbounded += run_all
        j = nxt[i]
        key = j if j < n and kinds[j] != WRITE else n
        if kind == WRITE:
            written.add(name)
        if name in at and key == n:
            del at[name]
        elif name in at or (kind == WRITE and key < n and capacity > 0
                            and _make_room(at, heap, capacity, key)):
            at[name] = key
            heapq.heappush(heap, (-key, name))
    return hits, unbounded


def _make_room(at: dict[int, int], heap: list[tuple[int, int]], capacity: int,
               key: int) -> bool:
    """Whether a block next used at ``key`` may join: there is room, or a cached block is
    needed later than it (that one leaves)."""
    if len(at) < capacity:
        return True
    while at.get(heap[0][1]) != -heap[0][0]:
        heapq.heappop(heap)
    if -heap[0][0] < key:
        return False
    del at[heapq.heappop(heap)[1]]
    return True


@cache
def _library() -> ctypes.CDLL | None:
    """``oracle.c`` built and loaded, or None where it cannot be built here."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return native_build.optional_library(Path(__file__).with_name("oracle.c"), {
        "kvo_belady": (i64, [ptr, ptr, i64, i64, ptr])})
