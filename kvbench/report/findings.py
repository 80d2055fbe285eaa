"""What a run shows, in plain sentences generated from its records.

Each sentence states one effect the records measured: how many more requests one engine ran
at once in the same memory, how much of its reserved KV an engine left unused, a moment when
a request waited although enough memory was free in total, who preempted, and what the
engines did to throughput and time to first token. A sentence appears only where the data
support it: the records compare one workload on one device, clock and machine, the metrics
it quotes exist, and the effect is larger than rounding (no "1.0× as many"). Throughput is
compared only when the engines, not the arrivals, bounded it. Engines tied at the top or
the bottom are named together. On the wall clock a speed difference (throughput, time to
first token, time per output token) is stated only where the engines' repeats' ranges do not
overlap; otherwise the sentence says it is within the machine's noise, with the spreads, and
a comparison from a single repeat says so.

Pure functions over records: ``kvbench report`` and ``publish`` give old runs the sentences
their metrics allow.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.results.repeats import metric_values
from kvbench.results.schema import RunRecord, is_number, request_column
from kvbench.units import format_bytes

FINDINGS_TITLE = "What this run shows"
# Mean concurrencies (or times per token) closer than this ratio are "about the same".
MIN_RATIO = 1.2
# KV budgets closer than this share are the same memory (page rounding).
SAME_BUDGET = 0.01
# Reserved-but-unused KV below this share of the reservation is not worth a sentence.
MIN_WASTE_PCT = 10.0
# Arrivals bound a run's throughput unless its last request arrived within this share of
# its duration: after that the engine worked off a queue, so its capacity set the pace.
ENGINE_BOUND_ARRIVAL_SHARE = 0.5
# Throughput or latency differences below this many percent are reported as none.
SAME_PCT = 2.0


def _num(record: RunRecord, name: str) -> float | None:
    value = record.summary.get(name)
    return float(value) if is_number(value) and math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class _Group:
    """The records sharing one value of a metric (engines tied at an extreme)."""

    records: tuple[RunRecord, ...]
    value: float

    @property
    def names(self) -> str:
        return " and ".join(r.engine for r in self.records)

    @property
    def its(self) -> str:
        return "its" if len(self.records) == 1 else "their"

    @property
    def it(self) -> str:
        return "it" if len(self.records) == 1 else "they"

    def same(self, name: str) -> float | None:
        """``name``'s value where every record of the group has the same one, else None."""
        values = {_num(r, name) for r in self.records}
        return values.pop() if len(values) == 1 else None


def _extremes(records: Sequence[RunRecord], name: str,
              at_least: int = 2) -> tuple[_Group, _Group] | None:
    """The records with the highest and with the lowest value of ``name``; None with fewer
    than ``at_least`` records having it."""
    have = [(r, v) for r in records if (v := _num(r, name)) is not None]
    if not have or len(have) < at_least:
        return None

    def group(value: float) -> _Group:
        return _Group(tuple(r for r, v in have if math.isclose(v, value, rel_tol=1e-9)), value)

    return group(max(v for _, v in have)), group(min(v for _, v in have))


_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def _sizes(*values: float) -> list[str]:
    """``values`` in the unit of the largest, with the fewest decimals (at least one above
    bytes) that keep different values apart ("2.77 MiB" vs "2.79 MiB", not "2.8 MiB" twice)."""
    scale, unit = next(((s, u) for s, u in _UNITS if max(values) >= s), (1, "B"))
    for decimals in range(unit != "B", 6):
        texts = [f"{v / scale:.{decimals}f} {unit}" for v in values]
        if len(set(texts)) == len(set(values)):
            break
    return texts


def _duration(ms: float) -> str:
    return f"{ms / 1000:.1f} s" if ms >= 1000 else f"{ms:.0f} ms"


def _concurrency(records: Sequence[RunRecord]) -> str | None:
    caps = [_num(r, "kv_capacity_bytes") for r in records]
    ends = _extremes(records, "mean_concurrent_requests")
    if ends is None or None in caps:
        return None
    cap = max(c or 0.0 for c in caps)
    hi, lo = ends
    # Budgets a policy rounds to whole pages differ by less than a page: the same memory.
    if min(c or 0.0 for c in caps) < (1 - SAME_BUDGET) * cap or not lo.value \
            or hi.value / lo.value < MIN_RATIO:
        return None
    text = (f"{hi.names} ran {hi.value / lo.value:.1f}× as many requests at once as "
            f"{lo.names} in the same {format_bytes(cap)} of KV memory (on average "
            f"{hi.value:.1f} vs {lo.value:.1f}")
    peaks = hi.same("max_concurrent_requests"), lo.same("max_concurrent_requests")
    if None not in peaks:
        text += f", at most {peaks[0]:.0f} vs {peaks[1]:.0f}"
    return text + ")" + _no_gain(hi, lo) + "."


