"""Free space of a linear arena: sorted, coalesced holes, first-fit or best-fit placement."""

from __future__ import annotations

from bisect import bisect_left
from typing import Literal

Fit = Literal["first", "best"]
FITS: tuple[str, ...] = ("first", "best")


class Arena:
    """Holes ``[starts[i], starts[i] + lengths[i])`` in address order, never adjacent.

    Scans are linear in the number of holes, which is at most one more than the number of
    live extents (a few hundred), so no cleverer index pays off.
    """

    __slots__ = ("_largest", "_lengths", "_starts", "fit", "size")

    def __init__(self, size: int, fit: Fit) -> None:
        self.size = size
        self.fit = fit
        self._starts = [0]
        self._lengths = [size]
        # The largest hole, or None when a take may have shrunk it (found again on demand).
        self._largest: int | None = size

    def copy(self) -> Arena:
        out = Arena(self.size, self.fit)
        out._starts = list(self._starts)
        out._lengths = list(self._lengths)
        out._largest = self._largest
        return out

    @property
    def holes(self) -> list[tuple[int, int]]:
        """(start, length) of each hole in address order."""
        return list(zip(self._starts, self._lengths, strict=True))

    @property
    def total_free(self) -> int:
        return sum(self._lengths)

    @property
    def largest(self) -> int:
        if self._largest is None:
            self._largest = max(self._lengths, default=0)
        return self._largest

    def take(self, length: int) -> int | None:
        """Start of a new extent of ``length`` carved from the front of a hole, or None."""
        lengths = self._lengths
        if self.fit == "first":
            i = next((i for i, n in enumerate(lengths) if n >= length), None)
        else:
            # Best fit: smallest hole that fits, lowest address among equals.
            fits = [i for i, n in enumerate(lengths) if n >= length]
            i = min(fits, key=lengths.__getitem__) if fits else None
        if i is None:
            return None
        start = self._starts[i]
        if lengths[i] == self._largest:
            self._largest = None
        if lengths[i] == length:
            del self._starts[i], lengths[i]
        else:
            self._starts[i] += length
            lengths[i] -= length
        return start

    def take_top(self, n: int) -> list[int]:
        """The ``n`` highest free slots, highest first (single blocks kept away from the low
        end, where first fit places extents); fewer when not that many are free."""
        out: list[int] = []
        starts, lengths = self._starts, self._lengths
        while len(out) < n and starts:
            k = min(n - len(out), lengths[-1])
            if lengths[-1] == self._largest:
                self._largest = None
            end = starts[-1] + lengths[-1]
            out += range(end - 1, end - 1 - k, -1)
            lengths[-1] -= k
            if not lengths[-1]:
                del starts[-1], lengths[-1]
        return out

    def give(self, start: int, length: int) -> None:
        """Return ``[start, start + length)`` to the free space, merging with neighbours."""
        starts, lengths = self._starts, self._lengths
        i = bisect_left(starts, start)
        overlaps_prev = i > 0 and starts[i - 1] + lengths[i - 1] > start
        overlaps_next = i < len(starts) and start + length > starts[i]
        if overlaps_prev or overlaps_next:
            raise RuntimeError(f"range [{start}, {start + length}) is already free")
        merge_prev = i > 0 and starts[i - 1] + lengths[i - 1] == start
        merge_next = i < len(starts) and start + length == starts[i]
        if merge_prev and merge_next:
            lengths[i - 1] += length + lengths[i]
            del starts[i], lengths[i]
            grown = lengths[i - 1]
        elif merge_prev:
            lengths[i - 1] += length
            grown = lengths[i - 1]
        elif merge_next:
            starts[i] = start
            lengths[i] += length
            grown = lengths[i]
        else:
            starts.insert(i, start)
            lengths.insert(i, length)
            grown = length
        if self._largest is not None and grown > self._largest:
            self._largest = grown

    def reset(self, used_end: int) -> None:
        """Everything below ``used_end`` is taken, everything above free (after compaction)."""
        self._starts = [used_end] if used_end < self.size else []
        self._lengths = [self.size - used_end] if used_end < self.size else []
        self._largest = self.size - used_end
