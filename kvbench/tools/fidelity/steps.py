"""The steps of a real run as the cost model sees them: each step's batch shape beside the
wall time the engine took for it, kept so that the fit and the step errors can be computed
again later from the file alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from kvbench.engines.base import BatchShape, StepReport
from kvbench.errors import InputFileError
from kvbench.fileio import read_text, write_text_atomic

_FIELDS = [f.name for f in dataclasses.fields(BatchShape)]


class StepTap:
    """An engine that records the batch shape of every step the engine under it reports; all
    else is the engine's own."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.shapes: list[BatchShape] = []

    def step(self) -> StepReport:
        report = self.engine.step()
        self.shapes.append(report.batch)
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


@dataclasses.dataclass(slots=True)
class StepSample:
    """The steps of one real run, in order: shapes and measured seconds."""

    shapes: list[BatchShape]
    seconds: list[float]

    def save(self, path: Path) -> Path:
        columns: dict[str, list[float] | list[int]] = {
            name: [getattr(s, name) for s in self.shapes] for name in _FIELDS
        }
        columns["seconds"] = self.seconds
        return write_text_atomic(path, json.dumps(columns) + "\n")

    @classmethod
    def load(cls, path: Path) -> StepSample:
        try:
            data = json.loads(read_text(path, "step file (.json)"))
            n = len(data["seconds"])
            shapes = [BatchShape(**{k: int(data[k][i]) for k in _FIELDS}) for i in range(n)]
            seconds = [float(x) for x in data["seconds"]]
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise InputFileError(path, f"not a step file of a fidelity check: {exc}") from None
        return cls(shapes, seconds)
