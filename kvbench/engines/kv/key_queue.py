"""The queues of block keys an offload tier evicts from (:mod:`~kvbench.engines.kv.offload`).

An ``lru`` tier keeps its keys in :class:`KeyQueue`, an ``lfu`` or ``cost`` tier in
:class:`RankedQueue` (by the rank each key joins with), both in C (``key_queue.c``, built on
first use as the native attention kernel is), where Python's ``OrderedDict`` or heap would
cost about a microsecond a key: a Mooncake replay sends a million evicted blocks through a
tier. Where there is no C compiler, :class:`PyKeyQueue` keeps them in the eviction queues of
:mod:`~kvbench.engines.kv.eviction`, which evict in the same order.

Keys are 64-bit block hashes, given as a list of ints, an ``array("Q")`` or a numpy
``uint64`` array.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Iterator, Sequence
from functools import cache
from itertools import islice, takewhile
from pathlib import Path

import numpy as np

from kvbench.engines.kv.eviction import LFUQueue, LRUQueue
from kvbench.kernels import native_build

Keys = Sequence[int] | array | np.ndarray
# What a key joins a ranked queue with (lower is evicted first).
Ranks = Sequence[float] | np.ndarray


class _NativeQueue:
    """What both C queues do alike; ``_fn`` prefixes their functions' names."""

    __slots__ = ("_evict", "_free", "_keys", "_n", "_q", "_remove", "_run")
    _fn = ""

    def __init__(self) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the C key queues did not build")
        self._free, self._keys, self._remove, self._run, self._evict = (
            getattr(lib, f"{self._fn}_{name}")
            for name in ("free", "keys", "remove", "run", "evict"))
        self._n = 0  # kept here too: a tier asks for it at every step
        self._q = getattr(lib, f"{self._fn}_new")()
        if not self._q:
            raise MemoryError("no memory for a key queue")

    def __del__(self) -> None:
        if getattr(self, "_q", None):
            self._free(self._q)
            self._q = None

    def __len__(self) -> int:
        return self._n

    def __contains__(self, key: object) -> bool:
        return self.run([key], 0) == 1  # type: ignore[list-item]

    def __iter__(self) -> Iterator[int]:
        out = array("Q", bytes(8 * len(self)))
        self._keys(self._q, out.buffer_info()[0])
        return iter(out.tolist())

    def remove_many(self, keys: Keys) -> None:
        """Take out ``keys``, all held."""
        k = key_array(keys)
        if k:
            self._n -= self._remove(self._q, k.buffer_info()[0], len(k), None)

    def discard(self, keys: Keys) -> list[int]:
        """Take out those of ``keys`` held: them, in order."""
        k = key_array(keys)
        if not k:
            return []
        gone = bytearray(len(k))
        n = self._remove(self._q, k.buffer_info()[0], len(k),
                         (ctypes.c_char * len(k)).from_buffer(gone))
        if not n:
            return []
        self._n -= n
        return [key for key, g in zip(k, gone, strict=True) if g]

    def evict(self, n: int) -> array:
        """Take out the ``n`` keys evicted first (the caller checked there are)."""
        out = array("Q", bytes(8 * n))
        if self._evict(self._q, n, out.buffer_info()[0]) < 0:
            raise RuntimeError(f"evict({n}) from a queue of {len(self)} keys")
        self._n -= n
        return out

    def run(self, keys: Keys, start: int) -> int:
        """How many of ``keys`` from ``start`` on, one after another, are held."""
        k = key_array(keys)
        if start >= len(k):
            return 0
        return self._run(self._q, k.buffer_info()[0] + 8 * start, len(k) - start)

    def _added(self, n: int) -> None:
        if n < 0:
            raise MemoryError("an offload tier's key queue could not grow")
        self._n = n


class KeyQueue(_NativeQueue):
    """Keys in the order they joined, the least recent evicted first (C); iterated in that
    order."""

    __slots__ = ()
    _fn = "kvq"

    def add_many(self, keys: Keys) -> None:
        """Append ``keys`` (a key held already stays where it is)."""
        k = key_array(keys)
        if k:
            self._added(_LIB.kvq_add(self._q, k.buffer_info()[0], len(k)))


