"""``kvbench run --save-result FILE.json``: one small JSON file with a run's figures, for
scripts and dashboards that want the summary without reading a record folder.

Format (``schema`` 1): one object with ``schema`` (integer; bumped when a field changes
meaning or goes away), ``kvbench_version``, ``command``, ``date`` (UTC, ISO 8601, when the
file was written), ``machine`` (as in the records), ``suite``, ``workload`` (``name``,
``digest``, ``requests``), ``device``, ``clock`` and ``engines``: per engine name its
``status`` (``ok`` | ``interrupted`` | ``failed``), ``error`` (null unless failed),
``warnings`` and ``summary`` (the record's metrics, by the record schema's names; a value
that is no finite number is null). No curves and no per-request rows: those stay in the
records.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.fileio import write_text_atomic
from kvbench.results.paths import path_length_problem
from kvbench.results.schema import RunRecord

SAVE_RESULT_SCHEMA = 1


def check_save_result_path(path: Path) -> None:
    """Refuse a path the file cannot be written at, before the run spends any time."""
    if (problem := path_length_problem(str(path), "--save-result")) is not None:
        raise KvbenchError(problem)
    if path.suffix != ".json":
        raise KvbenchError(f"--save-result {str(path)!r}: give a file name ending in .json")
    if path.is_dir():
        raise KvbenchError(f"--save-result {str(path)!r} is a folder: give a file path, "
                           "e.g. result.json")


def _number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def save_result_data(records: list[RunRecord], command: str) -> dict[str, Any]:
    """The save-result object of a run's ``records`` (one per engine, same workload)."""
    if not records:
        raise KvbenchError("no engine ran: there is no result to save")
    first = records[0]
    return {
        "schema": SAVE_RESULT_SCHEMA,
        "kvbench_version": first.kvbench_version,
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": first.machine,
        "suite": first.suite,
        "workload": {"name": first.workload.name, "digest": first.workload.digest,
                     "requests": first.workload.num_requests},
        "device": first.device,
        "clock": first.clock,
        "engines": {
            r.engine: {"status": r.status, "error": r.error, "warnings": r.warnings,
                       "summary": _number(r.summary)}
            for r in records
        },
    }


def write_save_result(path: Path, records: list[RunRecord], command: str) -> Path:
    text = json.dumps(save_result_data(records, command), indent=1, allow_nan=False)
    return write_text_atomic(path, text + "\n")
