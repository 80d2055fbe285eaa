"""The steps of a real run as the cost model sees them: each step's batch shape beside the
wall time the engine took for it and the time the run loop spent before it while requests
were pending, kept so that the fit and the step errors can be computed again later from the
file alone.

A simulated clock advances by the predicted step times alone, so the loop's own time between
busy steps (recording tokens, adding arrivals, telemetry) is part of what a step must be
predicted to cost: the fit's target is a step's cycle, its gap plus its step."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from kvbench.engines.base import BatchShape, StepReport
from kvbench.errors import InputFileError
from kvbench.fileio import read_text, write_text_atomic

_FIELDS = [f.name for f in dataclasses.fields(BatchShape)]
_ADDED = {"decode_pairs"}


class StepTap:
    """An engine that records every step the engine under it takes: the batch shape, its
    wall seconds, and the seconds since the previous step ended if requests were pending
    then (else 0: the loop was waiting for an arrival); they are written to ``path`` when
    the engine closes. All else is the engine's own. ``functools.partial(StepTap,
    path=...)`` is the wrap a run takes (kvbench.run.execute), in its own process too."""

    def __init__(self, engine: Any, path: Path) -> None:
        self.engine = engine
        self.path = path
        self.shapes: list[BatchShape] = []
        self.seconds: list[float] = []
        self.gaps: list[float] = []
        self._busy_since: float | None = None

    def step(self) -> StepReport:
        t0 = time.perf_counter()
        report = self.engine.step()
        t1 = time.perf_counter()
        self.shapes.append(report.batch)
        self.seconds.append(t1 - t0)
        self.gaps.append(0.0 if self._busy_since is None else t0 - self._busy_since)
        self._busy_since = t1 if self.engine.has_unfinished() else None
        return report

    def close(self) -> None:
        StepSample(self.shapes, self.seconds, self.gaps).save(self.path)
        self.engine.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@dataclasses.dataclass(slots=True)
class StepSample:
    """The steps of one real run, in order: shapes, measured seconds and the loop's gaps."""

    shapes: list[BatchShape]
    seconds: list[float]
    gaps: list[float]

    @classmethod
    def join(cls, samples: list[StepSample]) -> StepSample:
        return cls([s for x in samples for s in x.shapes], [s for x in samples for s in x.seconds],
                   [g for x in samples for g in x.gaps])

    @property
    def cycles(self) -> list[float]:
        return [g + s for g, s in zip(self.gaps, self.seconds, strict=True)]

    def save(self, path: Path) -> Path:
        columns: dict[str, list[float] | list[int]] = {
            name: [getattr(s, name) for s in self.shapes] for name in _FIELDS
        }
        columns["seconds"] = self.seconds
        columns["gaps"] = self.gaps
        return write_text_atomic(path, json.dumps(columns) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepSample:
        try:
            data = json.loads(read_text(path, "step file (.json)"))
            n = len(data["seconds"])
            # Files written before a field existed leave it at its default.
            fields = [k for k in _FIELDS if k in data or k not in _ADDED]
            shapes = [BatchShape(**{k: int(data[k][i]) for k in fields}) for i in range(n)]
            seconds = [float(x) for x in data["seconds"]]
            gaps = [float(x) for x in data["gaps"]]
            if len(gaps) != n:
                raise ValueError(f"{len(gaps)} gaps for {n} steps")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise InputFileError(path, f"not a step file of a fidelity check: {exc}") from None
        return cls(shapes, seconds, gaps)
