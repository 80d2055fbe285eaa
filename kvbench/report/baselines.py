"""Stored baselines: ``results/baselines/<machine>/<suite>/<engine>.json``.

A baseline is a run record without its per-request rows (the gate reads the summary, the
repeats and the curves; the full record stays with the run's artifacts). Virtual-clock
records are the same on every machine, so they are stored once under ``any``; wall-clock
records are stored per machine, named by :func:`machine_slug`. Suite, engine and machine
names become path components, so each must be one plain name
(:func:`kvbench.results.paths.check_path_component`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.errors import KvbenchError
from kvbench.report.outputs import check_output_dir, write_outputs
from kvbench.results.paths import check_path_component
from kvbench.results.recordset import FoundRecord
from kvbench.results.schema import REPEATS_KEY, RunRecord, is_number

DEFAULT_ROOT = Path("results/baselines")
ANY_MACHINE = "any"
# Marketing words that make CPU names long without telling machines apart.
_NOISE_WORDS = re.compile(r"\((r|tm)\)|\bcpu\b|@.*$", re.IGNORECASE)


def slugify(text: str) -> str:
    slug = re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")
    return re.sub(r"-{2,}", "-", slug)


def _major_minor(version: str | None) -> str | None:
    if not version:
        return None
    return ".".join(version.split("+")[0].split(".")[:2])


def machine_slug(info: dict[str, Any]) -> str:
    """Hardware and the software that changes timings: GPU name and count with CUDA, or CPU
    model and core count; then the torch version (major.minor)."""
    gpu = info.get("gpu")
    if gpu:
        parts = [gpu.get("name", "gpu"), f"x{gpu.get('count', 1)}"]
        if gpu.get("cuda"):
            parts.append(f"cuda{gpu['cuda']}")
    else:
        parts = [_NOISE_WORDS.sub(" ", str(info.get("cpu") or "cpu")), f"x{info.get('cpu_count')}"]
    torch = _major_minor((info.get("versions") or {}).get("torch"))
    if torch:
        parts.append(f"torch{torch}")
    return slugify(" ".join(parts))


def baseline_machine(found: FoundRecord, machine: str | None) -> str:
    if found.record.clock == "virtual":
        return ANY_MACHINE
    return slugify(machine) if machine else machine_slug(found.record.machine)


def _non_finite(record: RunRecord) -> str | None:
    """The first metric or curve holding NaN or an infinity. Stored JSON would hold null
    there, and the gate would then skip the metric instead of failing it."""
    summary = {k: v for k, v in record.summary.items() if k != REPEATS_KEY}
    repeats = record.summary.get(REPEATS_KEY) or {}
    for where, columns in (("metric", {k: [v] for k, v in summary.items()}),
                           ("repeat values of metric", repeats), ("curve", record.curves)):
        for name, values in columns.items():
            bad = next((v for v in values if is_number(v) and not math.isfinite(v)), None)
            if bad is not None:
                return f"{where} {name} is {bad}"
    return None


def baseline_path(root: Path, f: FoundRecord, machine: str | None) -> Path:
    """Where ``f`` is stored; a KvbenchError if a name would not be one path component."""
    r = f.record
    try:
        return (root / check_path_component(baseline_machine(f, machine), "machine")
                / check_path_component(r.suite, "suite")
                / f"{check_path_component(r.engine, 'engine')}.json")
    except KvbenchError as exc:
        raise KvbenchError(f"{f.path}: {exc}; the record cannot be stored as a baseline") from None


def save_baselines(
    found: Sequence[FoundRecord], root: Path = DEFAULT_ROOT, machine: str | None = None
) -> list[Path]:
    """Store each record as the baseline of its suite and engine; all are checked first, so
    a bad input writes nothing."""
    if machine is not None and not slugify(machine):
        raise KvbenchError(f"machine name {machine!r} has no letters or digits")
    check_output_dir(root, "baselines folder")
    targets: dict[Path, FoundRecord] = {}
    for f in found:
        if f.record.status != "ok":
            raise KvbenchError(
                f"{f.path}: {f.record.engine} ended {f.record.status!r}; only a complete run "
                "can be a baseline"
            )
        if bad := _non_finite(f.record):
            raise KvbenchError(
                f"{f.path}: {bad}; a baseline must hold measured numbers, save another run"
            )
        path = baseline_path(root, f, machine)
        if path in targets:
            raise KvbenchError(
                f"two records would both be the baseline at {path}: {targets[path].path} and "
                f"{f.path}; save them one run folder at a time"
            )
        targets[path] = f
    return write_outputs([
        (path, f.record.model_copy(update={"requests": []}).to_json(), f"the baseline of {f.path}")
        for path, f in targets.items()
    ])
