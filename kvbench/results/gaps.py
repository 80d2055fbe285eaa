"""The gaps between each request's consecutive output tokens (the ITL samples), held per step
rather than per token.

A request that emits in step ``j`` having emitted in step ``j - 1`` waits the step's length
for it: its gap is ``dt[j]`` (nothing waits between steps while a request runs). So the log
keeps, per step, how many requests did that, and keeps as values only the other gaps: a
request's first token after a preemption, and tokens whose times an engine stamped itself.
A long replay's hundreds of millions of tokens are then a count per step.
"""

from __future__ import annotations

import numpy as np


class GapLog:
    __slots__ = ("_diff", "_first", "samples")

    def __init__(self) -> None:
        # Per step from ``_first`` on (the steps before were dropped: :meth:`drop`), how
        # many more requests' tokens follow on from there than from the step before (a
        # difference array: its running sum is the per-step count).
        self._diff = np.zeros(1024, dtype=np.int64)
        self._first = 0
        self.samples: list[float] = []

    def _room(self, stop: int) -> np.ndarray:
        diff = self._diff
        if stop >= len(diff):
            grown = np.zeros(max(stop + 1, 2 * len(diff)), dtype=np.int64)
            grown[: len(diff)] = diff
            diff = self._diff = grown
        return diff

    def _at(self, step: int) -> int:
        i = step - self._first
        if i < 0:
            raise ValueError(f"gaps at step {step}, dropped up to step {self._first}")
        return i

    def add(self, start: int, stop: int, count: int = 1) -> None:
        """``count`` more requests' tokens followed on at each of steps ``start .. stop-1``."""
        if stop > start and count:
            start, stop = self._at(start), self._at(stop)
            diff = self._room(stop)
            diff[start] += count
            diff[stop] -= count

    def add_many(self, starts: np.ndarray, stops: np.ndarray) -> None:
        """One more request's tokens followed on at each step of every run ``starts[i] ..
        stops[i] - 1``."""
        if len(starts):
            self._at(int(starts.min()))
            diff = self._room(int(stops.max()) - self._first)
            np.add.at(diff, starts - self._first, 1)
            np.add.at(diff, stops - self._first, -1)

    def weights(self, stop: int) -> np.ndarray:
        """How many requests' tokens followed on at each step from the first kept one to
        ``stop - 1``."""
        n = self._at(stop)
        return np.cumsum(self._room(n)[:n])

    def drop(self, n: int) -> np.ndarray:
        """Drop the first ``n`` steps kept; returns their weights (:meth:`weights`)."""
        out = self.weights(self._first + n)
        rest = self._diff[n:].copy()
        if len(out):
            rest[0] += out[-1]
        self._diff, self._first = rest, self._first + n
        return out


def weighted_stats(values: np.ndarray, weights: np.ndarray, percentiles: tuple[int, ...]
                   ) -> tuple[float, list[float]] | None:
    """Mean and percentiles of ``values`` each counted ``weights`` times, as numpy's
    ``mean`` and ``percentile`` (linear interpolation) of the repeated values compute them
    (the mean summed in another order); None when the weights sum to 0."""
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if not len(values):
        return None
    order = np.argsort(values, kind="stable")
    values = values[order]
    counts = np.cumsum(weights[order])
    n = int(counts[-1])
    mean = float((values * weights[order]).sum() / n)

    def at(rank: int) -> np.float64:
        return values[int(np.searchsorted(counts, rank, side="right"))]

    out = []
    for p in percentiles:
        # numpy's virtual index and lerp for the 'linear' method, on the repeated values.
        index = (n - 1) * np.true_divide(p, 100)
        if index >= n - 1:
            out.append(float(at(n - 1)))
            continue
        below = np.floor(index)
        a, b = at(int(below)), at(int(below) + 1)
        gamma = index - below
        diff = b - a
        out.append(float(b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma))
    return mean, out
