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
    of consecutive steps here that each emitted one of its tokens, in step order per
    request; ``scheduled`` (id, the start
    time of the step that first scheduled it); ``first_tokens`` (id, end time of the step
    that emitted its first token); ``finished`` (what ended, its step's end time,
    rejections included); ``preempted`` (one id per preemption); ``ended`` (step, requests
    that ended in it). ``error`` is what stopped the replay after the steps here (device out
    of memory, an interrupt): the caller logs the steps, then raises it.

    Steps are held as segments until :meth:`close`: a step with events is one segment of
    its values; a stretch of decode steps (:meth:`stretch`) is its values before its first
    step and what changes along it, from which every column is built for the whole block
    at once. The block starts at ``t_start``; ``token_bytes`` and ``page_bytes`` are the KV
    bytes of a token and of a page. With offload tiers (``tiers``, their kinds), each step
    also has the bytes each tier holds (``offload:<kind>`` columns) and ``stalls`` has the
    seconds each step that loaded blocks from them waited, in step order."""

    first_step: int
    t_start: float
    token_bytes: int = 1
    page_bytes: int = 1
    tiers: tuple[str, ...] = ()
    t_end: float = 0.0
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
    stalls: list[float] = field(default_factory=list)
    _rows: list[tuple[Any, ...]] = field(default_factory=list)
    # Per segment, what each tier held at its first step; and stretches' per-step holdings
    # (tiers by steps) where blocks went down along them, by offset.
    _held: list[tuple[int, ...]] = field(default_factory=list)
    _held_given: list[tuple[int, np.ndarray]] = field(default_factory=list)
    _lengths: list[int] = field(default_factory=list)
    # Per segment: tokens its decoders write a step (0 for a single step), whether its text
    # KV grows with them, whether its refusal's free memory follows the free memory.
    _ramps: list[int] = field(default_factory=list)
    _text: list[bool] = field(default_factory=list)
    _refused: list[bool] = field(default_factory=list)
    _stretch: list[bool] = field(default_factory=list)
    # Stretches' blocks taken and slots to be written added, through each step (cumulative),
    # by offset; and columns given outright (end times, a varying device component).
    _taken: list[tuple[int, np.ndarray]] = field(default_factory=list)
    _limits: list[tuple[int, np.ndarray]] = field(default_factory=list)
    _given: dict[int, tuple[list[int], list[np.ndarray]]] = field(default_factory=dict)

    def row(self, values: tuple[Any, ...], held: tuple[int, ...] = ()) -> None:
        """One step's values, in :data:`COLUMNS` order, and what each tier holds after it."""
        self._rows.append(values)
        self._held.append(held)
        self._lengths.append(1)
        self._ramps.append(0)
        self._text.append(False)
        self._refused.append(False)
        self._stretch.append(False)
        self.steps += 1

    def stretch(self, before: tuple[Any, ...], ends: np.ndarray, tokens: int, text: bool,
                refused: bool, taken: np.ndarray | None, limits: np.ndarray | None,
                device: dict[int, np.ndarray], held: tuple[int, ...] = (),
                held_steps: np.ndarray | None = None) -> None:
        """Decode steps ending at ``ends``, each writing ``tokens`` KV slots: ``before`` holds
        the values before the first (those that stay put hold at every step). Along it, used
        KV (and text KV where ``text``) grows by ``tokens`` a step and the slots still to be
        written shrink by as many, grown by ``limits`` (cumulative); ``taken`` pages
        (cumulative) come out of free memory (and out of the refusal's free memory where
        ``refused``) into reserved memory, allocations and page-table entries; ``device``
        components (by column index) that vary, per step; ``held``: what each tier holds
        along it, or per step in ``held_steps`` (tiers by steps) where that varies."""
        start, k = self.steps, len(ends)
        self._rows.append(before)
        self._held.append(held)
        if held_steps is not None:
            self._held_given.append((start, held_steps))
        self._lengths.append(k)
        self._ramps.append(tokens)
        self._text.append(text)
        self._refused.append(refused)
        self._stretch.append(True)
        if taken is not None:
            self._taken.append((start, taken))
        if limits is not None:
            self._limits.append((start, limits))
        given = self._given
        for i, v in ((_T, ends), *device.items()):
            entry = given.get(i)
            if entry is None:
                entry = given[i] = ([], [])
            entry[0].append(start)
            entry[1].append(v)
        self.steps += k
        self.bulk_steps += k

    def close(self) -> StepBlock:
        """Build ``columns`` from the segments."""
        if not self._rows:
            return self
        lengths = np.asarray(self._lengths, dtype=np.int64)
        n = self.steps
        offsets = np.cumsum(lengths) - lengths
        out: list[Any] = []
        for values in zip(*self._rows, strict=True):
            # A column holding None comes out as objects (numpy's own inference).
            out.append(np.repeat(np.asarray(values), lengths))
        # Steps into their segment, from 1.
        nth = np.arange(1, n + 1, dtype=np.int64) - np.repeat(offsets, lengths)
        ramp = np.repeat(np.asarray(self._ramps, dtype=np.int64), lengths) * nth
        ramp *= self.token_bytes
        out[_USED] += ramp
        out[_AHEAD] -= ramp
        if any(self._text):
            text = np.repeat(np.asarray(self._text), lengths)
            out[_TEXT][text] += ramp[text]
        if self._taken:
            taken = _spread(self._taken, n)
            pages = taken * self.page_bytes
            out[_RESERVED] += pages
            out[_FREE] -= pages
            out[_LARGEST] -= pages
            out[_ALLOCS] += taken
            out[_ENTRIES] += taken
            refused = np.repeat(np.asarray(self._refused), lengths)
            if refused.any():
                out[_REFUSED_FREE][refused] -= pages[refused]
                out[_REFUSED_LARGEST][refused] -= pages[refused]
        if self._limits:
            out[_AHEAD] += _spread(self._limits, n) * self.token_bytes
        for i, (starts, arrays) in self._given.items():
            out[i][_places(starts, arrays)] = np.concatenate(arrays)
        # A stretch's step lasts from the end of the step before it (no wait comes between
        # steps of a stretch, nor right before one: after a wait comes an arrival's step).
        stretch = np.repeat(np.asarray(self._stretch), lengths)
        if stretch.any():
            t = out[_T]
            before = np.empty(n, dtype=np.float64)
            before[0] = self.t_start
            before[1:] = t[:-1]
            out[_DT][stretch] = t[stretch] - before[stretch]
        self.columns = {name: col.tolist() if col.dtype == object else col
                        for name, col in zip(COLUMNS, out, strict=True)}
        if self.tiers:
            held = np.repeat(np.asarray(self._held, dtype=np.int64), lengths, axis=0).T
            for start, steps in self._held_given:
                held[:, start : start + steps.shape[1]] = steps
            self.columns.update((f"offload:{kind}", held[i])
                                for i, kind in enumerate(self.tiers))
        self._rows, self._lengths, self._held = [], [], []
        return self


