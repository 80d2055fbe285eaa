"""A step log's columns reduced to what the summary metrics and curves are made of (sums,
extremes, curve buckets, the inter-token gaps), so that a replay of tens of millions of
steps need not keep every one: its step log folds the oldest steps into these as it goes
(:func:`fold`), keeping the latest ``FOLD_STEPS`` to ``2 x FOLD_STEPS`` of them.

A run that never folds reduces its whole log in one go, with the operations the metrics
always used. A folded run adds the reductions of its folds one after another (a sum over
all steps can then differ in the last bits of a float); its curves are bucketed from
``FINE_STEPS``-step buckets over the folded steps (bucket edges there fall on multiples of
``FINE_STEPS``); its inter-token gaps keep each distinct value once, with how many times
it counts, so its ITL percentiles are exact.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvbench.engines.base import DeviceMemory
from kvbench.results.columns import Column

# A replay's step log folds this many of its oldest steps at a time, once it holds twice as
# many; its curves keep the folded steps in buckets of FINE_STEPS.
FOLD_STEPS = 1 << 18
FINE_STEPS = 256

# Curve columns reduced by maximum (what a peak means), minimum (what is left) or sum.
MAX_CURVES = (
    "kv_capacity_bytes", "kv_reserved_bytes", "kv_used_bytes", "kv_reserved_ahead_bytes",
    "kv_shared_bytes", "running", "waiting", "prefix_hit_tokens", "block_allocs",
    "block_frees", "num_tokens", "kv_copied_bytes", "page_table_entries",
    "kv_encoder_cache_bytes",
)
MIN_CURVES = ("kv_free_bytes", "kv_largest_free_bytes")
SUM_CURVES = ("preempted",)

_KV_COLUMNS = (
    "kv_reserved_bytes", "kv_used_bytes", "kv_reserved_ahead_bytes", "kv_shared_bytes",
    "page_table_entries", "kv_free_bytes", "kv_largest_free_bytes", "kv_refused_bytes",
    "kv_refused_free_bytes", "kv_refused_largest_free_bytes",
)


def frag_index(free: np.ndarray, largest: np.ndarray) -> np.ndarray:
    """largest_free / free per point; 1.0 where nothing is free (nothing is fragmented)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(free > 0, largest / np.maximum(free, 1), 1.0)


