"""Calibration profiles: the JSON file ``kvbench calibrate`` writes and ``--device
sim:PROFILE.json`` loads (measured points, the fit's errors, the fitted hardware figures)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvbench.engines.sim.hardware import CostCoefficients, Hardware
from kvbench.errors import InputFileError, KvbenchError
from kvbench.fileio import read_text, write_text_atomic
from kvbench.workloads.textstream import too_deep
from kvbench.workloads.validation import validation_message

PROFILE_VERSION = 1

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfilePoint(_Strict):
    batch: int = Field(ge=1)
    context: int = Field(ge=0)
    chunk: int = Field(ge=1)
    held_out: bool
    measured_s: float = Field(gt=0)  # median over rounds
    samples_s: list[float]
    # Process CPU seconds of the same steps: wall / CPU shows how much of a step was spent
    # waiting for a core on a busy machine (or, above 1 thread, CPU spent in parallel).
    cpu_samples_s: list[float]
    predicted_s: float

    @property
    def error_pct(self) -> float:
        return 100 * (self.predicted_s - self.measured_s) / self.measured_s


class FitSummary(_Strict):
    """Absolute relative errors of the fitted model, in percent."""

    train_points: int
    heldout_points: int
    train_median_err_pct: float
    heldout_median_err_pct: float
    heldout_p90_err_pct: float
    heldout_max_err_pct: float
    median_wall_over_cpu: float  # over all samples
    # The structure of the step cost kept (calibrate.fit.FORMS), and each one's held-out
    # median error: the evidence it was kept on. Absent from profiles older than the choice.
    form: str = "operator roofline"
    form_errors_pct: dict[str, float] = {}


class Profile(_Strict):
    kvbench_profile: Literal[1] = PROFILE_VERSION
    created_utc: str
    command: str
    device: str  # the torch device measured, e.g. "cpu" or "cuda:0"
    device_kind: Literal["cpu", "cuda"]
    model: str
    dtype: str
    attention: str
    torch_threads: int  # step times depend on it: simulate runs that use as many
    machine: dict[str, Any]
    # Peak figures the coefficients are relative to, with the fitted coefficients ("coef").
    hardware: dict[str, Any]
    hardware_source: str
    grid: dict[str, Any]
    points: list[ProfilePoint]
    fit: FitSummary

    def hardware_spec(self) -> Hardware:
        return Hardware.from_json(self.hardware)

    def coefficients(self) -> CostCoefficients:
        return self.hardware_spec().coef


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    if not path.exists():
        raise KvbenchError(
            f"no calibration profile at {path}: write one with kvbench calibrate -o {path}"
        )
    text = read_text(path, "calibration profile (.json)")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputFileError(path, f"not a readable JSON profile: {exc}", exc.lineno) from None
    except RecursionError:
        raise too_deep(path, "calibration profile") from None
    try:
        profile = Profile.model_validate(data)
        profile.hardware_spec()
    except ValidationError as exc:
        msg = validation_message(exc)
        raise InputFileError(path, f"invalid calibration profile: {msg}") from None
    except (TypeError, KvbenchError) as exc:
        raise InputFileError(path, f"invalid hardware section: {exc}") from None
    return profile


def save_profile(profile: Profile, path: str | Path) -> Path:
    return write_text_atomic(path, json.dumps(profile.model_dump(), indent=1) + "\n")