def _spread(parts: list[tuple[int, np.ndarray]], n: int) -> np.ndarray:
    """``n`` zeros with each part's values from its offset on."""
    out = np.zeros(n, dtype=np.int64)
    out[_places([a for a, _ in parts], [v for _, v in parts])] = np.concatenate(
        [v for _, v in parts])
    return out


def _places(starts: list[int], arrays: list[np.ndarray]) -> np.ndarray:
    """The steps that ``arrays``, placed from ``starts`` on, cover."""
    k = np.fromiter(map(len, arrays), np.int64, len(arrays))
    return np.arange(int(k.sum())) + np.repeat(np.asarray(starts) - (np.cumsum(k) - k), k)


_T, _DT = INDEX["t_s"], INDEX["dt_s"]
_USED, _AHEAD, _RESERVED = (INDEX[f"{n}_bytes"] for n in ("used", "reserved_ahead", "reserved"))
_FREE, _LARGEST = INDEX["free_bytes"], INDEX["largest_free_bytes"]
_ALLOCS, _ENTRIES = INDEX["block_allocs"], INDEX["page_table_entries"]
_REFUSED_FREE = INDEX["refused_free_bytes"]
_REFUSED_LARGEST = INDEX["refused_largest_free_bytes"]
_TEXT = INDEX["modality:text"]