class RankedQueue(_NativeQueue):
    """Keys by (rank, order joined), the lowest evicted first (C), as
    :class:`~kvbench.engines.kv.eviction.LFUQueue` orders them."""

    __slots__ = ()
    _fn = "kvr"

    def add_ranked(self, keys: Keys, ranks: Ranks) -> None:
        k = key_array(keys)
        if k:
            r = np.ascontiguousarray(ranks, dtype=np.float64)
            self._added(_LIB.kvr_add(self._q, k.buffer_info()[0],
                                     r.__array_interface__["data"][0], len(k)))


class PyKeyQueue:
    """The C queues' operations over an eviction queue of
    :mod:`~kvbench.engines.kv.eviction` (LRU, or LFU by the rank a key joins with)."""

    __slots__ = ("_rank", "queue")

    def __init__(self, lru: bool) -> None:
        self._rank: dict[int, float] = {}
        self.queue = LRUQueue() if lru else LFUQueue(self._rank)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, key: object) -> bool:
        return key in self.queue

    def __iter__(self) -> Iterator[int]:
        return iter(self.queue)

    def add_many(self, keys: Keys) -> None:
        self.queue.add_many(as_ints(keys))

    def add_ranked(self, keys: Keys, ranks: Ranks) -> None:
        rank, queue = self._rank, self.queue
        values = ranks.tolist() if isinstance(ranks, np.ndarray) else ranks
        for key, r in zip(as_ints(keys), values, strict=True):
            rank[key] = r
            queue.add(key)
            del rank[key]

    def remove_many(self, keys: Keys) -> None:
        for key in as_ints(keys):
            self.queue.remove(key)

    def discard(self, keys: Keys) -> list[int]:
        held = [key for key in as_ints(keys) if key in self.queue]
        self.remove_many(held)
        return held

    def evict(self, n: int) -> list[int]:
        return self.queue.evict(n)

    def run(self, keys: Keys, start: int) -> int:
        return len(list(takewhile(self.queue.__contains__, islice(as_ints(keys), start, None))))


def key_queue(lru: bool) -> KeyQueue | RankedQueue | PyKeyQueue:
    """A tier's queue: LRU, else by rank; in C where it builds."""
    if _library() is None:
        return PyKeyQueue(lru)
    return KeyQueue() if lru else RankedQueue()


def as_ints(keys: Keys) -> Sequence[int]:
    return keys.tolist() if isinstance(keys, array | np.ndarray) else keys


def key_array(keys: Keys) -> array:
    """``keys`` as 64-bit unsigned integers in memory C can read (itself if it is)."""
    if type(keys) is array and keys.typecode == "Q":
        return keys
    if isinstance(keys, np.ndarray):
        out = array("Q")
        out.frombytes(np.ascontiguousarray(keys, dtype=np.uint64).tobytes())
        return out
    return array("Q", keys)


_LIB: ctypes.CDLL


@cache
def _library() -> ctypes.CDLL | None:
    """``key_queue.c`` built and loaded, or None where it cannot be built here."""
    global _LIB
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib = native_build.optional_library(Path(__file__).with_name("key_queue.c"), {
        "kvq_new": (ptr, []),
        "kvq_free": (None, [ptr]),
        "kvq_add": (i64, [ptr, ptr, i64]),
        "kvq_remove": (i64, [ptr, ptr, i64, ptr]),
        "kvq_evict": (i64, [ptr, i64, ptr]),
        "kvq_run": (i64, [ptr, ptr, i64]),
        "kvq_keys": (i64, [ptr, ptr]),
        "kvr_new": (ptr, []),
        "kvr_free": (None, [ptr]),
        "kvr_add": (i64, [ptr, ptr, ptr, i64]),
        "kvr_remove": (i64, [ptr, ptr, i64, ptr]),
        "kvr_evict": (i64, [ptr, i64, ptr]),
        "kvr_run": (i64, [ptr, ptr, i64]),
        "kvr_keys": (i64, [ptr, ptr]),
    })
    if lib is not None:
        _LIB = lib
    return lib
