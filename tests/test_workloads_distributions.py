"""Length distributions and arrival processes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from kvbench.workloads.arrivals import ArrivalProcess
from kvbench.workloads.distributions import LengthDist

LENGTH = TypeAdapter(LengthDist)
ARRIVAL = TypeAdapter(ArrivalProcess)


def draw(spec: dict, n: int = 20_000, seed: int = 0) -> np.ndarray:
    return LENGTH.validate_python(spec).sample(np.random.default_rng(seed), n)


def times(spec: dict, n: int = 20_000, seed: int = 0) -> np.ndarray:
    return ARRIVAL.validate_python(spec).times(np.random.default_rng(seed), n)


SPECS = [
    {"kind": "fixed", "value": 100},
    {"kind": "uniform", "low": 10, "high": 500},
    {"kind": "normal", "mean": 300, "std": 200},
    {"kind": "lognormal", "median": 200, "sigma": 1.5},
    {"kind": "zipf", "a": 1.2, "max": 4000},
    {"kind": "empirical", "values": [1, 50, 5000], "weights": [1, 2, 3]},
]


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    lo=st.integers(1, 200),
    width=st.integers(0, 3000),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_kind_respects_min_and_max(spec: dict, lo: int, width: int, seed: int) -> None:
    x = draw({**spec, "min": lo, "max": lo + width}, n=500, seed=seed)
    assert x.dtype == np.int64
    assert x.min() >= lo and x.max() <= lo + width


def test_parameters_roughly_hold() -> None:
    assert set(draw(SPECS[0]).tolist()) == {100}
    u = draw(SPECS[1])
    assert u.min() == 10 and u.max() == 500 and abs(u.mean() - 255) < 5
    n = draw({"kind": "normal", "mean": 300, "std": 50})
    assert abs(n.mean() - 300) < 2 and abs(n.std() - 50) < 2
    ln = draw({"kind": "lognormal", "median": 200, "sigma": 0.5})
    assert abs(np.median(ln) - 200) < 5
    assert abs(ln.mean() - 200 * np.exp(0.5**2 / 2)) < 5
    z = draw({"kind": "zipf", "a": 2.0, "max": 1000})
    # P(1) = 1 / zeta_1000(2) ≈ 0.608
    assert abs((z == 1).mean() - 0.608) < 0.02
    e = draw({"kind": "empirical", "values": [1, 50, 5000], "weights": [1, 0, 3]})
    assert set(e.tolist()) == {1, 5000} and abs((e == 5000).mean() - 0.75) < 0.02


def test_truncated_normal_redraws_instead_of_piling_on_bounds() -> None:
    x = draw({"kind": "normal", "mean": 100, "std": 100, "min": 90, "max": 110})
    counts = np.bincount(x - 90, minlength=21)
    # A clip would put ~46% of draws on each bound; truncation keeps the mass nearly flat.
    assert counts.max() / counts.sum() < 0.1


def test_same_seed_same_draws() -> None:
    assert np.array_equal(draw(SPECS[3], seed=7), draw(SPECS[3], seed=7))
    assert not np.array_equal(draw(SPECS[3], seed=7), draw(SPECS[3], seed=8))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kind": "fixed", "value": -3}, "greater than or equal to 0"),
        ({"kind": "uniform", "low": 5, "high": 1}, "high (1) must be >= low (5)"),
        ({"kind": "normal", "mean": 5, "std": 0}, "greater than 0"),
        ({"kind": "lognormal", "median": -1, "sigma": 1}, "greater than 0"),
        ({"kind": "zipf", "a": 1.5}, "zipf needs max"),
        ({"kind": "empirical", "values": [1, -2]}, "lengths must be >= 0"),
        ({"kind": "empirical", "values": [1, 2], "weights": [1]}, "1 weights for 2 values"),
        ({"kind": "empirical", "values": [1], "weights": [0]}, "positive sum"),
        ({"kind": "fixed", "value": 3, "min": 10, "max": 5}, "max (5) must be >= min (10)"),
        ({"kind": "fixed", "value": 3, "min": -1}, "greater than or equal to 0"),
        ({"kind": "gaussian", "mean": 3}, "does not match any of the expected tags"),
    ],
)
def test_bad_parameters_are_rejected_clearly(spec: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LENGTH.validate_python(spec)


def test_offline_and_constant_arrivals() -> None:
    assert times({"kind": "offline"}, 5).tolist() == [0.0] * 5
    assert times({"kind": "constant", "rate": 4}, 5).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


def test_poisson_mean_gap() -> None:
    gaps = np.diff(times({"kind": "poisson", "rate": 5.0}))
    assert abs(gaps.mean() - 0.2) < 0.01
    assert abs(gaps.var() - 0.04) < 0.004


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_burstiness_sets_gap_variance(burstiness: float) -> None:
    rate = 8.0
    gaps = np.diff(times({"kind": "gamma", "rate": rate, "burstiness": burstiness}, n=100_000))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.06)


def test_arrivals_start_at_zero_and_never_decrease() -> None:
    for spec in ({"kind": "poisson", "rate": 3}, {"kind": "gamma", "rate": 3, "burstiness": 0.1}):
        t = times(spec, 1000)
        assert t[0] == 0.0 and np.all(np.diff(t) >= 0)


def test_trace_arrivals_shift_to_zero_and_need_enough_timestamps() -> None:
    proc = ARRIVAL.validate_python({"kind": "trace", "timestamps_s": [10.0, 10.5, 12.0]})
    assert proc.times(np.random.default_rng(0), 2).tolist() == [0.0, 0.5]
    with pytest.raises(Exception, match="3 timestamps but 4 requests"):
        proc.times(np.random.default_rng(0), 4)
    with pytest.raises(ValidationError, match="must not decrease"):
        ARRIVAL.validate_python({"kind": "trace", "timestamps_s": [1.0, 0.5]})


@pytest.mark.parametrize("kind", ["poisson", "gamma", "constant"])
@pytest.mark.parametrize("rate", [0, -2.5, float("inf")])
def test_bad_rates_are_rejected_with_the_fix(kind: str, rate: float) -> None:
    with pytest.raises(ValidationError, match=r'rate must be .* use kind = "offline"'):
        ARRIVAL.validate_python({"kind": kind, "rate": rate})


def test_bad_burstiness_is_rejected_with_the_fix() -> None:
    with pytest.raises(ValidationError, match=r"burstiness must be > 0 .* use 1 for Poisson"):
        ARRIVAL.validate_python({"kind": "gamma", "rate": 1, "burstiness": 0})