def _no_gain(hi: _Group, lo: _Group) -> str:
    """A clause saying that more requests at once was no gain: neither more output
    throughput nor a lower median TTFT (they were held longer, not served more)."""
    x_hi, x_lo = hi.same("output_throughput"), lo.same("output_throughput")
    t_hi, t_lo = hi.same("median_ttft_ms"), lo.same("median_ttft_ms")
    if None in (x_hi, x_lo, t_hi, t_lo) or not x_lo:
        return ""
    faster = x_hi > x_lo * (1 + SAME_PCT / 100) or t_hi < t_lo * (1 - SAME_PCT / 100)
    if faster:
        return ""
    return (f", but that was no gain: {hi.its} output throughput was {x_hi:.1f} vs {x_lo:.1f} "
            f"tokens/s and {hi.its} TTFT p50 {_duration(t_hi)} vs {_duration(t_lo)}, so requests "
            "were held longer, not served more")


def _waste(records: Sequence[RunRecord]) -> str | None:
    ends = _extremes(records, "kv_waste_pct", at_least=1)
    if ends is None:
        return None
    worst, best = ends
    if worst.value < MIN_WASTE_PCT:
        return None
    text = f"{worst.names} left {worst.value:.1f}% of the KV memory {worst.it} reserved unused"
    never, ahead = worst.same("kv_internal_waste_pct"), worst.same("kv_reservation_waste_pct")
    if never is not None and ahead is not None:
        text += (f": {never:.1f}% was room no token would ever fill and {ahead:.1f}% was held "
                 f"for tokens not yet computed")
    if best.records != worst.records and best.value <= worst.value / 2:
        text += f"; {best.names} left {best.value:.1f}%"
    return text + "."


_WORST_WAIT = ("fragmentation_wait_t_s", "fragmentation_wait_free_bytes",
               "fragmentation_wait_largest_free_bytes", "fragmentation_wait_need_bytes")


def _fragmentation(records: Sequence[RunRecord]) -> str | None:
    have = [r for r in records if (_num(r, "fragmentation_wait_s") or 0) > 0
            and all(_num(r, k) is not None for k in _WORST_WAIT)]
    if not have:
        return None
    r = max(have, key=lambda x: _num(x, "fragmentation_wait_s") or 0)
    t, free, hole, need = (_num(r, k) or 0.0 for k in _WORST_WAIT)
    free_s, hole_s, need_s = _sizes(free, hole, need)
    text = (f"{r.engine}: at t = {t:.1f} s, {free_s} of KV memory was free but the largest "
            f"hole was {hole_s} (fragmentation index {hole / free:.2f}), so a request needing "
            f"{need_s} waited; requests waited with enough memory free in total for "
            f"{_num(r, 'fragmentation_wait_s') or 0:.1f} s")
    duration = _num(r, "duration_s")
    if duration:
        text += f", {100 * (_num(r, 'fragmentation_wait_s') or 0) / duration:.0f}% of its run"
    others = [o.engine for o in have if o is not r]
    if others:
        text += f" ({', '.join(others)} also waited so)"
    return text + "."


def _preemptions(records: Sequence[RunRecord]) -> str | None:
    counts = [f"{r.engine} {n:.0f} times" for r in records if (n := _num(r, "preemptions"))]
    if not counts:
        return None
    text = (f"Running requests were preempted when KV memory ran out ({', '.join(counts)}): "
            f"each gave up its KV and computed it again later")
    swapped = [f"{r.engine} {format_bytes(n)}" for r in records
               if (n := _num(r, "offload_swapped_out_bytes"))]
    if swapped:
        text += (f", or where it fit in the first offload tier, copied it out and back "
                 f"({', '.join(swapped)} copied out)")
    return text + "."


def _arrival_shares(records: Sequence[RunRecord]) -> list[tuple[float, float, float, RunRecord]]:
    """Per record: (last arrival / duration, last arrival, duration, record); empty when a
    record has no request rows or no duration."""
    out = []
    for r in records:
        last = max(request_column(r.requests, "arrival_s"), default=None)
        duration = _num(r, "duration_s")
        if last is None or not duration:
            return []
        out.append((last / duration, last, duration, r))
    return out


def _within_noise(a: _Group, b: _Group, metric: str) -> bool:
    note = _noise(a, b, metric, "")
    return note is not None and not note.startswith("(")


def _noise(a: _Group, b: _Group, metric: str, unit: str) -> str | None:
    """Whether a wall-clock speed difference between ``a`` and ``b`` is a finding: None when
    their repeats' ranges are apart (or the clock is virtual, hence exact); a note in
    parentheses when one ran once (with the load it ran at); else a sentence saying the
    difference is within the machine's noise, with both spreads."""
    ra, rb = a.records[0], b.records[0]
    if ra.clock != "wall":
        return None
    va, vb = metric_values(ra, metric), metric_values(rb, metric)
    if not va or not vb:
        return None
    if len(va) == 1 or len(vb) == 1:
        loads = [s.load_before[0] for r in (ra, rb) for s in r.machine_state if s.load_before]
        at = f", at a 1-minute load of {max(loads):.2f}" if loads else ""
        return f"(from one repeat{at}; --repeat 3 checks it against the noise)"
    if min(va) > max(vb) or max(va) < min(vb):
        return None
    return (f"the difference in {unit} between {a.names} ({min(va):.1f}-{max(va):.1f}) and "
            f"{b.names} ({min(vb):.1f}-{max(vb):.1f}) is within this machine's noise: their "
            f"{min(len(va), len(vb))} repeats' ranges overlap.")


