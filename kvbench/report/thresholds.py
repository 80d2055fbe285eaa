"""Regression thresholds (``ci/thresholds.toml``): how ``kvbench compare`` judges each metric
and curve.

Each rule has a ``direction`` (which way is better), a relative ``tolerance``, an optional
``abs_tolerance`` floor in the metric's own unit, and a ``kind``:

- ``deterministic``: the same on every run of the same workload and engine (counts fixed by
  the configuration); compared within ``[gate].exact_tolerance`` on any clock.
- ``timing``: measured on the machine (RSS, device memory, wall time); compared with the
  noise rule on any clock, and only against a baseline from the same machine.
- ``clock``: follows the record's clock. Under the virtual clock, time is the cost model's,
  so these metrics are deterministic; under the wall clock they are timing.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbench.errors import InputFileError

Kind = Literal["deterministic", "timing", "clock"]
Direction = Literal["lower", "higher"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GateSettings(_Strict):
    # Relative change a deterministic comparison allows: absorbs float summation order only.
    exact_tolerance: float = Field(default=1e-9, ge=0)
    # Timing metrics: a change counts only beyond noise_k baseline spreads (scaled MAD).
    noise_k: float = Field(default=3.0, ge=0)
    # Curves are compared on this many equal slices of each run's duration.
    curve_points: int = Field(default=100, ge=2)
    # Timing curves may shift in time by this fraction of the run without counting.
    curve_time_slack: float = Field(default=0.02, ge=0, lt=1)


class MetricRule(_Strict):
    direction: Direction
    kind: Kind
    tolerance: float = Field(ge=0)
    abs_tolerance: float = Field(default=0.0, ge=0)


class CurveRule(MetricRule):
    # Curve of times the values are sampled at (most curves share ``t_s``).
    time: str = "t_s"


class Thresholds(_Strict):
    gate: GateSettings = Field(default_factory=GateSettings)
    metrics: dict[str, MetricRule]
    curves: dict[str, CurveRule] = Field(default_factory=dict)


def load_thresholds(path: str | Path) -> Thresholds:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputFileError(path, f"cannot read thresholds: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(path, f"invalid TOML: {exc}") from None
    try:
        return Thresholds.model_validate(data)
    except ValidationError as exc:
        msgs = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise InputFileError(path, f"invalid thresholds: {msgs}") from None
