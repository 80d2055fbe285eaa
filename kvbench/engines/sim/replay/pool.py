"""The event replay's block pool: :class:`~kvbench.engines.kv.block_pool.BlockPool` in C
(``native.c``), where the replay hands it a prompt's or a finished sequence's blocks in one
call; ``BlockPool`` itself where there is no C compiler.

The C pool hands out the same block ids, keeps the same keys and counters and evicts in the
same order as ``BlockPool``, LRU or LFU (``tests/test_replay_pool.py`` runs both
through random operation sequences and compares them after every call).
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

from kvbench.engines.kv.block_pool import BlockPool
from kvbench.engines.kv.eviction import Eviction
from kvbench.engines.kv.hashing import BlockHasher
from kvbench.kernels import native_build
from kvbench.workloads.model import contents_token_ids


class ListPool(BlockPool):
    """``BlockPool`` taking the replay's uint64 key arrays (as Python ints in its index)."""

    __slots__ = ()

    def lookup(self, keys: np.ndarray) -> list[int]:  # type: ignore[override]
        if not len(keys) or int(keys[0]) not in self._by_hash:
            return []  # the common miss, without converting the rest
        return super().lookup(keys.tolist())

    def cache(self, blocks: list[int], keys: Sequence[int] | np.ndarray, start: int,
              end: int) -> None:
        super().cache(blocks[start:end], _ints(keys[start:end]), 0, end - start)

    def rekey(self, blocks: list[int], keys: np.ndarray) -> None:  # type: ignore[override]
        super().rekey(blocks, _ints(keys))


def _ints(keys: Sequence[int] | np.ndarray) -> list[int]:
    return keys.tolist() if isinstance(keys, np.ndarray) else [int(k) for k in keys]


class NativePool:
    """``BlockPool`` in C (``native.c``), LRU or (``lfu``) LFU: the same blocks, keys,
    counters and eviction order, with the prefix cache's key index in an open-addressing
    table rather than a dict (a Mooncake replay makes millions of key lookups, insertions
    and deletions). Built by :mod:`kvbench.kernels.native_build`; :func:`new_pool` falls back
    to :class:`ListPool` where there is no C compiler."""

    __slots__ = ("_c", "_p", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int, lfu: bool = False) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the C block pool did not build")
        self.num_blocks, self.block_size = num_blocks, block_size
        p = lib.kvp_new(num_blocks, block_size, lfu)
        if not p:
            raise MemoryError(f"no memory for a pool of {num_blocks} blocks")
        self._p = p
        self._c = (ctypes.c_int64 * 9).from_address(lib.kvp_counters(p))

    def __del__(self) -> None:
        lib = _library()
        if lib is not None and getattr(self, "_p", None):
            lib.kvp_free(self._p)
            self._p = None

    @property
    def num_free(self) -> int:
        c = self._c
        return c[0] + c[2] - c[1] - c[3]

    # The counters native.c keeps in c[]: read in place.
    num_plain_free = property(lambda self: self._c[0])
    num_shared = property(lambda self: self._c[4])
    num_allocs = property(lambda self: self._c[5])
    num_evictions = property(lambda self: self._c[6])
    num_frees = property(lambda self: self._c[7])
    num_lost = property(lambda self: self._c[8])

    def take(self, n: int, evicted: array | None = None, hits: array | None = None) -> array:
        out = array("q", bytes(8 * n))
        if evicted is None or n <= self._c[0]:
            got = _LIB.kvp_take(self._p, n, out.buffer_info()[0], None, None)
        else:
            keys = array("Q", bytes(8 * n))
            counts = array("q", bytes(8 * n)) if hits is not None else None
            got = _LIB.kvp_take(self._p, n, out.buffer_info()[0], keys.buffer_info()[0],
                                counts.buffer_info()[0] if counts is not None else None)
            if got > 0:
                evicted += keys[:got]
                if hits is not None and counts is not None:
                    hits += counts[:got]
        if got < 0:
            raise RuntimeError(f"take({n}) with {self.num_free} blocks free")
        return out

    def lookup(self, keys: np.ndarray) -> array:
        keys = _keys(keys)
        out = array("q", bytes(8 * len(keys)))
        del out[_LIB.kvp_lookup(self._p, _addr(keys), len(keys), out.buffer_info()[0]):]
        return out

    def count_free(self, blocks: Blocks) -> int:
        return self._count(blocks, 0)

    def count_alone(self, blocks: Blocks) -> int:
        return self._count(blocks, 1)

    def _count(self, blocks: Blocks, refs: int) -> int:
        if not blocks:
            return 0
        b = _blocks(blocks)
        return _checked(_LIB.kvp_count_refs(self._p, b.buffer_info()[0], len(b), refs))

    def touch(self, blocks: Blocks) -> int:
        if not blocks:
            return 0
        b = _blocks(blocks)
        return _checked(_LIB.kvp_touch(self._p, b.buffer_info()[0], len(b)))

    def cache_placeholders(self, blocks: Blocks) -> None:
        if blocks:
            b = _blocks(blocks)
            _checked(_LIB.kvp_cache_placeholders(self._p, b.buffer_info()[0], len(b)))

    def cache(self, blocks: Blocks, keys: Sequence[int] | np.ndarray, start: int,
              end: int) -> None:
        self._key(blocks[start:end], keys[start:end], False)

    def rekey(self, blocks: Blocks, keys: np.ndarray) -> None:
        self._key(blocks, keys, True)

    def _key(self, blocks: Blocks, keys: Sequence[int] | np.ndarray, rekey: bool) -> None:
        b, k = _blocks(blocks), _keys(keys)
        if len(b) != len(k):
            raise ValueError("one key per block")
        if b:
            got = _LIB.kvp_cache(self._p, b.buffer_info()[0], _addr(k), len(b), rekey)
            if got == -2:
                raise MemoryError("the block pool's key table could not grow")
            _checked(got)

    def set_hits(self, blocks: Blocks, hits: Sequence[int] | np.ndarray) -> None:
        b, h = _blocks(blocks), np.ascontiguousarray(hits, dtype=np.int64)
        if len(b) != len(h):
            raise ValueError("one hit count per block")
        if b:
            _checked(_LIB.kvp_set_hits(self._p, b.buffer_info()[0], _addr(h), len(b)))

    def release(self, blocks: Blocks, num_filled: int) -> int:
        return self._release(_LIB.kvp_release, blocks, num_filled)

    def leak(self, blocks: Blocks, num_filled: int) -> int:
        return self._release(_LIB.kvp_leak, blocks, num_filled)

    def _release(self, fn: ctypes._CFuncPtr, blocks: Blocks, num_filled: int) -> int:
        if not blocks:
            return 0
        b = _blocks(blocks)
        return _checked(fn(self._p, b.buffer_info()[0], len(b), num_filled))


