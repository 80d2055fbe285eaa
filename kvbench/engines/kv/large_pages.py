"""Block pools of several block sizes sharing one KV budget, as Jenga carves it: the budget
is cut into large pages whose size is the least common multiple of the pools' block sizes,
and a pool takes a whole large page at a time, carving it into its own blocks.

A large page belongs to one pool while any of its blocks is referenced (*active*) or holds
cached content (*idle*); once neither, it returns to the free pages. A pool hands out:

1. plain free blocks of its active pages, so partly used pages fill first, the page of the
   sequence's last block before others (Jenga's request-aware allocation);
2. a free large page, then the least recently idle page of any pool, whose cached blocks
   are evicted;
3. its own cached blocks in its active pages, a page's together: the sequence's page
   first, then the page of the block its eviction queue gives up first (no idle page is
   then left anywhere).

The free blocks of a pool's active pages are memory no other pool can use: the
fragmentation per-group pools pay for their page sizes. :class:`OnePool` is the same
interface over a single pool of equal blocks, where there is nothing to carve.
"""

from __future__ import annotations

from kvbench.engines.kv.block_pool import BlockPool


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class OnePool:
    """One pool of equal blocks: a block is the unit, and taking one evicts by the pool's
    eviction queue when no plain block is left."""

    def __init__(self, pool: BlockPool, block_bytes: int) -> None:
        self.pools, self.block_bytes = [pool], [block_bytes]
        self.budget = pool.num_blocks * block_bytes

    def room(self, needs: list[int], hits: list[list[int]]) -> bool:
        """Whether ``needs[i]`` fresh blocks fit once ``hits[i]`` are referenced."""
        pool = self.pools[0]
        return sum(needs) + sum(map(pool.count_free, hits)) <= pool.num_free

    def take(self, i: int, n: int, near: int = -1) -> list[int]:
        return self.pools[0].take(n) if n else []

    def touch(self, i: int, blocks: list[int]) -> int:
        return self.pools[0].touch(blocks)

    def release(self, i: int, blocks: list[int], filled: int) -> int:
        return self.pools[0].release(blocks, filled)

    def reserved_bytes(self) -> int:
        pool = self.pools[0]
        return (pool.num_blocks - pool.num_free) * self.block_bytes[0]

    def free_bytes(self) -> int:
        return self.pools[0].num_free * self.block_bytes[0]

    largest_free_bytes = free_bytes


