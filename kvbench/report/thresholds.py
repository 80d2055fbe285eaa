"""Regression thresholds: how much each metric and curve may move before ``kvbench compare``
counts the change.

The defaults ship with kvbench (``kvbench/report/thresholds.toml``, also ``ci/thresholds.toml``
in the repository); ``--thresholds FILE`` replaces them. A file sets, per metric or curve, a
relative ``tolerance`` and an optional ``abs_tolerance`` floor in the metric's own unit, and
``[gate]`` settings. Which way is better and whether a metric is deterministic, follows the
clock or is a timing measurement are properties of the metric, read from
:mod:`kvbench.results.metric_table`; a file can only gate metrics and curves listed there
with a direction.

A file that drops or loosens a gate of the defaults says so (:func:`relaxations`); one that
drops or loosens the gates on requests served (``completed``, ``failed``) is refused unless
the user accepts it (:func:`check_relaxations`), since a lost request would then pass.
"""

from __future__ import annotations

import importlib.resources
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvbench.errors import InputFileError
from kvbench.fileio import read_text
from kvbench.results.metric_table import CURVE_BY_NAME, CURVE_TIME, METRIC_BY_NAME, closest

DEFAULT_FILE = "thresholds.toml"
DEFAULT_LABEL = f"kvbench/report/{DEFAULT_FILE} (built in)"
# Gates on the requests a run served: without them a lost request passes.
REQUEST_GATES = ("completed", "failed")
# Gate settings that widen every metric's band, the request gates' included.
_BAND_SETTINGS = ("exact_tolerance", "noise_k")

# A tolerance: finite (inf would let every change pass) and not negative.
Tolerance = Annotated[float, Field(ge=0, allow_inf_nan=False)]

# Keys older thresholds files set, now properties of the metric table.
_REMOVED_KEYS = {
    "direction": "which way is better comes from kvbench's metric table",
    "kind": "whether a metric is deterministic, follows the clock or is timing comes from "
            "kvbench's metric table",
    "time": f"every curve is sampled over {CURVE_TIME}",
}


class _Strict(BaseModel):
    # Strict: "0.1" (a string) or true is a mistake in a thresholds file, not a number.
    model_config = ConfigDict(extra="forbid", strict=True)


class GateSettings(_Strict):
    # Relative change a deterministic comparison allows: absorbs float summation order only.
    exact_tolerance: Tolerance = 1e-9
    # Timing metrics: a change counts only beyond noise_k baseline spreads (scaled MAD).
    noise_k: Tolerance = 3.0
    # Curves are compared on this many equal slices of each run's duration.
    curve_points: int = Field(default=100, ge=2, le=100_000)
    # Timing curves may shift in time by this fraction of the run without counting.
    curve_time_slack: float = Field(default=0.02, ge=0, lt=1, allow_inf_nan=False)


class MetricRule(_Strict):
    """How far a metric (or curve) may move: ``tolerance`` relative to the baseline, and at
    least ``abs_tolerance`` in the metric's unit."""

    tolerance: Tolerance
    abs_tolerance: Tolerance = 0.0

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in _REMOVED_KEYS.items():
                if key in data:
                    raise ValueError(f"{key!r} is no longer set here ({why}); remove it")
        return data


def _unknown(name: str, table: dict[str, Any], what: str) -> str:
    gateable = sorted(n for n, spec in table.items() if spec.gateable)
    guess = closest(name, gateable)
    hint = f"did you mean {guess!r}?" if guess else f"gateable {what}s: {', '.join(gateable)}"
    return f"unknown {what} {name!r}; {hint}"