def fragmentation_waits(need: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Per step: the KV manager refused a request (``need`` > 0) although the free memory
    would have held it in total (external fragmentation)."""
    return (need > 0) & (free >= need)


@dataclass(slots=True)
class StepSums:
    """Reductions of a run of steps: their count and total length; per quantity its sum,
    maximum, minimum and count (names in :func:`reduce_steps`); the columns with an absent
    value (their metrics are absent); the worst fragmentation wait (most memory free, the
    first of equals: free, start time, largest free, need); the modelled device's
    peak (used bytes, then the components there); and the inter-token gaps with how many
    times each counts."""

    steps: int = 0
    dt: float = 0.0
    sum: dict[str, float] = field(default_factory=dict)
    max: dict[str, float] = field(default_factory=dict)
    min: dict[str, float] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)
    worst: tuple[float, float, int, int] | None = None
    peak: tuple[float, tuple[float, ...]] | None = None
    gaps: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0, dtype=np.int64))

    def add(self, later: StepSums) -> StepSums:
        """These reductions and those of the steps that follow them, in new sums; the gaps
        of both as their distinct values."""
        out = StepSums(self.steps + later.steps, self.dt + later.dt, dict(self.sum),
                       dict(self.max), dict(self.min), dict(self.count),
                       self.missing | later.missing, self.worst, self.peak)
        for k, v in later.sum.items():
            out.sum[k] = out.sum.get(k, 0.0) + v
        for k, v in later.max.items():
            out.max[k] = max(out.max.get(k, v), v)
        for k, v in later.min.items():
            out.min[k] = min(out.min.get(k, v), v)
        for k, n in later.count.items():
            out.count[k] = out.count.get(k, 0) + n
        if later.worst is not None and (out.worst is None or later.worst[0] > out.worst[0]):
            out.worst = later.worst
        if later.peak is not None and (out.peak is None or later.peak[0] > out.peak[0]):
            out.peak = later.peak
        values, at = np.unique(np.concatenate((self.gaps[0], later.gaps[0])),
                               return_inverse=True)
        weights = np.bincount(at, np.concatenate((self.gaps[1], later.gaps[1])), len(values))
        out.gaps = (values, weights.astype(np.int64))
        return out


def _full(column: Column, n: int) -> np.ndarray | None:
    """The first ``n`` values of ``column`` as floats, or None when it holds fewer or some
    of them is absent."""
    if not n or len(column) < n:
        return None
    values, nones = column.head(n)
    return None if nones is not None else values.astype(np.float64, copy=False)


def _floats(column: Column, n: int) -> np.ndarray:
    return column.head(n)[0].astype(np.float64, copy=False)


def reduce_steps(s: Any, n: int, weights: np.ndarray) -> StepSums:
    """The reductions of the first ``n`` steps held by step log ``s``; ``weights``: how many
    requests' tokens followed on at each of them (:class:`~kvbench.results.gaps.GapLog`)."""
    out = StepSums(steps=n)
    if not n:
        return out
    dt = _floats(s.dt_s, n)
    out.dt = float(dt.sum())
    running = _floats(s.running, n)
    out.max["running"] = float(running.max(initial=0))
    out.sum["running_dt"] = float((running * dt).sum())
    out.sum["preempted"] = float(s.preempted.head(n)[0].sum())
    cols = {name: _full(getattr(s, name), n) for name in _KV_COLUMNS}
    out.missing = {k for k, v in cols.items() if v is None}
    _reduce_kv(out, cols, dt)
    _reduce_fragmentation(out, cols, dt, s)
    _reduce_modalities(out, s, n)
    _reduce_groups(out, s, n)
    _reduce_device(out, s, n)
    keep = weights[:n] > 0
    out.gaps = (dt[keep], weights[:n][keep])
    return out


def _reduce_kv(out: StepSums, cols: dict[str, np.ndarray | None], dt: np.ndarray) -> None:
    """The KV pool's peaks, and its time-weighted sums over the steps it held memory."""
    reserved, used = cols["kv_reserved_bytes"], cols["kv_used_bytes"]
    if reserved is not None:
        out.max["reserved"] = float(reserved.max())
        busy = reserved > 0
        out.sum["busy_reserved_dt"] = float((reserved[busy] * dt[busy]).sum())
        for key, name in (("used", "kv_used_bytes"), ("ahead", "kv_reserved_ahead_bytes"),
                          ("shared", "kv_shared_bytes")):
            col = cols[name]
            if col is not None:
                out.sum[f"busy_{key}_dt"] = float((col[busy] * dt[busy]).sum())
    if used is not None:
        out.max["used"] = float(used.max())
    entries = cols["page_table_entries"]
    if entries is not None:
        out.max["entries"] = float(entries.max())
        out.sum["entries_dt"] = float((entries * dt).sum())


def _reduce_fragmentation(out: StepSums, cols: dict[str, np.ndarray | None], dt: np.ndarray,
                          s: Any) -> None:
    """The fragmentation index over steps with memory free, and the admissions refused
    although enough was free in total (the worst of them kept)."""
    free, largest = cols["kv_free_bytes"], cols["kv_largest_free_bytes"]
    if free is not None and largest is not None:
        mask = free > 0
        if mask.any():
            frag = frag_index(free[mask], largest[mask])
            out.min["frag"] = float(frag.min())
            out.sum["frag_dt"] = float((frag * dt[mask]).sum())
            out.sum["free_dt"] = float(dt[mask].sum())
    need, refused_free = cols["kv_refused_bytes"], cols["kv_refused_free_bytes"]
    refused_largest = cols["kv_refused_largest_free_bytes"]
    if need is not None and refused_free is not None and refused_largest is not None:
        waits = fragmentation_waits(need, refused_free)
        out.sum["wait_dt"] = float(dt[need > 0].sum())
        out.sum["waits"] = float(waits.sum())
        out.sum["waits_dt"] = float(dt[waits].sum())
        if waits.any():
            # argmax keeps the first of equal maxima.
            i = int(np.argmax(np.where(waits, refused_free, -1.0)))
            out.worst = (float(refused_free[i]), s.t_s[i] - s.dt_s[i],
                         int(refused_largest[i]), int(need[i]))


def _reduce_modalities(out: StepSums, s: Any, n: int) -> None:
    """KV bytes per modality held, the encoder cache, and each page class of a
    modality-aware pool."""
    for m, col in s.kv_modality_bytes.items():
        values = _full(col, n)
        if values is None:
            out.missing.add(f"modality:{m}")
        else:
            out.max[f"modality:{m}"] = float(values.max())
    values, nones = s.kv_encoder_cache_bytes.head(n)
    enc = values if nones is None else values[~nones]
    if len(enc):
        out.max["encoder"] = float(enc.max())
        out.sum["encoder"] = float(enc.astype(np.float64).sum())
        out.count["encoder"] = len(enc)
    for name in {k.rsplit("_", 2)[0] for k in s.kv_class_bytes}:
        reserved = _floats(s.kv_class_bytes[f"{name}_reserved_bytes"], n)
        used = _floats(s.kv_class_bytes[f"{name}_used_bytes"], n)
        cap = _floats(s.kv_class_bytes[f"{name}_capacity_bytes"], n)
        out.max[f"class:{name}:reserved"] = float(reserved.max(initial=0))
        out.max[f"class:{name}:used"] = float(used.max(initial=0))
        out.sum[f"class:{name}:util"] = float((reserved / np.maximum(cap, 1)).sum())
        out.count[f"class:{name}"] = len(reserved)
        out.sum[f"class:{name}:reserved"] = float(reserved.sum())
        out.sum[f"class:{name}:used"] = float(used.sum())


def _reduce_groups(out: StepSums, s: Any, n: int) -> None:
    """Each kind of layer group's peaks and sums over the steps that report them."""
    for name, col in s.kv_groups.items():
        values, nones = col.head(n)
        if nones is not None:
            values = values[~nones]
        if len(values):
            values = values.astype(np.float64, copy=False)
            out.max[f"group:{name}"] = float(values.max())
            out.sum[f"group:{name}"] = float(values.sum())


def _reduce_device(out: StepSums, s: Any, n: int) -> None:
    """The modelled device's peak: its used bytes and the components there."""
    device = device_columns(s, n)
    if device:
        used_dev = device["device_used_bytes"]
        at = int(np.argmax(used_dev))
        out.peak = (float(used_dev[at]), tuple(
            float(device[f"device_{c}_bytes"][at]) for c in DeviceMemory.COMPONENTS))
        out.max["device_allocated"] = float(device["device_allocated_bytes"].max())
        out.max["device_reserved"] = float(device["device_reserved_bytes"].max())


def device_columns(s: Any, n: int | None = None) -> dict[str, np.ndarray]:
    """Per-step modelled device memory of the first ``n`` steps held by step log ``s`` (all
    of them by default): ``device_<component>_bytes`` for every component, and their sums
    ``device_allocated_bytes`` (live tensors), ``device_reserved_bytes`` (plus the
    allocator's cache) and ``device_used_bytes`` (plus non-torch memory: what nvidia-smi
    shows). Empty for runs whose device memory is measured, not modelled."""
    if not s.device:
        return {}
    n = len(s.t_s) if n is None else n
    out = {f"device_{name}_bytes": _floats(values, n) for name, values in s.device.items()}
    allocated = sum(out[f"device_{name}_bytes"] for name in DeviceMemory.ALLOCATED)
    out["device_allocated_bytes"] = allocated
    out["device_reserved_bytes"] = allocated + sum(out[f"device_{name}_bytes"]
                                                   for name in DeviceMemory.CACHED)
    out["device_used_bytes"] = out["device_reserved_bytes"] + out["device_non_torch_bytes"]
    return out


def curve_columns(s: Any, n: int) -> dict[str, tuple[np.ndarray, str]]:
    """The first ``n`` steps' values of every curve of step log ``s`` (those with a value at
    every step), each with how a bucket of steps reduces it: max, min or sum."""
    out: dict[str, tuple[np.ndarray, str]] = {}
    for name in (*MAX_CURVES, *MIN_CURVES, *SUM_CURVES):
        col = _full(getattr(s, name), n)
        if col is not None:
            how = "sum" if name in SUM_CURVES else "min" if name in MIN_CURVES else "max"
            out[name] = (col, how)
    for name, col in device_columns(s, n).items():
        out[name] = (col, "max")
    # Per page class of a modality-aware pool: kv_<class>_<reserved|used|capacity>_bytes.
    for name, values in s.kv_class_bytes.items():
        out[f"kv_{name}"] = (_floats(values, n), "max")
    # Per kind of layer group: kv_<kind>_group_<reserved_bytes|used_bytes|usage>.
    for name, values in s.kv_groups.items():
        col = _full(values, n)
        if col is not None:
            kind, what = name.split("_", 1)
            out[f"kv_{kind}_group_{what}"] = (col, "max")
    for kind, values in s.offload_bytes.items():
        col = _full(values, n)
        if col is not None:
            out[f"offload_{kind}_used_bytes"] = (col, "max")
    # Used KV by modality of the tokens held: kv_<text|image|audio>_bytes, where every step
    # attributes it.
    for name, values in s.kv_modality_bytes.items():
        col = _full(values, n)
        if col is not None:
            out[f"kv_{name}_bytes"] = (col, "max")
    free, largest = _full(s.kv_free_bytes, n), _full(s.kv_largest_free_bytes, n)
    if free is not None and largest is not None:
        out["frag_index"] = (frag_index(free, largest), "min")
    need, need_free = _full(s.kv_refused_bytes, n), _full(s.kv_refused_free_bytes, n)
    if need is not None and need_free is not None:
        out["fragmentation_wait_bytes"] = (
            np.where(fragmentation_waits(need, need_free), need, 0), "max")
    return out


_REDUCE = {"max": np.maximum, "min": np.minimum, "sum": np.add}


def bucket(columns: dict[str, tuple[np.ndarray, str]], starts: np.ndarray
           ) -> dict[str, tuple[np.ndarray, str]]:
    """Each curve reduced over buckets of consecutive points starting at ``starts``."""
    return {name: (_REDUCE[how].reduceat(col, starts), how)
            for name, (col, how) in columns.items()}


@dataclass(slots=True)
class Folded:
    """The oldest steps of a step log, folded: their count, their reductions, every curve
    over buckets of ``fine`` steps (per fold, with the time at each bucket's end; a
    curve some fold lacks is dropped), and the modelled device's used memory at steps the
    metrics read (the step warm-up ended at)."""

    steps: int = 0
    fine: int = FINE_STEPS
    sums: StepSums = field(default_factory=StepSums)
    curves: dict[str, tuple[list[np.ndarray], str]] = field(default_factory=dict)
    t_end: list[np.ndarray] = field(default_factory=list)
    device_used: dict[int, float] = field(default_factory=dict)


def columns_of(s: Any) -> Iterator[Column]:
    """Every per-step column of step log ``s``."""
    for name in s.__dataclass_fields__:
        value = getattr(s, name)
        if isinstance(value, Column):
            yield value
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, Column))