def _engine_bound(records: Sequence[RunRecord]) -> bool:
    shares = _arrival_shares(records)
    return bool(shares) and max(x[0] for x in shares) <= ENGINE_BOUND_ARRIVAL_SHARE


def _throughput(records: Sequence[RunRecord]) -> str | None:
    have = [r for r in records if _num(r, "output_throughput")]
    shares = _arrival_shares(have)
    ends = _extremes(have, "output_throughput")
    if ends is None or not shares:
        return None
    share, last, duration, slowest = max(shares, key=lambda x: x[0])
    if share > ENGINE_BOUND_ARRIVAL_SHARE:
        return (f"Arrivals, not the engines, bounded throughput: the last request arrived at "
                f"{last:.1f} s of {slowest.engine}'s {duration:.1f} s run, so throughput "
                f"measures the workload's rate rather than the engines.")
    last = max(x[1] for x in shares)
    queued = "at 0 s" if last == 0 else f"by {last:.1f} s"
    best, worst = ends
    gain = 100 * (best.value / worst.value - 1)
    noise = _noise(best, worst, "output_throughput", "output tokens/s")
    if noise is not None and not noise.startswith("("):
        return f"With every request queued {queued}, {noise}"
    if gain < SAME_PCT:
        return (f"With every request queued {queued}, the engines bounded throughput, and it "
                f"was within {SAME_PCT:.0f}% across them ({worst.value:.1f} to "
                f"{best.value:.1f} output tokens/s).")
    text = (f"With every request queued {queued}, the engines bounded throughput: "
            f"{best.names} produced {gain:.0f}% more output tokens/s than {worst.names} "
            f"({best.value:.1f} vs {worst.value:.1f})")
    ttft_b, ttft_w = best.same("median_ttft_ms"), worst.same("median_ttft_ms")
    if _within_noise(best, worst, "median_ttft_ms"):
        ttft_b = None  # no claim about it
    if ttft_b is not None and ttft_w:
        change = 100 * (ttft_b / ttft_w - 1)
        if abs(change) < SAME_PCT:
            text += " at the same median time to first token"
        else:
            text += (f", and {best.its} median time to first token was {abs(change):.0f}% "
                     f"{'lower' if change < 0 else 'higher'} ({_duration(ttft_b)} vs "
                     f"{_duration(ttft_w)})")
    return text + ("" if noise is None else f" {noise}") + "."


def _batching(records: Sequence[RunRecord]) -> str | None:
    """Why throughput did not follow concurrency: output tokens/s is about the requests
    running divided by the time per output token."""
    have = [r for r in records
            if _num(r, "median_tpot_ms") and _num(r, "output_throughput")]
    ends = _extremes(have, "mean_concurrent_requests")
    if ends is None or not _engine_bound(have):
        return None
    hi, lo = ends
    values = [g.same(k) for g in ends for k in ("median_tpot_ms", "output_throughput")]
    if not all(values) or not lo.value:
        return None
    t_hi, x_hi, t_lo, x_lo = (v or 0.0 for v in values)
    if hi.value / lo.value < MIN_RATIO or t_hi / t_lo < MIN_RATIO:
        return None
    if any(_within_noise(hi, lo, k) for k in ("median_tpot_ms", "output_throughput")):
        return None
    change = 100 * (x_hi / x_lo - 1)
    outcome = (f"stayed within {SAME_PCT:.0f}%" if abs(change) < SAME_PCT
               else f"{'rose' if change > 0 else 'fell'} {abs(change):.0f}%")
    return (f"Each of {hi.names}'s output tokens took {t_hi / t_lo:.1f}× as long as "
            f"{lo.names}'s (TPOT p50 {t_hi:.1f} ms vs {t_lo:.1f} ms) with "
            f"{hi.value / lo.value:.1f}× as many requests running, so {hi.its} output "
            f"throughput {outcome}.")


def _setting(record: RunRecord) -> tuple[object, ...]:
    """What engines must share for their numbers to compare."""
    m = record.machine
    return (record.workload.digest, record.device, record.clock, m.get("hostname"), m.get("cpu"))


def run_findings(records: Sequence[RunRecord]) -> list[str]:
    """The sentences ``records`` (the engines of one run) support, most telling first; none
    when they ran different workloads, devices, clocks or machines."""
    ok = [r for r in records if r.status == "ok"]
    if len({_setting(r) for r in ok}) != 1:
        return []
    sentences = (_concurrency(ok), _waste(ok), _fragmentation(ok), _preemptions(ok),
                 _throughput(ok), _batching(ok))
    return [s for s in sentences if s]