class Thresholds(_Strict):
    gate: GateSettings = Field(default_factory=GateSettings)
    metrics: dict[str, MetricRule] = Field(default_factory=dict)
    curves: dict[str, MetricRule] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_names(self) -> Thresholds:
        problems = []
        for section, table, what in (("metrics", METRIC_BY_NAME, "metric"),
                                     ("curves", CURVE_BY_NAME, "curve")):
            for name in getattr(self, section):
                spec = table.get(name)
                if spec is None:
                    problems.append(f"{section}.{name}: {_unknown(name, table, what)}")
                elif not spec.gateable:
                    problems.append(
                        f"{section}.{name}: {what} {name!r} describes the run, not how well it "
                        "went (no way is better), so it cannot be gated; remove it"
                    )
        if not self.metrics and not self.curves:
            problems.append("no metrics or curves to gate: add a metrics.NAME table")
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _messages(exc: ValidationError) -> str:
    out = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e["loc"])
        if e["type"] == "value_error":
            msg = str(e["ctx"]["error"])
        elif e["type"] == "extra_forbidden" and e["loc"]:
            msg = "unknown key"
            fields = {"gate": GateSettings, "metrics": MetricRule, "curves": MetricRule}
            model = fields.get(str(e["loc"][0])) if len(e["loc"]) > 1 else Thresholds
            guess = closest(str(e["loc"][-1]), list(model.model_fields)) if model else None
            if guess:
                msg += f"; did you mean {guess!r}?"
        else:
            msg = e["msg"]
        out.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(out)


def parse_thresholds(text: str, source: str | Path) -> Thresholds:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputFileError(source, f"invalid TOML: {exc}") from None
    except RecursionError:
        raise InputFileError(source, "nested too deeply to read: not a thresholds file") from None
    try:
        return Thresholds.model_validate(data)
    except ValidationError as exc:
        raise InputFileError(source, f"invalid thresholds: {_messages(exc)}") from None


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """The thresholds in ``path``, or kvbench's defaults."""
    if path is None:
        default = importlib.resources.files("kvbench.report") / DEFAULT_FILE
        return parse_thresholds(default.read_text(encoding="utf-8"), DEFAULT_LABEL)
    return parse_thresholds(read_text(path, "thresholds"), path)


@dataclass(frozen=True, slots=True)
class Relaxation:
    """A gate of kvbench's defaults that a thresholds file drops or loosens."""

    key: str  # "metrics.kv_waste_pct", "metrics.completed.tolerance", "gate.noise_k"
    change: str  # "dropped", "0 -> 0.5"
    # Loosens the gates on requests served (REQUEST_GATES).
    requests: bool

    def __str__(self) -> str:
        return f"{self.key} {self.change}"


def _looser(key: str, old: float, new: float, requests: bool) -> list[Relaxation]:
    return [Relaxation(key, f"{old:g} -> {new:g}", requests)] if new > old else []


def relaxations(th: Thresholds, defaults: Thresholds) -> list[Relaxation]:
    """Every gate of ``defaults`` that ``th`` drops or loosens: wider tolerances or bands,
    fewer curve slices (a short bump hides in a wider slice), more time slack."""
    out: list[Relaxation] = []
    for key in ("exact_tolerance", "noise_k", "curve_time_slack"):
        out += _looser(f"gate.{key}", getattr(defaults.gate, key), getattr(th.gate, key),
                       key in _BAND_SETTINGS)
    if th.gate.curve_points < defaults.gate.curve_points:
        out.append(Relaxation("gate.curve_points", f"{defaults.gate.curve_points} -> "
                              f"{th.gate.curve_points}", False))
    for section in ("metrics", "curves"):
        mine: dict[str, MetricRule] = getattr(th, section)
        for name, rule in getattr(defaults, section).items():
            requests = section == "metrics" and name in REQUEST_GATES
            if name not in mine:
                out.append(Relaxation(f"{section}.{name}", "dropped", requests))
                continue
            for field in ("tolerance", "abs_tolerance"):
                out += _looser(f"{section}.{name}.{field}", getattr(rule, field),
                               getattr(mine[name], field), requests)
    return out


def check_relaxations(th: Thresholds, source: str | Path, *, allow_loose: bool) -> list[str]:
    """What ``th`` (read from ``source``) drops or loosens of kvbench's defaults, as text.
    Refuses a file that drops or loosens the gates on requests served, unless
    ``allow_loose``."""
    found = relaxations(th, load_thresholds())
    guarded = [str(r) for r in found if r.requests]
    if guarded and not allow_loose:
        raise InputFileError(source, (
            f"drops or loosens the gates on {' and '.join(REQUEST_GATES)} requests relative "
            f"to kvbench's defaults ({'; '.join(guarded)}), so a lost request would pass; "
            f"gate them as {DEFAULT_LABEL} does, or pass --allow-loose to accept it"
        ))
    return [str(r) for r in found]