class LargePages:
    """Pools carving large pages of ``page_bytes`` (a multiple of each pool's block bytes);
    pool ``i``'s block ``b`` lies in page ``b // per[i]``. The pools' own free queues
    stay empty: plain free blocks are kept here, by page."""

    def __init__(self, pools: list[BlockPool], block_bytes: list[int], page_bytes: int) -> None:
        self.pools, self.block_bytes, self.page_bytes = pools, block_bytes, page_bytes
        self.per = [page_bytes // b for b in block_bytes]
        n = pools[0].num_blocks // self.per[0]
        self.budget = n * page_bytes
        self.owner = [-1] * n
        self.refd = [0] * n  # blocks of the owner referenced
        self.cached = [0] * n  # free blocks of the owner holding cached content
        self.plain: list[list[int]] = [[] for _ in range(n)]  # owner's plain free blocks
        self.free_pages = list(range(n - 1, -1, -1))
        self.idle: dict[int, None] = {}  # least recently idle first
        self.open: list[dict[int, None]] = [{} for _ in pools]  # active pages with plain
        self.plain_active = [0] * len(pools)
        self.cached_active = [0] * len(pools)
        for p in pools:
            p.drain_plain()

    def room(self, needs: list[int], hits: list[list[int]]) -> bool:
        """Whether ``needs[i]`` fresh blocks of each pool fit once ``hits[i]`` are
        referenced, taken in pool order as :meth:`take` takes them."""
        plain, cached = list(self.plain_active), list(self.cached_active)
        pages = len(self.free_pages) + len(self.idle)
        woken: set[int] = set()
        for i, blocks in enumerate(hits):
            ref, per = self.pools[i].ref, self.per[i]
            for b in blocks:
                if ref[b]:
                    continue
                p = b // per
                if p in self.idle and p not in woken:
                    woken.add(p)
                    pages -= 1
                    plain[i] += len(self.plain[p])
                    cached[i] += self.cached[p]
                cached[i] -= 1
        for i, n in enumerate(needs):
            short = n - plain[i]
            if short <= 0:
                continue
            got = min(pages, _cdiv(short, self.per[i]))
            pages -= got
            short -= got * self.per[i]
            if short > cached[i]:
                return False
            cached[i] -= max(short, 0)
        return True

    def take(self, i: int, n: int, near: int = -1) -> list[int]:
        """``n`` blocks of pool ``i``, each with one reference (the caller checked room),
        from block ``near``'s page first: a sequence's blocks kept together free together."""
        out: list[int] = []
        refd, opened = self.refd, self.open[i]
        hint = near // self.per[i] if near >= 0 else -1
        while len(out) < n:
            if opened:
                p = hint if hint in opened else next(iter(opened))
                blocks = self.plain[p]
                k = min(n - len(out), len(blocks))
                got = blocks[len(blocks) - k :][::-1]
                del blocks[len(blocks) - k :]
                self.pools[i].claim(got)  # referenced now: no longer this page's free blocks
                out += got
                if not blocks:
                    del opened[p]
                self.plain_active[i] -= k
                refd[p] += k
            elif self.free_pages or self.idle:
                self._own(i, self.free_pages.pop() if self.free_pages else self._reclaim())
            else:  # no idle page anywhere: every cached block is in an active page
                hint = self._evict_page(i, hint)
        return out

    def _evict_page(self, i: int, p: int) -> int:
        """Evict every cached block of one of pool ``i``'s active pages, page ``p`` if it
        has any, else the page of the block the eviction queue gives up first; return the
        page. Evicting a page's blocks together lets it fall idle together (Jenga)."""
        pool, per = self.pools[i], self.per[i]
        first: list[int] = []
        if not (p >= 0 and self.owner[p] == i and self.cached[p]):
            first = pool.evict(1)
            p = first[0] // per
        plain = set(self.plain[p]).union(first)
        rest = [b for b in range(p * per, (p + 1) * per) if not pool.ref[b] and b not in plain]
        pool.drop(rest)
        freed = first + rest
        self.plain[p] += freed
        self.open[i][p] = None
        self.cached[p] -= len(freed)
        self.cached_active[i] -= len(freed)
        self.plain_active[i] += len(freed)
        return p

    def _own(self, i: int, p: int) -> None:
        per = self.per[i]
        self.owner[p] = i
        self.plain[p] = list(range((p + 1) * per - 1, p * per - 1, -1))
        self.open[i][p] = None
        self.plain_active[i] += per

    def _reclaim(self) -> int:
        """Free the least recently idle page, evicting its owner's cached blocks in it."""
        p = next(iter(self.idle))
        del self.idle[p]
        j, per = self.owner[p], self.per[self.owner[p]]
        plain = set(self.plain[p])
        self.pools[j].drop([b for b in range(p * per, (p + 1) * per) if b not in plain])
        self.owner[p], self.cached[p], self.plain[p] = -1, 0, []
        return p

    def touch(self, i: int, blocks: list[int]) -> int:
        """Reference cached ``blocks`` of pool ``i`` for a prefix hit (``BlockPool.touch``)."""
        pool, per = self.pools[i], self.per[i]
        revived = [b for b in blocks if not pool.ref[b]]
        for b in revived:
            p = b // per
            if p in self.idle:
                self._wake(i, p)
            self.cached[p] -= 1
            self.refd[p] += 1
        self.cached_active[i] -= len(revived)
        return pool.touch(blocks)

    def _wake(self, i: int, p: int) -> None:
        del self.idle[p]
        self.cached_active[i] += self.cached[p]
        if self.plain[p]:
            self.open[i][p] = None
            self.plain_active[i] += len(self.plain[p])

    def release(self, i: int, blocks: list[int], filled: int) -> int:
        """Drop a reference to each of ``blocks`` (``BlockPool.release``); pages none of
        whose blocks is referenced any more go idle, or free when nothing is cached."""
        pool, per = self.pools[i], self.per[i]
        last = [b for b in blocks if pool.ref[b] == 1]
        dead = pool.release(blocks, filled)
        plain = pool.drain_plain()
        for b in plain:
            p = b // per
            self.plain[p].append(b)
            self.open[i][p] = None
        now_cached = set(last).difference(plain)
        for b in now_cached:
            self.cached[b // per] += 1
        self.plain_active[i] += len(plain)
        self.cached_active[i] += len(now_cached)
        pages = set()
        for b in last:
            p = b // per
            self.refd[p] -= 1
            pages.add(p)
        for p in sorted(pages):
            if not self.refd[p]:
                self._sleep(i, p)
        return dead

    def _sleep(self, i: int, p: int) -> None:
        self.open[i].pop(p, None)
        self.plain_active[i] -= len(self.plain[p])
        self.cached_active[i] -= self.cached[p]
        if self.cached[p]:
            self.idle[p] = None
        else:
            self.owner[p], self.plain[p] = -1, []
            self.free_pages.append(p)

    def reserved_bytes(self) -> int:
        """Bytes of referenced blocks."""
        return sum((p.num_allocs - p.num_frees) * b
                   for p, b in zip(self.pools, self.block_bytes, strict=True))

    def largest_free_bytes(self) -> int:
        """Bytes every pool can take: free and idle pages."""
        return (len(self.free_pages) + len(self.idle)) * self.page_bytes

    def free_bytes(self) -> int:
        """Bytes some pool can take: free and idle pages, and the free blocks of active
        pages (for their own pool only)."""
        return self.largest_free_bytes() + sum(
            (p + c) * b for p, c, b in zip(self.plain_active, self.cached_active,
                                          self.block_bytes, strict=True))
