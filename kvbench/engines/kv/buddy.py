"""A buddy allocator of pages in several sizes over one array of units.

Physical memory is ``num_units`` units (the smallest page). A page of order ``k`` is a
naturally aligned run of ``ratio**k`` units: it starts at a multiple of its size. A request
for an order with no free page splits the smallest larger free page into ``ratio`` children
(repeatedly), and a freed page whose ``ratio - 1`` siblings are all free coalesces with them
into their parent (repeatedly), so free memory always sits in the largest aligned pages it
can. Units past the last whole page of the top order start as smaller aligned pages.

Free pages of each order wait in an insertion-ordered dict (O(1) push, pop and removal of a
sibling), so taking or returning a page costs O(orders). The longest run of adjacent free
top-order pages is kept in a segment tree, O(log pages) per change: it is the buddy pool's
"largest free extent".
"""

from __future__ import annotations


class _RunTree:
    """Longest run of consecutive set flags among ``n`` flags. Flag changes are applied to
    the tree when the longest run is next asked for, each changed node's ancestors once."""

    __slots__ = ("_best", "_dirty", "_pre", "_size", "_suf", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        size = 1
        while size < max(n, 1):
            size *= 2
        self._size = size
        # Per node: longest run starting at its left edge, ending at its right edge, anywhere.
        self._pre = [0] * (2 * size)
        self._suf = [0] * (2 * size)
        self._best = [0] * (2 * size)
        self._dirty: set[int] = set()

    @property
    def longest(self) -> int:
        if self._dirty:
            self._flush()
        return self._best[1]

    def set(self, i: int, value: bool) -> None:
        node = self._size + i
        v = int(value)
        self._pre[node] = self._suf[node] = self._best[node] = v
        self._dirty.add(node // 2)

    def _flush(self) -> None:
        pre, suf, best = self._pre, self._suf, self._best
        nodes, width = self._dirty, 1
        while nodes:
            parents = set()
            for node in nodes:
                left, right = 2 * node, 2 * node + 1
                pre[node] = pre[left] + pre[right] if pre[left] == width else pre[left]
                suf[node] = suf[right] + suf[left] if suf[right] == width else suf[right]
                best[node] = max(best[left], best[right], suf[left] + pre[right])
                if node > 1:
                    parents.add(node // 2)
            nodes, width = parents, width * 2
        self._dirty = set()


class BuddyPool:
    """Pages of orders ``0 .. top`` (``ratio**k`` units each) over ``num_units`` units.

    ``splits`` counts pages split into children, ``coalesces`` groups of siblings joined
    back into their parent. Callers hand back exactly the pages they took (start, order),
    or a page formed of ``ratio`` adjacent taken siblings (see ``can_join``).
    """

    __slots__ = ("_free", "_runs", "coalesces", "free_units", "num_units", "ratio",
                 "sizes", "splits", "top")

    def __init__(self, num_units: int, ratio: int, top: int) -> None:
        if num_units < 1 or ratio < 2 or top < 0:
            raise ValueError("a buddy pool needs units, a ratio of at least 2 and orders")
        self.num_units = num_units
        self.ratio = ratio
        self.top = top
        self.sizes = [ratio**k for k in range(top + 1)]
        self._free: list[dict[int, None]] = [{} for _ in range(top + 1)]
        self._runs = _RunTree(num_units // self.sizes[top])
        self.free_units = 0
        self.splits = 0
        self.coalesces = 0
        pages: list[tuple[int, int]] = []
        start = 0
        while start < num_units:
            k = top
            while start % self.sizes[k] or start + self.sizes[k] > num_units:
                k -= 1
            pages.append((start, k))
            start += self.sizes[k]
        # Each order's dict pops its newest entry: push in reverse so low addresses go first.
        for start, k in reversed(pages):
            self._push(start, k)

    def free_pages(self, order: int) -> int:
        return len(self._free[order])

    @property
    def largest_free_run_units(self) -> int:
        """Units in the longest run of adjacent free top-order pages."""
        return self._runs.longest * self.sizes[self.top]

    def max_free_order(self) -> int:
        """The largest order with a free page, or -1 when nothing is free."""
        for k in range(self.top, -1, -1):
            if self._free[k]:
                return k
        return -1

    def take(self, order: int) -> int | None:
        """Start unit of a free page of ``order``, splitting a larger one if needed; None
        when no page of ``order`` or larger is free."""
        k = order
        while k <= self.top and not self._free[k]:
            k += 1
        if k > self.top:
            return None
        start = self._pop(k)
        self._split_down(start, k, order)
        return start

    def give(self, start: int, order: int, keep_split: int = 0) -> None:
        """Return the page ``(start, order)``, coalescing it with free siblings, except that
        order-0 pages stay split while at most ``keep_split`` of them are free."""
        k = order
        while k < self.top:
            size, parent_size = self.sizes[k], self.sizes[k + 1]
            parent = start - start % parent_size
            if parent + parent_size > self.num_units:
                break
            free = self._free[k]
            siblings = [parent + i * size for i in range(self.ratio) if parent + i * size != start]
            if not all(s in free for s in siblings):
                break
            if k == 0 and len(free) - len(siblings) < keep_split:
                break
            for s in siblings:
                self._remove(s, k)
            start, k = parent, k + 1
            self.coalesces += 1
        self._push(start, k)

    def split_one(self, order: int) -> bool:
        """Split one free page of the smallest order above ``order`` down to free pages of
        ``order`` (pre-splitting ahead of demand); False when there is none."""
        k = order + 1
        while k <= self.top and not self._free[k]:
            k += 1
        if k > self.top:
            return False
        start = self._pop(k)
        self._split_down(start, k, order)
        self._push(start, order)
        return True

    def can_join(self, starts: list[int], order: int) -> bool:
        """Whether pages ``starts`` of ``order``, in this order, are the ``ratio`` aligned
        siblings of one page of ``order + 1``."""
        size = self.sizes[order]
        first = starts[0]
        return (
            len(starts) == self.ratio
            and first % self.sizes[order + 1] == 0
            and all(s == first + i * size for i, s in enumerate(starts))
        )

    def _split_down(self, start: int, order: int, target: int) -> None:
        """Split the taken page ``(start, order)`` until its first child has ``target``;
        the other children go free (pushed high to low, so low addresses pop first)."""
        while order > target:
            order -= 1
            size = self.sizes[order]
            for i in range(self.ratio - 1, 0, -1):
                self._push(start + i * size, order)
            self.splits += 1

    def _push(self, start: int, order: int) -> None:
        self._free[order][start] = None
        self.free_units += self.sizes[order]
        if order == self.top:
            self._runs.set(start // self.sizes[order], True)

    def _pop(self, order: int) -> int:
        start, _ = self._free[order].popitem()
        self._taken(start, order)
        return start

    def _remove(self, start: int, order: int) -> None:
        del self._free[order][start]
        self._taken(start, order)

    def _taken(self, start: int, order: int) -> None:
        self.free_units -= self.sizes[order]
        if order == self.top:
            self._runs.set(start // self.sizes[order], False)
