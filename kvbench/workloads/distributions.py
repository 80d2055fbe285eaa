"""Token-length distributions for generated requests.

Every distribution draws integers and then clips them to ``[min, max]`` (``min`` defaults to
1 token; ``max`` to ``limits.MAX_SEQUENCE_TOKENS``, which no bound or value may exceed). The
truncated normal redraws out-of-range values instead of piling them on the bounds, and the
bounded Zipf only ever draws inside them.

In a spec file a distribution is a table with a ``kind``::

    prompt = { kind = "lognormal", median = 256, sigma = 0.8, max = 1024 }
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvbench.workloads.limits import MAX_SEQUENCE_TOKENS

# Redraw rounds for the truncated normal; values still outside after this are clipped, which
# only happens when the bounds hold a vanishing share of the mass.
_NORMAL_REDRAWS = 64
# A bounded Zipf materialises its probability table; this caps its size.
_ZIPF_MAX_SUPPORT = 10_000_000


class _Length(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min: int = Field(1, ge=0, le=MAX_SEQUENCE_TOKENS, description="smallest length drawn (tokens)")
    max: int | None = Field(
        None, ge=0, le=MAX_SEQUENCE_TOKENS,
        description="largest length drawn (tokens); None: limits.MAX_SEQUENCE_TOKENS",
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> _Length:
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self

    def _clip(self, x: np.ndarray) -> np.ndarray:
        top = MAX_SEQUENCE_TOKENS if self.max is None else self.max
        return np.clip(np.rint(x), self.min, top).astype(np.int64)

    @abstractmethod
    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths as an int64 array."""


class FixedLength(_Length):
    """Always ``value`` tokens."""

    kind: Literal["fixed"] = "fixed"
    value: int = Field(ge=0, le=MAX_SEQUENCE_TOKENS)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(np.full(n, self.value))


class UniformLength(_Length):
    """Uniform over the integers ``low..high`` (both included)."""

    kind: Literal["uniform"] = "uniform"
    low: int = Field(ge=0, le=MAX_SEQUENCE_TOKENS)
    high: int = Field(ge=0, le=MAX_SEQUENCE_TOKENS)

    @model_validator(mode="after")
    def _range_ordered(self) -> UniformLength:
        if self.high < self.low:
            raise ValueError(f"high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.integers(self.low, self.high, size=n, endpoint=True))


class NormalLength(_Length):
    """Normal with ``mean`` and ``std``, truncated to ``[min, max]`` by redrawing."""

    kind: Literal["normal"] = "normal"
    mean: float
    std: float = Field(gt=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        hi = np.inf if self.max is None else self.max + 0.5
        lo = self.min - 0.5
        x = rng.normal(self.mean, self.std, size=n)
        for _ in range(_NORMAL_REDRAWS):
            bad = (x < lo) | (x >= hi)
            if not bad.any():
                break
            x[bad] = rng.normal(self.mean, self.std, size=int(bad.sum()))
        return self._clip(x)


class LognormalLength(_Length):
    """Log-normal given by its ``median`` and the ``sigma`` of its logarithm.

    The median is the natural scale (half the lengths fall below it) and is what trace
    summaries report; the mean is ``median · exp(sigma² / 2)``.
    """

    kind: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(gt=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return self._clip(rng.lognormal(np.log(self.median), self.sigma, size=n))


class ZipfLength(_Length):
    """Bounded Zipf: P(length = k) ∝ k^-a for k in ``[max(min, 1), max]``; ``max`` is required."""

    kind: Literal["zipf"] = "zipf"
    a: float = Field(gt=0)

    @model_validator(mode="after")
    def _bounded(self) -> ZipfLength:
        if self.max is None:
            raise ValueError("zipf needs max (the largest length); add e.g. max = 2048")
        if self.max < 1:
            raise ValueError(f"zipf needs max >= 1 (got {self.max})")
        if self.max - max(self.min, 1) >= _ZIPF_MAX_SUPPORT:
            raise ValueError(f"zipf support max - min must be under {_ZIPF_MAX_SUPPORT:,}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        assert self.max is not None
        k = np.arange(max(self.min, 1), self.max + 1, dtype=np.float64)
        p = k ** -self.a
        return self._clip(rng.choice(k, size=n, p=p / p.sum()))


class EmpiricalLength(_Length):
    """Draws from ``values`` (with ``weights`` if given, else uniformly)."""

    kind: Literal["empirical"] = "empirical"
    values: list[int] = Field(min_length=1)
    weights: list[float] | None = None

    @field_validator("values")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if min(v) < 0:
            raise ValueError(f"lengths must be >= 0 (got {min(v)})")
        if max(v) > MAX_SEQUENCE_TOKENS:
            raise ValueError(f"lengths must be <= {MAX_SEQUENCE_TOKENS:,} (got {max(v):,})")
        return v

    @model_validator(mode="after")
    def _weights_match(self) -> EmpiricalLength:
        w = self.weights
        if w is None:
            return self
        if len(w) != len(self.values):
            raise ValueError(f"{len(w)} weights for {len(self.values)} values; give one per value")
        if min(w) < 0 or sum(w) <= 0:
            raise ValueError("weights must be >= 0 with a positive sum")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        p = None if self.weights is None else np.asarray(self.weights) / sum(self.weights)
        return self._clip(rng.choice(np.asarray(self.values), size=n, p=p))


LengthDist = Annotated[
    FixedLength | UniformLength | NormalLength | LognormalLength | ZipfLength | EmpiricalLength,
    Field(discriminator="kind"),
]
