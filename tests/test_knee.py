"""The saturation curve and KV-pressure knee of a request-rate sweep, over records."""

from __future__ import annotations

import pytest
from record_factory import SUMMARY, make_record

from kvbench.results.knee import kv_pressure_knee, saturation_curve

CAP = 8 << 20


def _at(rate: float, ttft: float, kv_fraction: float, preemptions: int = 0,
        status: str = "ok"):
    summary = {**SUMMARY, "median_ttft_ms": ttft, "request_throughput": min(rate, 3.0),
               "kv_capacity_bytes": CAP, "peak_kv_reserved_bytes": int(kv_fraction * CAP),
               "preemptions": preemptions}
    return rate, make_record("openai", clock="wall", summary=summary, status=status)


def test_latency_rising_as_kv_fills_is_the_knee() -> None:
    runs = [_at(4, 100, 0.95), _at(1, 40, 0.3), _at(2, 50, 0.6), _at(3, 70, 0.85)]
    points = saturation_curve(runs)
    assert [p.rate for p in points] == [1, 2, 3, 4]
    assert points[2].kv_peak_fraction == pytest.approx(0.85, abs=1e-6)
    knee = kv_pressure_knee(points)
    # 2x the 40 ms baseline = 80 ms, crossed between 3 (70 ms) and 4 req/s (100 ms).
    assert knee.threshold_ms == 80.0 and knee.slow_rate == 4
    assert knee.rate == pytest.approx(3 + 10 / 30)
    assert "95% of capacity" in knee.finding and "2x" in knee.method


def test_preemptions_count_as_kv_pressure() -> None:
    knee = kv_pressure_knee(saturation_curve([_at(1, 40, 0.5), _at(2, 120, 0.7, 12)]))
    assert knee.rate == pytest.approx(1.5) and "12 preemptions" in knee.finding


def test_an_early_slow_rate_without_kv_pressure_does_not_hide_the_knee() -> None:
    # Latency already doubled at 2 req/s (other load), KV pressure only from 4 req/s.
    runs = [_at(1, 40, 0.3), _at(2, 90, 0.4), _at(4, 150, 0.95)]
    knee = kv_pressure_knee(saturation_curve(runs))
    assert knee.slow_rate == 2 and knee.rate == 4  # the rate below was slow already


def test_latency_rising_without_kv_pressure_is_no_kv_knee() -> None:
    knee = kv_pressure_knee(saturation_curve([_at(1, 40, 0.2), _at(2, 200, 0.4)]))
    assert knee.rate is None and knee.slow_rate == 2
    assert "not a KV knee" in knee.finding and "40% of capacity" in knee.finding


def test_no_knee_within_the_sweep_and_too_few_points() -> None:
    flat = kv_pressure_knee(saturation_curve([_at(1, 40, 0.9), _at(2, 60, 0.99)]))
    assert flat.rate is None and flat.slow_rate is None and "no knee within" in flat.finding
    one = kv_pressure_knee(saturation_curve([_at(1, 40, 0.9), _at(2, 90, 1.0, status="failed")]))
    assert one.rate is None and "at least two" in one.finding


def test_unknown_kv_capacity_leaves_pressure_unknown() -> None:
    rate, rec = _at(2, 200, 0.5)
    rec.summary["kv_capacity_bytes"] = None
    points = saturation_curve([_at(1, 40, 0.5), (rate, rec)])
    assert points[1].kv_peak_fraction is None
    assert "KV at unknown" in kv_pressure_knee(points).finding