# Block ids: the C pool hands them out as int64 arrays (its tables stay arrays, passed to
# it without conversion); the numpy pool as lists.
Blocks = list[int] | array


def _checked(result: int) -> int:
    if result < 0:
        raise IndexError("a block id outside the pool")
    return result


def _blocks(blocks: Blocks) -> array:
    return blocks if type(blocks) is array else array("q", blocks)


def _keys(keys: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(keys, dtype=np.uint64)


def _addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_LIB: ctypes.CDLL


@cache
def _library() -> ctypes.CDLL | None:
    """The replay's C helpers (``native.c``), or None where they cannot be built here."""
    global _LIB
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib = native_build.optional_library(Path(__file__).with_name("native.c"), {
        "kvp_new": (ptr, [i64, i64, i64]),
        "kvp_free": (None, [ptr]),
        "kvp_counters": (ptr, [ptr]),
        "kvp_take": (i64, [ptr, i64, ptr, ptr, ptr]),
        "kvp_lookup": (i64, [ptr, ptr, i64, ptr]),
        "kvp_count_refs": (i64, [ptr, ptr, i64, i64]),
        "kvp_touch": (i64, [ptr, ptr, i64]),
        "kvp_cache_placeholders": (i64, [ptr, ptr, i64]),
        "kvp_cache": (i64, [ptr, ptr, ptr, i64, i64]),
        "kvp_release": (i64, [ptr, ptr, i64, i64]),
        "kvp_leak": (i64, [ptr, ptr, i64, i64]),
        "kvp_set_hits": (i64, [ptr, ptr, ptr, i64]),
        "kvh_digests": (None, [ptr, ptr, i64, ctypes.c_uint64, i64, ptr, ptr]),
    })
    if lib is not None:
        _LIB = lib
    return lib


def contents_digests(contents: np.ndarray, counts: list[int], vocab_size: int,
                     hasher: BlockHasher) -> np.ndarray:
    """The block digests of the first ``counts[i]`` token ids (a multiple of the block size)
    of each content, given by its key's hash (:func:`~kvbench.workloads.model.key_hash`), one
    after another: ``hasher.digests`` of those ids. In C where it builds, in one pass without
    an array of every token (a Mooncake replay digests millions of prompt tokens), else with
    numpy."""
    if vocab_size < 1:
        raise ValueError(f"a vocabulary of {vocab_size} tokens")
    if _library() is None:
        return hasher.digests(contents_token_ids(contents, counts, vocab_size))
    bases = np.ascontiguousarray(contents, dtype=np.uint64)
    tokens = np.asarray(counts, dtype=np.int64)
    out = np.empty(int(tokens.sum()) // hasher.block_size, dtype=np.uint64)
    _LIB.kvh_digests(_addr(bases), _addr(tokens), len(bases), vocab_size, hasher.block_size,
                     _addr(hasher.weights), _addr(out))
    return out


def new_pool(num_blocks: int, block_size: int, eviction: Eviction = "lru"
             ) -> NativePool | ListPool:
    """The C pool where it builds, else ``BlockPool`` (the same behaviour, slower)."""
    if _library() is not None:
        return NativePool(num_blocks, block_size, eviction == "lfu")
    return ListPool(num_blocks, block_size, eviction)
