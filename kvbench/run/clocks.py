"""Clocks for the harness.

``wall``: real time; latencies are what the engine really took. ``virtual``: time advances
by the cost model's predicted step time, so arrivals interleave with steps identically on
any machine and memory/concurrency curves can be gated exactly.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from kvbench.engines.base import StepReport
from kvbench.engines.sim.costmodel import CostModel

CLOCKS = ("wall", "virtual")


class Clock(ABC):
    name: str

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def now(self) -> float:
        """Seconds since start."""

    @abstractmethod
    def wait_until(self, t: float) -> None:
        """Idle until time ``t`` (nothing to run before the next arrival)."""

    @abstractmethod
    def after_step(self, report: StepReport) -> None:
        """Account for a finished step (the virtual clock advances by its predicted time)."""

    @abstractmethod
    def at_perf(self, perf_s: float) -> float:
        """The clock time of a ``time.perf_counter()`` reading (an engine's event stamp)."""


class WallClock(Clock):
    name = "wall"

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def wait_until(self, t: float) -> None:
        delay = t - self.now()
        if delay > 0:
            time.sleep(delay)

    def after_step(self, report: StepReport) -> None:
        """Real time has already passed."""

    def at_perf(self, perf_s: float) -> float:
        return perf_s - self._t0


class VirtualClock(Clock):
    name = "virtual"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._t = 0.0
        # Of the time added: what steps waited on loads from offload tiers.
        self.load_stall_s = 0.0

    def start(self) -> None:
        self._t = 0.0
        self.load_stall_s = 0.0

    def now(self) -> float:
        return self._t

    def wait_until(self, t: float) -> None:
        self._t = max(self._t, t)

    def after_step(self, report: StepReport) -> None:
        if report.elapsed_s is not None:
            self._t += report.elapsed_s
        else:
            self._t += self.cost.step_time_s(report.batch)
            if report.batch.load_s:
                self.load_stall_s += self.cost.load_stall_s(report.batch)

    def advance_to(self, t: float) -> None:
        """Set the time to ``t``: the end of steps taken in one go, each step's time added
        one after another as :meth:`after_step` adds them."""
        self._t = t

    def at_perf(self, perf_s: float) -> float:
        raise RuntimeError(
            "an engine stamped its events in real time, which the virtual clock does not "
            "keep: run it with --clock wall"
        )