def fold(s: Any, keep: int | None = None) -> None:
    """Fold step log ``s``'s oldest steps, ``FOLD_STEPS`` at a time, while it holds twice
    as many; ``keep``: a step whose modelled device memory the metrics will read. Every
    request's tokens in the steps folded must have been logged (their gaps)."""
    while len(s.t_s) >= 2 * FOLD_STEPS:
        _fold(s, FOLD_STEPS, keep)


def _fold(s: Any, n: int, keep: int | None) -> None:
    folded = s.folded = s.folded if s.folded is not None else Folded(fine=FINE_STEPS)
    first, fine = folded.steps, folded.fine
    sums = reduce_steps(s, n, s.gaps.drop(n))
    folded.sums = folded.sums.add(sums) if first else sums
    starts = np.arange(0, n, fine)
    curves = bucket(curve_columns(s, n), starts)
    for name in set(folded.curves) - set(curves):
        del folded.curves[name]
    for name, (values, how) in curves.items():
        if not first:
            folded.curves[name] = ([], how)
        if name in folded.curves:
            folded.curves[name][0].append(values)
    folded.t_end.append(_floats(s.t_s, n)[starts + fine - 1])
    if keep is not None and first <= keep < first + n:
        folded.device_used[keep] = float(device_columns(s, n)["device_used_bytes"][keep - first])
    for column in columns_of(s):
        column.drop(n)
    folded.steps += n


def run_sums(s: Any) -> StepSums:
    """The reductions of every step of step log ``s``, the folded ones included."""
    held = len(s.t_s)
    sums = reduce_steps(s, held, s.gaps.weights(len(s)))
    return s.folded.sums.add(sums) if s.folded is not None else sums


def device_used_at(s: Any, step: int) -> float | None:
    """The modelled device's used memory at ``step`` of step log ``s``; None if it is
    folded away without having been kept."""
    first = len(s) - len(s.t_s)
    if step >= first:
        return float(device_columns(s)["device_used_bytes"][step - first])
    return s.folded.device_used.get(step)
