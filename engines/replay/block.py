"""What a run of steps replayed in one go reports: every step's values (as one step after
another would report them) and what happened to requests, stamped with the step or time
the harness would have logged it at; and the arrivals the replay feeds in as it goes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory, Finished, KVStats
from kvbench.workloads.model import Request

# The KVStats fields a step log keeps, in the order of a step's values.
KV_FIELDS = (
    "capacity_bytes", "reserved_bytes", "used_bytes", "reserved_ahead_bytes", "free_bytes",
    "largest_free_bytes", "shared_bytes", "prefix_hit_tokens", "block_allocs", "block_frees",
    "copied_bytes", "page_table_entries", "refused_bytes", "refused_free_bytes",
    "refused_largest_free_bytes", "encoder_cache_bytes",
)
# A step's values: its end time and length, batch and queue sizes, its KVStats fields, the
# used KV bytes of each modality (None where not attributable) and the device memory
# components (summed over ranks).
COLUMNS = (
    "t_s", "dt_s", "num_tokens", "running", "waiting", "preempted", *KV_FIELDS,
    "modality:text", "modality:image", "modality:audio",
    *(f"device:{name}" for name in DeviceMemory.COMPONENTS),
)
INDEX = {name: i for i, name in enumerate(COLUMNS)}


@dataclass(slots=True)
class Arrivals:
    """The requests of one wave as the harness sends them: ``requests[idx:]`` not sent yet,
    ``in_flight`` sent and not ended, at most ``limit`` at once; with ``send_late``, a
    request held back by the limit counts from when it is sent (its arrival moved there)."""

    requests: list[Request]
    limit: int
    send_late: bool = False
    idx: int = 0
    in_flight: int = 0

    def due(self) -> float:
        """When the next request will be sent if nothing ends first (inf: not before one
        ends, or none left)."""
        if self.idx < len(self.requests) and self.in_flight < self.limit:
            return self.requests[self.idx].arrival_s
        return np.inf


@dataclass(slots=True)
class StepBlock:
    """Steps ``first_step .. first_step + steps - 1``.

    After :meth:`close`, ``columns`` holds every step's values by :data:`COLUMNS` name (an
    array or list per column). Request events: ``sent`` (requests sent later than they
    arrived, with their arrival moved to then); ``runs`` (request id, first step, stop step)
    of consecutive steps that each emitted one of its tokens; ``scheduled`` (id, the start
    time of the step that first scheduled it); ``first_tokens`` (id, end time of the step
    that emitted its first token); ``finished`` (what ended, its step's end time,
    rejections included); ``preempted`` (one id per preemption); ``ended`` (step, requests
    that ended in it). ``error`` is what stopped the replay after the steps here (device out
    of memory, an interrupt): the caller logs the steps, then raises it."""

    first_step: int
    t_end: float
    steps: int = 0
    bulk_steps: int = 0
    columns: dict[str, np.ndarray | list[Any]] = field(default_factory=dict)
    sent: list[Request] = field(default_factory=list)
    runs: list[tuple[str, int, int]] = field(default_factory=list)
    scheduled: list[tuple[str, float]] = field(default_factory=list)
    first_tokens: list[tuple[str, float]] = field(default_factory=list)
    finished: list[tuple[Finished, float]] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    ended: list[tuple[int, int]] = field(default_factory=list)
    last_kv: KVStats | None = None
    device_ranks: int = 1
    error: BaseException | None = None
    # Segments of steps: each one's values at its first step and its length; and per column,
    # where segments along which it varies start and their values.
    _rows: list[tuple[Any, ...]] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    _varying: dict[int, tuple[list[int], list[np.ndarray]]] = field(default_factory=dict)

    def row(self, values: tuple[Any, ...]) -> None:
        """One step's values, in :data:`COLUMNS` order."""
        self._rows.append(values)
        self._lengths.append(1)
        self.steps += 1

    def stretch(self, values: tuple[Any, ...], steps: int, varying: dict[int, Any]) -> None:
        """``steps`` steps taken in one go: every column holds its value in ``values`` at
        each of them but those in ``varying`` (by column index), which hold one per step."""
        by_column = self._varying
        for i, v in varying.items():
            entry = by_column.get(i)
            if entry is None:
                entry = by_column[i] = ([], [])
            entry[0].append(self.steps)
            entry[1].append(v)
        self._rows.append(values)
        self._lengths.append(steps)
        self.steps += steps
        self.bulk_steps += steps

    def close(self) -> StepBlock:
        """Build ``columns`` from the segments."""
        if not self._rows:
            return self
        lengths = np.asarray(self._lengths, dtype=np.int64)
        out: list[Any] = []
        for values in zip(*self._rows, strict=True):
            if None in values:
                col = np.repeat(np.asarray(values, dtype=object), lengths)
            else:
                col = np.repeat(np.asarray(values), lengths)
            out.append(col)
        for i, (starts, arrays) in self._varying.items():
            values = np.concatenate(arrays)
            n = np.fromiter(map(len, arrays), np.int64, len(arrays))
            # Each value's step: its segment's start plus its place in the segment.
            at = np.arange(len(values)) + np.repeat(np.asarray(starts) - (np.cumsum(n) - n), n)
            out[i][at] = values
        self.columns = {name: col.tolist() if col.dtype == object else col
                        for name, col in zip(COLUMNS, out, strict=True)}
        self._rows, self._lengths, self._varying = [], [], {}
        return self
