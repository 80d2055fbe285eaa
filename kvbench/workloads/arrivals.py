"""Arrival processes: when each request reaches the server, in seconds from the start.

Every process puts the first arrival at 0 s (a run starts with its first request, as vLLM's
``bench serve`` does) and returns non-decreasing times.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvbench.errors import KvbenchError
from kvbench.workloads.limits import MAX_ARRIVAL_S


def _positive_rate(v: float) -> float:
    if not 0 < v < math.inf:
        raise ValueError(
            f"rate must be a finite number > 0 requests/s (got {v}); "
            'for all requests at time 0 use kind = "offline"'
        )
    return v


class _Process(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @abstractmethod
    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` arrival times in seconds (float64, non-decreasing, first at 0)."""


def _from_gaps(gaps: np.ndarray) -> np.ndarray:
    # n arrivals need n - 1 gaps; the first request arrives at 0.
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if len(gaps) else np.zeros(0)


class OfflineArrivals(_Process):
    """Every request is waiting at time 0 (throughput runs)."""

    kind: Literal["offline"] = "offline"

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.zeros(n)


class PoissonArrivals(_Process):
    """Exponential gaps with mean ``1 / rate``."""

    kind: Literal["poisson"] = "poisson"
    rate: float = Field(description="mean requests per second")

    _rate = field_validator("rate")(_positive_rate)

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return _from_gaps(rng.exponential(1.0 / self.rate, size=n))


class GammaArrivals(_Process):
    """Gamma gaps as in vLLM's ``--burstiness``: shape = burstiness, scale = 1/(rate·burstiness).

    The mean gap stays ``1 / rate``; the gap variance is ``1 / (rate² · burstiness)``, so
    burstiness < 1 is burstier than Poisson, 1 is Poisson, and > 1 is more regular.
    """

    kind: Literal["gamma"] = "gamma"
    rate: float = Field(description="mean requests per second")
    burstiness: float = 1.0

    _rate = field_validator("rate")(_positive_rate)

    @field_validator("burstiness")
    @classmethod
    def _positive_burstiness(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(
                f"burstiness must be > 0 (got {v}); use 1 for Poisson, < 1 for burstier traffic"
            )
        return v

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        scale = 1.0 / (self.rate * self.burstiness)
        return _from_gaps(rng.gamma(self.burstiness, scale, size=n))


class ConstantArrivals(_Process):
    """Exactly ``1 / rate`` seconds apart."""

    kind: Literal["constant"] = "constant"
    rate: float = Field(description="requests per second")

    _rate = field_validator("rate")(_positive_rate)

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.arange(n) / self.rate


class TraceArrivals(_Process):
    """Given timestamps (seconds, non-decreasing), shifted so the first is at 0."""

    kind: Literal["trace"] = "trace"
    timestamps_s: list[float] = Field(min_length=1)

    @field_validator("timestamps_s")
    @classmethod
    def _ordered(cls, v: list[float]) -> list[float]:
        for i in range(1, len(v)):
            if v[i] < v[i - 1]:
                raise ValueError(
                    f"timestamps must not decrease (entry {i}: {v[i]} < {v[i - 1]}); sort them"
                )
        if not v[-1] - v[0] <= MAX_ARRIVAL_S:  # also false for NaN and infinities
            raise ValueError(
                f"timestamps span {v[-1] - v[0]!r} s, more than the {MAX_ARRIVAL_S:.0f} s "
                "(366 days) a workload may span"
            )
        return v

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if n > len(self.timestamps_s):
            raise KvbenchError(
                f"the arrival trace has {len(self.timestamps_s)} timestamps but {n} requests "
                "were asked for; ask for fewer requests or give more timestamps"
            )
        t = np.asarray(self.timestamps_s[:n], dtype=np.float64)
        return t - t[0]


ArrivalProcess = Annotated[
    OfflineArrivals | PoissonArrivals | GammaArrivals | ConstantArrivals | TraceArrivals,
    Field(discriminator="kind"),
]
