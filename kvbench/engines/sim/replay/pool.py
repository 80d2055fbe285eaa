"""The block pool of :class:`~kvbench.engines.kv.block_pool.BlockPool` with LRU eviction,
held in numpy arrays: the replay hands it a prompt's or a finished sequence's blocks in one
call, where per-block Python work would dominate the replay.

It hands out the same block ids, keeps the same keys and counters and evicts in the same
order as ``BlockPool`` (``tests/test_replay_pool.py`` runs both through random operation
sequences and compares them after every call). The differences are internal:

- free blocks holding cached content wait in a FIFO array (least recently freed first); a
  prefix hit that takes one back leaves a hole that eviction skips;
- a key below zero is a placeholder (:mod:`~kvbench.engines.sim.replay.paged`): the block counts
  as cached, but nothing can find it until :meth:`rekey` gives it its content's key.
"""

from __future__ import annotations

import ctypes
from array import array
from collections import deque
from collections.abc import Sequence
from functools import cache, partial
from itertools import count, takewhile
from operator import is_not
from pathlib import Path

import numpy as np

from kvbench.engines.kv.hashing import BlockHasher
from kvbench.workloads.model import contents_token_ids


class ArrayPool:
    __slots__ = (
        "_by_key", "_hit", "_key", "_keys", "_plain", "_plains", "_q", "_qhead", "_qholes",
        "_qpos", "_qposs", "_qs", "_qtail", "_refs", "_state", "_states", "_top",
        "block_size", "num_allocs", "num_blocks", "num_evictions", "num_frees", "num_shared",
        "placeholder_keys", "ref",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        n = num_blocks
        self.num_blocks, self.block_size = n, block_size
        # Per-block state in array.array storage (quick to reach one element from Python, for
        # the few blocks of a decode step) with numpy views of the same memory (for a
        # prompt's or a table's blocks at once): ``x`` and ``xs``.
        self._refs, self.ref = _ints(n)
        self._hit = np.zeros(n, dtype=bool)
        # What a block caches: nothing, content under a placeholder key, or content under
        # its key (in ``_key``, indexed in ``_by_key``).
        self._states = array("b", bytes(n))
        self._state = np.frombuffer(self._states, dtype=np.int8)
        self._keys = array("Q", bytes(8 * n))
        self._key = np.frombuffer(self._keys, dtype=np.uint64)
        self._by_key: dict[int, int] = {}
        # Plain free blocks: a stack whose top (the end) is block 0 in a fresh pool.
        self._plains, self._plain = _ints(n)
        self._plain[:] = np.arange(n - 1, -1, -1)
        self._top = n
        # Cached free blocks, least recently freed first, from _qhead to _qtail; -1 marks a
        # block taken back by a hit. _qpos: each queued block's place.
        self._qs, self._q = _ints(2 * n + 64, -1)
        self._qposs, self._qpos = _ints(n, -1)
        self._qhead = self._qtail = self._qholes = 0
        self.num_shared = self.num_allocs = self.num_evictions = self.num_frees = 0
        self.placeholder_keys = count(_TOP_KEY, -1)

    @property
    def num_free(self) -> int:
        return self._top + self._qtail - self._qhead - self._qholes

    @property
    def num_plain_free(self) -> int:
        return self._top

    def take(self, n: int, evicted: array | None = None) -> list[int]:
        """Hand out ``n`` blocks (the caller checked ``num_free``), each with one reference.
        With ``evicted``, the key each evicted block cached is appended to it, in eviction
        order: a placeholder's is a key of its own, counting down from the top of the key
        space (so the C pool's are the same)."""
        if n <= _FEW:
            return self._take_few(n, evicted)
        k = min(n, self._top)
        top = self._top
        out = self._plain[top - k : top][::-1]
        self._top = top - k
        if k < n:
            evicted_blocks = self._evict(n - k)
            keyed = self._state[evicted_blocks] == _KEYED
            if evicted is not None:
                ph = self.placeholder_keys
                evicted.extend([key if kd else next(ph) for key, kd in zip(
                    self._key[evicted_blocks].tolist(), keyed.tolist(), strict=True)])
            if keyed.any():
                keys = self._key[evicted_blocks[keyed]].tolist()
                deque(map(self._by_key.__delitem__, keys), maxlen=0)
            self._state[evicted_blocks] = _NONE
            self.num_evictions += len(evicted_blocks)
            out = np.concatenate([out, evicted_blocks]) if k else evicted_blocks
        self.ref[out] = 1
        self.num_allocs += n
        return out.tolist()

    def _take_few(self, n: int, evicted: array | None) -> list[int]:
        """:meth:`take` of a few blocks, one at a time."""
        top, plains = self._top, self._plains
        k = min(n, top)
        out = [plains[top - 1 - i] for i in range(k)]
        self._top = top - k
        if k < n:
            q, qpos, states, by_key, keys = (self._qs, self._qposs, self._states, self._by_key,
                                            self._keys)
            head = self._qhead
            for _ in range(n - k):
                b = q[head]
                head += 1
                while b < 0:
                    self._qholes -= 1
                    b = q[head]
                    head += 1
                qpos[b] = -1
                if evicted is not None:
                    evicted.append(keys[b] if states[b] == _KEYED else next(
                        self.placeholder_keys))
                if states[b] == _KEYED:
                    del by_key[keys[b]]
                states[b] = _NONE
                out.append(b)
            self._qhead = head
            self.num_evictions += n - k
        refs = self._refs
        for b in out:
            refs[b] = 1
        self.num_allocs += n
        return out

    def _evict(self, n: int) -> np.ndarray:
        """The ``n`` least recently freed cached blocks, out of the queue."""
        head = self._qhead
        if self._qholes:
            window = self._q[head : head + n + self._qholes]
            live = (window >= 0).nonzero()[0][:n]
            out = window[live]
            passed = int(live[-1]) + 1
            self._qholes -= passed - n
        else:
            out = self._q[head : head + n].copy()
            passed = n
        self._qhead = head + passed
        self._qpos[out] = -1
        return out

    def _queue(self, blocks: np.ndarray) -> None:
        tail, m = self._qtail, len(blocks)
        if tail + m > len(self._q):
            live = self._q[self._qhead : tail]
            live = live[live >= 0]
            self._q[: len(live)] = live
            self._q[len(live) :] = -1
            self._qpos[live] = np.arange(len(live))
            self._qhead, self._qholes, tail = 0, 0, len(live)
        self._q[tail : tail + m] = blocks
        self._qpos[blocks] = np.arange(tail, tail + m)
        self._qtail = tail + m

    def lookup(self, keys: np.ndarray) -> list[int]:
        """Blocks caching the longest leading run of ``keys`` (uint64)."""
        get = self._by_key.get
        if not len(keys) or get(int(keys[0])) is None:
            return []  # the common miss, without converting the rest
        return list(takewhile(_IS_BLOCK, map(get, keys.tolist())))

    def count_free(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them consumes free space)."""
        return int((self.ref[blocks] == 0).sum()) if blocks else 0

    def count_alone(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no other table holds (they go free with this one)."""
        return int((self.ref[blocks] == 1).sum()) if blocks else 0

    def touch(self, blocks: list[int]) -> int:
        """Reference cached ``blocks`` for a prefix hit; returns how many were free before."""
        if not blocks:
            return 0
        b = np.asarray(blocks, dtype=np.int64)
        r = self.ref[b]
        free = b[r == 0]
        if len(free):
            pos = self._qpos[free]
            self._q[pos] = -1
            self._qpos[free] = -1
            self._qholes += len(free)
        self.num_shared += int((~self._hit[b] & (r <= 1)).sum())
        self.ref[b] = r + 1
        self._hit[b] = True
        self.num_allocs += len(free)
        return len(free)

    def cache_placeholders(self, blocks: list[int]) -> None:
        """:meth:`cache` of ``blocks`` under placeholder keys (cached, not findable). A block
        not cached holds no key, so marking it is all there is to do."""
        if len(blocks) <= _FEW:
            states = self._states
            for b in blocks:
                states[b] = _PLACEHOLDER
        else:
            self._state[blocks] = _PLACEHOLDER

    def cache(self, blocks: list[int], keys: Sequence[int] | np.ndarray, start: int,
              end: int) -> None:
        """Make full ``blocks[start:end]`` findable by ``keys[start:end]``; a key another
        block (or an earlier one here) already caches keeps that block, the duplicate
        staying uncached."""
        blocks = blocks[start:end]
        keys = np.asarray(keys[start:end], dtype=np.uint64)
        if len(blocks) != len(keys):
            raise ValueError("cache() needs one key per block")
        held = list(map(self._by_key.setdefault, keys.tolist(), blocks))
        if held != blocks:  # a key another block caches: the duplicate stays uncached
            new = np.asarray([h == b for h, b in zip(held, blocks, strict=True)])
            blocks = [b for b, n in zip(blocks, new.tolist(), strict=True) if n]
            keys = keys[new]
        b = np.asarray(blocks, dtype=np.int64)
        self._key[b] = keys
        self._state[b] = _KEYED

    def rekey(self, blocks: list[int], keys: np.ndarray) -> None:
        """Give ``blocks`` (held, cached under placeholders) their content's ``keys``, as
        :meth:`cache` would have cached them in the first place."""
        by_key = self._by_key
        for b, k in zip(blocks, keys.tolist(), strict=True):
            if by_key.setdefault(k, b) == b:
                self._key[b] = k
                self._state[b] = _KEYED
            else:
                self._state[b] = _NONE

    def release(self, blocks: list[int], num_filled: int) -> int:
        """Drop one reference to each block of a table whose first ``num_filled`` token slots
        hold KV; returns the filled slots no table references any more. Freed blocks queue
        tail first."""
        if not blocks:
            return 0
        b = np.asarray(blocks[::-1], dtype=np.int64)
        r = self.ref[b] - 1
        self.ref[b] = r
        hit = self._hit[b]
        if not r.any():
            dead = b
            self.num_shared -= int(hit.sum())
            filled = num_filled
        else:
            alive = r > 0
            self.num_shared -= int(((r == 1) & ~hit).sum()) + int((hit & ~alive).sum())
            dead = b[~alive]
            bs = self.block_size
            num_full = num_filled // bs
            idx = (len(blocks) - 1) - np.flatnonzero(~alive)
            filled = int((idx < num_full).sum()) * bs
            if num_full < len(blocks) and not alive[len(blocks) - 1 - num_full]:
                filled += num_filled - num_full * bs
        self._hit[dead] = False
        keyed = self._state[dead] != _NONE
        plain = dead[~keyed]
        if len(plain):
            top = self._top
            self._plain[top : top + len(plain)] = plain
            self._top = top + len(plain)
        cached = dead[keyed]
        if len(cached):
            self._queue(cached)
        self.num_frees += len(dead)
        return filled


_NONE, _PLACEHOLDER, _KEYED = 0, 1, 2
# Evicted placeholders' keys count down from here: a content's key equals one as rarely as
# two contents' keys collide.
_TOP_KEY = (1 << 64) - 1
# Up to this many blocks, one at a time in Python beats numpy's cost per call.
_FEW = 8


def _ints(n: int, fill: int = 0) -> tuple[array, np.ndarray]:
    """``n`` int64 of ``fill`` in an array.array, and a numpy view of them."""
    a = array("q", [fill]) * n
    return a, np.frombuffer(a, dtype=np.int64)
_IS_BLOCK = partial(is_not, None)


class NativePool:
    """:class:`ArrayPool` in C (``native.c``): the same blocks, keys, counters and eviction
    order, with the prefix cache's key index in an open-addressing table rather than a dict
    (a Mooncake replay makes millions of key lookups, insertions and deletions). Built with
    the attention kernel's machinery (:mod:`kvbench.kernels.cpu_native`); :func:`new_pool`
    falls back to :class:`ArrayPool` where there is no C compiler."""

    __slots__ = ("_c", "_p", "block_size", "num_blocks")

    def __init__(self, num_blocks: int, block_size: int) -> None:
        lib = _library()
        if lib is None:
            raise RuntimeError("the C block pool did not build")
        self.num_blocks, self.block_size = num_blocks, block_size
        p = lib.kvp_new(num_blocks, block_size)
        if not p:
            raise MemoryError(f"no memory for a pool of {num_blocks} blocks")
        self._p = p
        self._c = (ctypes.c_int64 * 8).from_address(lib.kvp_counters(p))

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

    def take(self, n: int, evicted: array | None = None) -> array:
        out = array("q", bytes(8 * n))
        if evicted is None or n <= self._c[0]:
            got = _LIB.kvp_take(self._p, n, out.buffer_info()[0], None)
        else:
            keys = array("Q", bytes(8 * n))
            got = _LIB.kvp_take(self._p, n, out.buffer_info()[0], keys.buffer_info()[0])
            if got > 0:
                evicted += keys[:got]
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

    def release(self, blocks: Blocks, num_filled: int) -> int:
        if not blocks:
            return 0
        b = _blocks(blocks)
        return _checked(_LIB.kvp_release(self._p, b.buffer_info()[0], len(b), num_filled))


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
    from kvbench.kernels import cpu_native

    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib = cpu_native.optional_library(Path(__file__).with_name("native.c"), {
        "kvp_new": (ptr, [i64, i64]),
        "kvp_free": (None, [ptr]),
        "kvp_counters": (ptr, [ptr]),
        "kvp_take": (i64, [ptr, i64, ptr, ptr]),
        "kvp_lookup": (i64, [ptr, ptr, i64, ptr]),
        "kvp_count_refs": (i64, [ptr, ptr, i64, i64]),
        "kvp_touch": (i64, [ptr, ptr, i64]),
        "kvp_cache_placeholders": (i64, [ptr, ptr, i64]),
        "kvp_cache": (i64, [ptr, ptr, ptr, i64, i64]),
        "kvp_release": (i64, [ptr, ptr, i64, i64]),
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


def new_pool(num_blocks: int, block_size: int) -> NativePool | ArrayPool:
    """The C pool where it builds, else the numpy one (the same behaviour, slower)."""
    if _library() is not None:
        return NativePool(num_blocks, block_size)
    return ArrayPool(num_blocks, block_size)
