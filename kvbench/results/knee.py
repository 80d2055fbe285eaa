"""The saturation curve of a request-rate sweep and its KV-pressure knee: pure functions over
the records of one engine, each run at a known offered rate.

Method (stated in every result):

- The **baseline** latency is the latency metric (default: median TTFT) at the lowest swept
  rate; a rate is **slow** when its latency exceeds ``latency_factor`` (default 2) times it.
- A rate is under **KV pressure** when its peak KV reserved is at least ``kv_full`` (default
  90%) of the KV capacity, or when the engine preempted requests (it ran out of KV).
- The **knee** is the lowest swept rate that is both slow and under KV pressure. Its rate is
  interpolated linearly between the swept rate below it and the knee's own rate, at the
  point where the latency crosses the threshold (the knee's own rate when the rate below
  was already slow): the rate at which latency rises as KV usage nears full.
- Latency rising without KV pressure is a compute (or queueing) limit, not a KV knee: the
  result says so and names the rate. No rate slow: no knee within the sweep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvbench.results.schema import RunRecord

DEFAULT_LATENCY = "median_ttft_ms"
DEFAULT_LATENCY_FACTOR = 2.0
DEFAULT_KV_FULL = 0.9


@dataclass(frozen=True, slots=True)
class RatePoint:
    """One swept rate: what was offered, what came out, the latency and the KV pressure."""

    rate: float
    request_throughput: float | None
    output_throughput: float | None
    latency_ms: float | None
    kv_peak_fraction: float | None  # peak KV reserved / capacity
    preemptions: int | None
    status: str


@dataclass(frozen=True, slots=True)
class Knee:
    """``rate`` is the knee's interpolated offered rate (None: no KV knee in the sweep);
    ``slow_rate`` the first swept rate whose latency exceeded the threshold, KV-bound or not;
    ``finding`` says what was found in words; ``method`` how."""

    rate: float | None
    slow_rate: float | None
    threshold_ms: float | None
    finding: str
    method: str


def saturation_curve(
    runs: Sequence[tuple[float, RunRecord]], latency: str = DEFAULT_LATENCY
) -> list[RatePoint]:
    """The points of ``runs`` (offered rate, record), by rate."""
    points = []
    for rate, rec in sorted(runs, key=lambda x: x[0]):
        s = rec.summary
        cap, peak = s.get("kv_capacity_bytes"), s.get("peak_kv_reserved_bytes")
        points.append(RatePoint(
            rate=rate,
            request_throughput=s.get("request_throughput"),
            output_throughput=s.get("output_throughput"),
            latency_ms=s.get(latency),
            kv_peak_fraction=peak / cap if cap and peak is not None else None,
            preemptions=s.get("preemptions"),
            status=rec.status,
        ))
    return points


def _method(latency: str, factor: float, kv_full: float) -> str:
    return (
        f"knee = lowest swept rate whose {latency} exceeds {factor:g}x its value at the "
        f"lowest rate while peak KV reserved is >= {100 * kv_full:g}% of capacity or requests "
        "were preempted; its rate interpolated linearly where the latency crosses the "
        "threshold from the rate below"
    )


def kv_pressure_knee(
    points: Sequence[RatePoint],
    *,
    latency: str = DEFAULT_LATENCY,
    latency_factor: float = DEFAULT_LATENCY_FACTOR,
    kv_full: float = DEFAULT_KV_FULL,
) -> Knee:
    """The KV-pressure knee of a saturation curve (see the module docstring)."""
    method = _method(latency, latency_factor, kv_full)
    usable = [p for p in points if p.latency_ms is not None and p.status == "ok"]
    if len(usable) < 2:
        return Knee(None, None, None, f"needs at least two completed rates with {latency}",
                    method)
    base = usable[0]
    assert base.latency_ms is not None
    threshold = latency_factor * base.latency_ms
    slow = [p for p in usable[1:] if p.latency_ms is not None and p.latency_ms > threshold]
    knee = next((p for p in slow if _pressured(p, kv_full)), None)
    if knee is not None:
        below = usable[usable.index(knee) - 1]
        assert knee.latency_ms is not None and below.latency_ms is not None
        rate = knee.rate
        if below.latency_ms <= threshold:
            # Where the latency crosses the threshold between the two swept rates.
            frac = (threshold - below.latency_ms) / (knee.latency_ms - below.latency_ms)
            rate = below.rate + frac * (knee.rate - below.rate)
        return Knee(rate, slow[0].rate, threshold,
                    f"{latency} rises past {threshold:.1f} ms ({latency_factor:g}x "
                    f"{base.latency_ms:.1f} ms at {base.rate:g} req/s) at about {rate:.3g} "
                    f"req/s, as KV reaches {_pressure(knee)}", method)
    if slow:
        p = slow[0]
        kv = "unknown" if p.kv_peak_fraction is None else f"{100 * p.kv_peak_fraction:.0f}%"
        return Knee(None, p.rate, threshold,
                    f"{latency} passes {threshold:.1f} ms at {p.rate:g} req/s with peak KV "
                    f"at {kv} of capacity and no preemptions, and no slow rate is under KV "
                    "pressure: a compute or queueing limit, not a KV knee", method)
    return Knee(None, None, threshold,
                f"{latency} stays within {latency_factor:g}x its lowest-rate value up to "
                f"{usable[-1].rate:g} req/s: no knee within the sweep", method)


def _pressured(p: RatePoint, kv_full: float) -> bool:
    full = p.kv_peak_fraction is not None and p.kv_peak_fraction >= kv_full
    return full or bool(p.preemptions)


def _pressure(p: RatePoint) -> str:
    parts = []
    if p.kv_peak_fraction is not None:
        parts.append(f"{100 * p.kv_peak_fraction:.0f}% of capacity")
    if p.preemptions:
        parts.append(f"{p.preemptions} preemptions")
    return " with ".join(parts)
