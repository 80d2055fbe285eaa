"""The physical blocks of a paged KV cache: reference counts, free queue and prefix-cache index.

Free blocks wait in two queues. Blocks holding no cached content are handed out first (a
stack: bulk pops are one slice). Blocks that still hold a cached full block stay findable by
hash in an eviction queue (:mod:`~kvbench.engines.kv.eviction`: LRU, or LFU by prefix hits)
and are evicted only when no plain block is left; a cache hit on one of them takes it back
out of the queue. Every operation is O(blocks touched)
with a few list/dict steps per block, no per-token work; the bulk steps (a long prompt's
blocks) run as C-level ``map`` loops rather than Python ones.

The event replay uses the same pool (or its C twin, :mod:`~kvbench.engines.sim.replay.pool`)
with two more notions: a block cached under a *placeholder* counts as cached but nothing can
find it until :meth:`BlockPool.rekey` gives it its content's key; and ``take`` can report the
keys of the blocks it evicts.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from itertools import compress, count, repeat, takewhile
from operator import is_, is_not

from kvbench.engines.kv.eviction import Eviction, eviction_queue

_IS_BLOCK = partial(is_not, None)
# Evicted placeholders' keys count down from here: a content's key equals one as rarely as
# two contents' keys collide.
TOP_KEY = (1 << 64) - 1


def _consume(it: Iterator[object]) -> None:
    """Run an iterator of side effects to its end without keeping its values."""
    deque(it, maxlen=0)


def _fill(values: list, indices: list[int], value: object) -> None:
    """``values[i] = value`` for each of ``indices``; a plain loop for the few blocks of a
    decode step, where building a C-level loop would cost more than it saves."""
    if len(indices) < 8:
        for i in indices:
            values[i] = value
    else:
        _consume(map(values.__setitem__, indices, repeat(value)))


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` of ``block_size`` token slots each.

    A block is *shared* while more than one table references it or while its current holder
    got it from a prefix-cache hit (its content serves a second request). ``num_allocs`` counts
    blocks leaving the free queues (fresh, evicted or revived by a hit), ``num_frees`` blocks
    entering them, so ``num_allocs - num_frees`` is the number of blocks not free.
    ``hits[b]`` counts the prefix hits block ``b``'s cached content served (LFU reads it).
    """

    __slots__ = (
        "_by_hash",
        "_free_cached",
        "_free_plain",
        "_hash",
        "_hit",
        "_leaked",
        "block_size",
        "hits",
        "num_allocs",
        "num_blocks",
        "num_evictions",
        "num_frees",
        "num_lost",
        "num_shared",
        "on_evict",
        "placeholder_keys",
        "ref",
    )

    def __init__(self, num_blocks: int, block_size: int, eviction: Eviction = "lru") -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hits = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._hit = [False] * num_blocks
        self._by_hash: dict[int, int] = {}
        # A stack whose top is block 0, so a fresh pool hands out blocks 0, 1, 2, ... in order.
        self._free_plain = list(range(num_blocks - 1, -1, -1))
        self._free_cached = eviction_queue(eviction, self.hits)
        self._leaked: set[int] = set()
        # Told the blocks, keys and hit counts of evicted cached blocks (offload tiers take
        # them).
        self.on_evict: Callable[[list[int], list[int], list[int]], None] | None = None
        self.num_shared = 0
        self.num_allocs = 0
        self.num_evictions = 0
        self.num_frees = 0
        self.num_lost = 0  # leaked blocks no table holds: never free again
        self.placeholder_keys = count(TOP_KEY, -1)

    @property
    def num_free(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_plain_free(self) -> int:
        """Free blocks holding no cached content (taking them evicts nothing)."""
        return len(self._free_plain)

    def take(self, n: int, evicted: array | None = None, hits: array | None = None
             ) -> list[int]:
        """Hand out ``n`` blocks (caller checked ``num_free``), each with one reference.
        With ``evicted``, the key each evicted block cached is appended to it, in eviction
        order (a placeholder's is a key of its own, counting down from :data:`TOP_KEY`), and
        with ``hits`` its prefix hits."""
        plain = self._free_plain
        k = min(n, len(plain))
        out = plain[len(plain) - k :][::-1]
        del plain[len(plain) - k :]
        if k < n:
            out += self.evict(n - k, evicted, hits)
        _fill(self.ref, out, 1)
        self.num_allocs += n
        return out

    def drop(self, blocks: list[int]) -> None:
        """Drop the cached content of free cached ``blocks``, which leave every free queue."""
        for b in blocks:
            self._free_cached.remove(b)
        self._forget(blocks)

    def drain_plain(self) -> list[int]:
        """Take every plain free block out of the free queue: a caller that chooses the
        blocks itself (by large page) holds them and ``claim``s them."""
        out, self._free_plain = self._free_plain, []
        return out

    def claim(self, blocks: list[int]) -> None:
        """Reference ``blocks``, which the caller took out of the free queues."""
        _fill(self.ref, blocks, 1)
        self.num_allocs += len(blocks)

    def evict(self, n: int, keys: array | None = None, hits: array | None = None
              ) -> list[int]:
        """``n`` free cached blocks out of the eviction queue (caller checked there are as
        many), no longer findable and in no free queue: ``take`` hands them out, another
        caller ``claim``s them."""
        evicted = self._free_cached.evict(n)
        if keys is not None:
            ph = self.placeholder_keys
            keys.extend([k if k >= 0 else next(ph) for k in map(self._hash.__getitem__, evicted)])
        if hits is not None:
            hits.extend(map(self.hits.__getitem__, evicted))
        self._forget(evicted)
        return evicted

    def _forget(self, evicted: list[int]) -> None:
        hashes, by_hash = self._hash, self._by_hash
        if self.on_evict is not None:
            self.on_evict(evicted, list(map(hashes.__getitem__, evicted)),
                          list(map(self.hits.__getitem__, evicted)))
        if len(evicted) < 8:
            for b in evicted:
                del by_hash[hashes[b]]
        else:
            _consume(map(by_hash.__delitem__, map(hashes.__getitem__, evicted)))
        _fill(hashes, evicted, None)
        _fill(self.hits, evicted, 0)
        self.num_evictions += len(evicted)

    def cached(self, hashes: Iterable[int]) -> list[int | None]:
        """The block caching each of ``hashes``, None where none does."""
        return list(map(self._by_hash.get, hashes))

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """Blocks caching the longest leading run of ``hashes``."""
        # Asked again every step a long prompt waits for room: kept to C-level loops.
        return list(takewhile(_IS_BLOCK, map(self._by_hash.get, hashes)))

    def count_free(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them consumes free space)."""
        return list(map(self.ref.__getitem__, blocks)).count(0)

    def count_alone(self, blocks: list[int]) -> int:
        """How many of ``blocks`` no other table holds (they go free with this one)."""
        return list(map(self.ref.__getitem__, blocks)).count(1)

    def touch(self, blocks: list[int]) -> int:
        """Reference cached ``blocks`` for a prefix hit; returns how many were free before."""
        ref, hit, hits, cached = self.ref, self._hit, self.hits, self._free_cached
        revived = 0
        for b in blocks:
            r = ref[b]
            if r == 0:
                cached.remove(b)
                revived += 1
            if not hit[b] and r <= 1:
                self.num_shared += 1
            ref[b] = r + 1
            hit[b] = True
            hits[b] += 1
        self.num_allocs += revived
        return revived

    def share(self, blocks: list[int]) -> None:
        """Add a reference to each of ``blocks`` (all in use): a forked table."""
        ref, hit = self.ref, self._hit
        for b in blocks:
            if ref[b] == 1 and not hit[b]:
                self.num_shared += 1
            ref[b] += 1

    def copy_on_write(self, block: int) -> int:
        """A fresh block to replace the shared ``block`` in one table (caller checked room)."""
        new = self.take(1)[0]
        r = self.ref[block] - 1
        self.ref[block] = r
        if r == 1 and not self._hit[block]:
            self.num_shared -= 1
        return new

    def cache(self, blocks: list[int], hashes: list[int], start: int, end: int) -> None:
        """Make full ``blocks[start:end]`` findable by ``hashes[start:end]``.

        A hash already cached by another block keeps that block: the duplicate stays
        unindexed and returns to the plain queue when freed.
        """
        new_hashes, new_blocks = hashes[start:end], blocks[start:end]
        if len(new_hashes) != len(new_blocks):
            raise ValueError("cache() needs one hash per block")
        held = list(map(self._by_hash.setdefault, new_hashes, new_blocks))
        block_hash = self._hash
        if held == new_blocks:  # the common case: every hash was new
            _consume(map(block_hash.__setitem__, new_blocks, new_hashes))
            return
        for h, b, owner in zip(new_hashes, new_blocks, held, strict=True):
            if owner == b:
                block_hash[b] = h

    def set_hits(self, blocks: list[int], hits: Iterable[int]) -> None:
        """Set held ``blocks``' prefix hits (blocks loaded from offload tiers bring theirs)."""
        _consume(map(self.hits.__setitem__, blocks, hits))

    def cache_placeholders(self, blocks: list[int]) -> None:
        """Cache ``blocks`` under placeholders: each under its id's complement, a key below
        zero that no replay lookup asks for (its content keys are uint64 digests)."""
        self.cache(blocks, [~b for b in blocks], 0, len(blocks))

    def rekey(self, blocks: list[int], keys: list[int]) -> None:
        """Give ``blocks`` (held, cached under placeholders) their content's ``keys``, as
        :meth:`cache` would have cached them in the first place."""
        by_hash, block_hash = self._by_hash, self._hash
        for b, k in zip(blocks, keys, strict=True):
            del by_hash[~b]
            block_hash[b] = k if by_hash.setdefault(k, b) == b else None

    def release(self, blocks: list[int], num_filled: int) -> int:
        """Drop one reference to each block of a table whose first ``num_filled`` token slots
        hold KV; returns the filled slots no table references any more.

        Tail blocks are queued first so that, among one sequence's blocks, the ones least
        likely to be shared again (the end, not the common prefix) are evicted first.
        """
        ref, leaked = self.ref, self._leaked
        if not leaked and max(map(ref.__getitem__, blocks), default=0) == 1:
            return self._release_unshared(blocks, num_filled)
        bs = self.block_size
        num_full = num_filled // bs
        hit, block_hash = self._hit, self._hash
        plain, cached = self._free_plain, self._free_cached
        dead_full = dead_tail = unshared = freed = 0
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
            r = ref[b] - 1
            ref[b] = r
            if r:
                if r == 1 and not hit[b]:
                    unshared += 1
                continue
            if hit[b]:
                hit[b] = False
                unshared += 1
            if i < num_full:
                dead_full += 1
            elif i == num_full:
                dead_tail = num_filled - i * bs
            if leaked and b in leaked:
                self.num_lost += 1
                continue
            freed += 1
            if block_hash[b] is None:
                plain.append(b)
            else:
                cached.add(b)
        self.num_shared -= unshared
        self.num_frees += freed
        return dead_full * bs + dead_tail

    def _release_unshared(self, blocks: list[int], num_filled: int) -> int:
        """``release`` of a table no other holds (every reference count 1, nothing leaked),
        the common case: every block goes free, each filled slot dies, and the blocks queue
        in the same order as ``release`` queues them."""
        hit, block_hash = self._hit, self._hash
        num_hit = sum(map(hit.__getitem__, blocks))
        if num_hit:
            _fill(hit, blocks, False)
            self.num_shared -= num_hit
        _fill(self.ref, blocks, 0)
        tail_first = blocks[::-1]
        hashes = list(map(block_hash.__getitem__, tail_first))
        self._free_plain += compress(tail_first, map(is_, hashes, repeat(None)))
        self._free_cached.add_many(compress(tail_first, map(is_not, hashes, repeat(None))))
        self.num_frees += len(blocks)
        return num_filled

    def leak(self, blocks: list[int], num_filled: int) -> int:
        """Like ``release``, but the blocks never return to a free queue (nor serve cache hits):
        the deliberate fault behind ``leak_finished``."""
        by_hash, block_hash = self._by_hash, self._hash
        for b in blocks:
            h = block_hash[b]
            if h is not None:
                del by_hash[h]
                block_hash[b] = None
        self._leaked.update(blocks)
        return self.release(blocks, num_filled)
