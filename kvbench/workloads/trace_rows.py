"""Checks every trace importer applies to its rows, with errors naming the file and line.

A trace row's lengths must pass ``limits.request_problem``. Its timestamp becomes an arrival
relative to the earliest row; if the rows span more than ``limits.MAX_ARRIVAL_S`` (366
days), the import is refused, naming the outlying row: of the earliest and the latest row,
the one farther from the median time (one 1900 timestamp among 2023 ones names the 1900
row). Refusing, rather than capping the gap, keeps every imported arrival a real one.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.errors import InputFileError
from kvbench.workloads.limits import MAX_ARRIVAL_S, request_problem
from kvbench.workloads.model import Request


@dataclass(slots=True)
class TraceRead:
    """What an importer read: requests in file order, facts for the workload's spec (e.g.
    rows skipped or adjusted) and warnings for the caller to print."""

    requests: list[Request]
    facts: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def int_field(value: Any, what: str, lowest: int, path: Path, line: int) -> int:
    """``value`` as an int >= ``lowest``, else an error naming the file and line."""
    number = value
    if isinstance(value, str):
        digits = value.strip()
        number = int(digits) if digits.removeprefix("-").isdecimal() else None
    # type() rather than isinstance(): JSON true/false are bools, which are ints to Python.
    if type(number) is not int or number < lowest:
        raise InputFileError(path, f"{what} must be an integer >= {lowest} (got {value!r})", line)
    return number


def check_lengths(prompt: int, output: int, path: Path, line: int) -> None:
    problem = request_problem(prompt, output)
    if problem is not None:
        raise InputFileError(path, f"{problem}; fix or delete this row", line)


def _duration(seconds: float) -> str:
    days = seconds / 86_400
    return f"{days / 365.25:,.1f} years" if days > 730 else f"{days:,.1f} days"


class TraceTimes:
    """Row timestamps in the trace's own unit, turned into seconds from the earliest row."""

    def __init__(self, path: Path, units_per_s: float, show: Callable[[Any], str]) -> None:
        self.path = path
        self.units_per_s = units_per_s
        self.show = show
        self.times: list[Any] = []
        self.lines = array("q")  # only for messages: kept compact

    def add(self, t: Any, line: int) -> None:
        self.times.append(t)
        self.lines.append(line)

    def arrivals_s(self) -> list[float]:
        """``(t - earliest) / units_per_s`` per row, once the span is checked."""
        times = self.times
        if not times:
            return []
        t0, t1 = min(times), max(times)
        if (t1 - t0) / self.units_per_s > MAX_ARRIVAL_S:
            median = float(np.median(np.asarray(times, dtype=np.float64)))
            odd = t0 if median - t0 > t1 - median else t1
            side = "before" if odd == t0 else "after"
            gap_s = abs(odd - median) / self.units_per_s
            raise InputFileError(
                self.path,
                f"time {self.show(odd)} lies {_duration(gap_s)} {side} the trace's median row; "
                f"a trace may span at most {MAX_ARRIVAL_S / 86_400:.0f} days, and replaying "
                "this one would wait that long: fix or delete this row",
                self.lines[times.index(odd)],
            )
        scale = self.units_per_s
        return [(t - t0) / scale for t in times]
