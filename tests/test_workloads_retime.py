"""Re-timing arrivals as ``vllm bench serve --request-rate --burstiness`` does."""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from kvbench.errors import KvbenchError
from kvbench.workloads.io import load_workload, save_workload
from kvbench.workloads.presets import generate_preset
from kvbench.workloads.retime import retime
from kvbench.workloads.traces import import_trace

MOONCAKE = Path(__file__).parent / "fixtures" / "mooncake_synthetic_trace_head300.jsonl"


def _same_but_arrivals(a, b) -> None:
    assert len(a.requests) == len(b.requests)
    for x, y in zip(a.requests, b.requests, strict=True):
        assert (x.id, x.segments, x.output_tokens, x.prefix_group, x.session_id, x.n) == (
            y.id, y.segments, y.output_tokens, y.prefix_group, y.session_id, y.n
        )


def test_infinite_rate_sends_everything_at_once() -> None:
    w = import_trace("mooncake", MOONCAKE)
    now = retime(w, math.inf)
    assert all(r.arrival_s == 0.0 for r in now.requests)
    _same_but_arrivals(w, now)
    assert now.spec["retimed"] == {"request_rate": "inf", "burstiness": 1.0, "seed": 0}
    assert now.spec["of"] == w.spec and "re-timed at inf requests/s" in now.source


def test_gaps_are_vllm_gamma_gaps_from_the_seed() -> None:
    w = generate_preset("mixed-text", 200)
    out = retime(w, request_rate=8.0, burstiness=0.5, seed=7)
    gaps = np.random.default_rng(7).gamma(0.5, 1 / (8.0 * 0.5), size=200)[:199]
    expected = np.concatenate([[0.0], np.cumsum(gaps)])
    assert [r.arrival_s for r in out.requests] == expected.tolist()
    _same_but_arrivals(w, out)
    assert retime(w, 8.0, 0.5, seed=7).digest == out.digest
    assert retime(w, 8.0, 0.5, seed=8).digest != out.digest
    assert out.digest != w.digest


@pytest.mark.parametrize(("burstiness", "cv2"), [(1.0, 1.0), (0.25, 4.0), (4.0, 0.25)])
def test_rate_and_burstiness_statistics(burstiness: float, cv2: float) -> None:
    w = generate_preset("mixed-text", 20_000)
    gaps = np.diff([r.arrival_s for r in retime(w, 50.0, burstiness, seed=1).requests])
    assert gaps.mean() == pytest.approx(1 / 50.0, rel=0.05)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(cv2, rel=0.1)


def test_sessions_keep_turn_order() -> None:
    w = generate_preset("multi-turn", 300, seed=2)
    out = retime(w, 20.0, seed=3)
    turns = defaultdict(list)
    for r in out.requests:
        turns[r.session_id].append(r)
    assert max(len(t) for t in turns.values()) >= 3
    for session in turns.values():
        # Each turn's prompt extends the previous turn's: order as generated.
        for prev, nxt in pairwise(session):
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert nxt.arrival_s >= prev.arrival_s
    _same_but_arrivals(w, out)


def test_retimed_workload_saves_and_loads(tmp_path: Path) -> None:
    out = retime(generate_preset("shared-prefix", 30), math.inf)
    assert load_workload(save_workload(out, tmp_path / "w.jsonl")).digest == out.digest


@pytest.mark.parametrize(
    ("rate", "burstiness", "message"),
    [
        (0.0, 1.0, "request rate must be > 0 requests/s, or inf"),
        (-2.0, 1.0, "request rate must be > 0"),
        (math.nan, 1.0, "request rate must be > 0"),
        (1.0, 0.0, "burstiness must be a finite number > 0"),
        (1.0, math.inf, "burstiness must be a finite number > 0"),
        (1e-7, 1.0, r"would arrive over [\d,]+ s, more than the 366 days"),
    ],
)
def test_bad_rates(rate: float, burstiness: float, message: str) -> None:
    with pytest.raises(KvbenchError, match=message):
        retime(generate_preset("mixed-text", 10), rate, burstiness)
